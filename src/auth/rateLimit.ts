import { getOperationAST } from 'graphql';
import { createGraphQLError, type Plugin } from 'graphql-yoga';
import type { Principal } from './principal.js';

/**
 * A token bucket per caller: `burst` mutations at once, refilled at `perSecond`.
 * In memory, per process: several instances each allow the rate.
 */
export class RateLimiter {
  private readonly buckets = new Map<string, { tokens: number; at: number }>();

  constructor(
    readonly perSecond: number,
    readonly burst: number,
    private readonly now: () => number = Date.now,
  ) {}

  /** Take one token: 0 when allowed, else the seconds to wait before one is free. */
  take(key: string): number {
    const now = this.now();
    const bucket = this.buckets.get(key) ?? { tokens: this.burst, at: now };
    bucket.tokens = Math.min(this.burst, bucket.tokens + ((now - bucket.at) / 1000) * this.perSecond);
    bucket.at = now;
    if (this.buckets.size >= 10_000 && !this.buckets.has(key)) this.sweep(now);
    this.buckets.set(key, bucket);
    if (bucket.tokens >= 1) {
      bucket.tokens -= 1;
      return 0;
    }
    return Math.max(1, Math.ceil((1 - bucket.tokens) / this.perSecond));
  }

  /** Forget callers whose bucket has filled up again: they are as new. */
  private sweep(now: number): void {
    for (const [key, bucket] of this.buckets) {
      if (bucket.tokens + ((now - bucket.at) / 1000) * this.perSecond >= this.burst) this.buckets.delete(key);
    }
  }
}

/** Refuse a mutation over the caller's rate with RATE_LIMITED, HTTP 429 and Retry-After; nothing runs. */
export function useMutationRateLimit(limiter: RateLimiter): Plugin<{ principal?: Principal }> {
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const operation = getOperationAST(args.document, args.operationName);
      if (operation?.operation !== 'mutation') return;
      const principal = (args.contextValue as { principal?: Principal }).principal;
      const wait = limiter.take(principal?.subject ?? 'anonymous');
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
