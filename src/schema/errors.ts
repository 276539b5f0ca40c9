import { createGraphQLError } from 'graphql-yoga';
import { EngineError, type EngineErrorCode } from '../engine.js';

/** An expected failure with its `extensions.code`. */
export function userError(code: EngineErrorCode, message: string) {
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

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

export function checkToken(token: string): string {
  if (!UUID.test(token)) throw userError('BAD_USER_INPUT', `malformed token "${token}": expected a UUID`);
  return token.toLowerCase();
}
