import { getOperationAST, Kind, type DocumentNode, type SelectionSetNode } from 'graphql';
import { createGraphQLError, type Plugin } from 'graphql-yoga';
import type { Principal } from './principal.js';

/**
 * A token bucket per caller: `burst` mutations at once, refilled at `perSecond`; a mutation costs
 * one token per root field (aliases count: `a: cancelExecution … b: cancelExecution …` is two).
 * In memory, per process: several instances each allow the rate.
 */
export class RateLimiter {
  private readonly buckets = new Map<string, { tokens: number; at: number }>();

  constructor(
    readonly perSecond: number,
    readonly burst: number,
    private readonly now: () => number = Date.now,
  ) {}

  /**
   * Take `count` tokens (at most `burst`): 0 when allowed, else the seconds to wait before that
   * many are free (nothing is taken then).
   */
  take(key: string, count = 1): number {
    const now = this.now();
    const bucket = this.buckets.get(key) ?? { tokens: this.burst, at: now };
    bucket.tokens = Math.min(this.burst, bucket.tokens + ((now - bucket.at) / 1000) * this.perSecond);
    bucket.at = now;
    if (this.buckets.size >= 10_000 && !this.buckets.has(key)) this.sweep(now);
    this.buckets.set(key, bucket);
    if (bucket.tokens >= count) {
      bucket.tokens -= count;
      return 0;
    }
    return Math.max(1, Math.ceil((count - bucket.tokens) / this.perSecond));
  }

  /** Forget callers whose bucket has filled up again: they are as new. */
  private sweep(now: number): void {
    for (const [key, bucket] of this.buckets) {
      if (bucket.tokens + ((now - bucket.at) / 1000) * this.perSecond >= this.burst) this.buckets.delete(key);
    }
  }
}

/**
 * The fields a selection set asks for at its own level, through inline fragments and fragment
 * spreads (each fragment once: a spread cycle is refused by validation, which runs first).
 */
export function rootFieldCount(selectionSet: SelectionSetNode, document: DocumentNode, seen = new Set<string>()): number {
  let count = 0;
  for (const selection of selectionSet.selections) {
    if (selection.kind === Kind.FIELD) count += selection.name.value === '__typename' ? 0 : 1;
    else if (selection.kind === Kind.INLINE_FRAGMENT) count += rootFieldCount(selection.selectionSet, document, seen);
    else if (!seen.has(selection.name.value)) {
      seen.add(selection.name.value);
      const fragment = document.definitions.find((d) => d.kind === Kind.FRAGMENT_DEFINITION && d.name.value === selection.name.value);
      if (fragment?.kind === Kind.FRAGMENT_DEFINITION) count += rootFieldCount(fragment.selectionSet, document, seen);
    }
  }
  return count;
}

/**
 * Refuse a mutation over the caller's rate with RATE_LIMITED, HTTP 429 and Retry-After; nothing
 * runs. Each of its root fields is one mutation: 50 aliased cancelExecution fields in one
 * request cost 50, as 50 requests would. One asking for more than the burst can never run.
 */
export function useMutationRateLimit(limiter: RateLimiter): Plugin<{ principal?: Principal }> {
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const operation = getOperationAST(args.document, args.operationName);
      if (operation?.operation !== 'mutation') return;
      const count = rootFieldCount(operation.selectionSet, args.document);
      if (count === 0) return;
      if (count > limiter.burst) {
        setResultAndStopExecution({
          errors: [
            createGraphQLError(`too many mutations in one request: ${count} fields, at most ${limiter.burst} (the burst); send them in several requests`, {
              extensions: { code: 'RATE_LIMITED', http: { status: 429 } },
            }),
          ],
        });
        return;
      }
      const principal = (args.contextValue as { principal?: Principal }).principal;
      const wait = limiter.take(principal?.subject ?? 'anonymous', count);
      if (wait === 0) return;
      setResultAndStopExecution({
        errors: [
          createGraphQLError(`too many mutations: at most ${limiter.perSecond} per second (burst ${limiter.burst}); retry after ${wait} s`, {
            extensions: { code: 'RATE_LIMITED', retryAfterSeconds: wait, http: { status: 429, headers: { 'Retry-After': String(wait) } } },
          }),
        ],
      });
    },
  };
}
