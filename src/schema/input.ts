import { LONE_SURROGATE } from '../engine.js';
import { userError } from './errors.js';

/**
 * Input neither database can store or a recursive walk cannot survive is the caller's mistake: a coded
 * BAD_USER_INPUT at the edge, not a database error masked as INTERNAL_SERVER_ERROR after the fact.
 */

/** Deepest nesting of objects and arrays in one request's variables (a call's arguments sit about 4 levels down). */
export const MAX_JSON_DEPTH = 100;

/** Why a string cannot be stored (PostgreSQL text and jsonb refuse NUL; neither database nor UTF-8 holds a lone surrogate), or null. */
export function textProblem(value: string): string | null {
  if (value.includes('\u0000')) return 'contains a NUL character (\\u0000)';
  if (LONE_SURROGATE.test(value)) return 'contains a lone UTF-16 surrogate (not a Unicode character)';
  return null;
}

export function checkText(value: string, what: string): string {
  const problem = textProblem(value);
  if (problem) throw userError('BAD_USER_INPUT', `${what} ${problem}`);
  return value;
}

/**
 * Every string (keys too) of a JSON value stored as text, and its nesting at most `maxDepth`; walked without
 * recursion, so a 20,000-deep value is refused rather than overflowing the stack.
 */
export function checkJsonValue(value: unknown, what: string, maxDepth = MAX_JSON_DEPTH): void {
  const stack: { value: unknown; depth: number; path: string }[] = [{ value, depth: 0, path: what }];
  for (let item = stack.pop(); item; item = stack.pop()) {
    const { value: v, depth, path } = item;
    if (typeof v === 'string') {
      checkText(v, path);
    } else if (typeof v === 'number') {
      // JSON's 1e400 parses to Infinity, which JSON.stringify would store as null without a word
      if (!Number.isFinite(v)) throw userError('BAD_USER_INPUT', `${path} holds a number beyond what a double can hold`);
    } else if (typeof v === 'object' && v !== null) {
      if (depth >= maxDepth) throw userError('BAD_USER_INPUT', `${what} is nested deeper than ${maxDepth} levels`);
      for (const [key, child] of Object.entries(v)) {
        checkText(key, `a key in ${path}`);
        stack.push({ value: child, depth: depth + 1, path: Array.isArray(v) ? `${path}[${key}]` : `${path}.${key}` });
      }
    }
  }
}

/** Years both engines store as a timestamp (PostgreSQL timestamptz and SQL Server datetime2 both hold 1970…9999). */
export function checkRunAt(runAt: Date | null | undefined): Date | null {
  if (runAt == null) return null;
  const year = runAt.getUTCFullYear();
  if (Number.isNaN(year) || year < 1970 || year > 9999) {
    throw userError('BAD_USER_INPUT', `runAt must be between the years 1970 and 9999, got ${Number.isNaN(year) ? 'an invalid date' : runAt.toISOString()}`);
  }
  return runAt;
}

const MAX_BIGINT = 2n ** 63n - 1n;

/** A page cursor is an execution id: a positive bigint. */
export function checkPageCursor(cursor: string | null | undefined): string | null {
  if (cursor == null) return null;
  if (!/^\d{1,19}$/.test(cursor) || BigInt(cursor) > MAX_BIGINT) throw userError('BAD_USER_INPUT', `malformed cursor "${cursor}"`);
  return cursor;
}
