import { createGraphQLError } from 'graphql-yoga';
import { isAdmin, type Principal } from '../auth/principal.js';
import { EngineError, isUuid, type EngineErrorCode } from '../engine.js';

/** Codes a client may meet in `extensions.code`: the engine's, and the edge's own. */
export type ErrorCode = EngineErrorCode | 'UNAUTHENTICATED' | 'RATE_LIMITED';

/** An expected failure with its `extensions.code`. */
export function userError(code: ErrorCode, message: string) {
  return createGraphQLError(message, { extensions: { code } });
}

/** EngineErrors become coded GraphQL errors; anything else stays as it is (and is masked at the edge). */
export function toGraphQLError(error: unknown): unknown {
  return error instanceof EngineError ? userError(error.code, error.message) : error;
}

/** Run a resolver body, turning expected engine failures into coded GraphQL errors. */
export async function guard<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (error) {
    throw toGraphQLError(error);
  }
}

/** Tokens and batch ids are UUIDs: anything else is BAD_USER_INPUT before the database is asked. */
export function checkToken(token: string, what = 'token'): string {
  if (!isUuid(token)) throw userError('BAD_USER_INPUT', `malformed ${what} "${token}": expected a UUID`);
  return token.toLowerCase();
}

/** Admin-only actions: FORBIDDEN for anyone else, before anything is read or written. */
export function requireAdmin(principal: Principal, what: string): void {
  if (!isAdmin(principal)) throw userError('FORBIDDEN', `${what} needs the admin role`);
}
