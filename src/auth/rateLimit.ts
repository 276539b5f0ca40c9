import { getOperationAST } from 'graphql';
import { createGraphQLError, type Plugin } from 'graphql-yoga';
import { rootFields } from '../edge/oneSubmission.js';
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
 * Refuse a mutation over the caller's rate with RATE_LIMITED, HTTP 429 and Retry-After; nothing
 * runs. Each of its root fields that runs is one mutation: 50 aliased cancelExecution fields in one
 * request cost 50, as 50 requests would. One asking for more than the burst can never run.
 */
export function useMutationRateLimit(limiter: RateLimiter): Plugin<{ principal?: Principal }> {
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const operation = getOperationAST(args.document, args.operationName);
      if (operation?.operation !== 'mutation') return;
      // the fields that will run (aliases, fragments, @skip/@include applied); __typename is no mutation
      // variables that do not coerce: execution refuses the operation, which runs nothing
      const count = (rootFields(args.schema, args.document, operation, args.variableValues as Record<string, unknown> | undefined) ?? []).filter((name) => name !== '__typename').length;
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
