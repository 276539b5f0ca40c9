/**
 * Readiness (`/ready`): whether this instance can do its work now, for Docker, Kubernetes
 * and load balancers. `/health` (yoga's) stays the liveness answer: 200 while the process
 * runs. `/ready` answers 503 while the database cannot be reached, while its schema is
 * older than the migrations this service carries (say, after a restore), or while the
 * listener has not heard from the database lately; the body names the failed checks.
 */
import type { Plugin } from 'graphql-yoga';
import type { CompletionHub } from './completionHub.js';
import { toError, type Engine, type SchemaVersion } from './engine.js';
import type { Logger } from './logger.js';

export const READY_PATH = '/ready';

export interface ReadinessOptions {
  engine: Engine;
  hub: CompletionHub;
  logger: Logger;
  /** The database's round trip must answer within this. @default 2000 */
  timeoutMs?: number;
  /** The listener must have heard from the database within this (the PostgreSQL listener probes every 10 s). @default 30000 */
  listenerStaleMs?: number;
  /** A result is reused this long, so a storm of probes costs one round trip. @default 1000 */
  cacheMs?: number;
}

export type ReadinessCheck = 'database' | 'migrations' | 'listener';

export interface ReadinessReport {
  ready: boolean;
  failed: ReadinessCheck[];
  checks: {
    database: { ok: boolean; ms: number; reason?: 'timeout' | 'error' };
    /** ok null: not known (the database was not reached), not counted as failed: `database` is. */
    migrations: { ok: boolean | null; applied: number | null; expected: number | null };
    listener: { ok: boolean; heardSecondsAgo: number | null };
  };
}

const sleep = (ms: number) => new Promise<'timeout'>((resolve) => setTimeout(() => resolve('timeout'), ms).unref());

export class Readiness {
  private cached: { at: number; report: Promise<ReadinessReport> } | null = null;
  /** At most one round trip in flight: a hung database must not collect a pile of them. */
  private roundTrip: Promise<SchemaVersion> | null = null;
  private lastFailed: string | null = null;

  constructor(private readonly options: ReadinessOptions) {}

  /** The checks, at most once per `cacheMs`. */
  check(): Promise<ReadinessReport> {
    const now = Date.now();
    if (!this.cached || now - this.cached.at >= (this.options.cacheMs ?? 1000)) this.cached = { at: now, report: this.run() };
    return this.cached.report;
  }

  private async run(): Promise<ReadinessReport> {
    const started = Date.now();
    const version = await this.reach();
    const reached = typeof version === 'object' && !(version instanceof Error);
    const database = { ok: reached, ms: Date.now() - started, ...(reached ? {} : { reason: version === 'timeout' ? ('timeout' as const) : ('error' as const) }) };
    const applied = reached ? version.applied : null;
    const expected = reached ? version.expected : null;
    const migrations = { ok: reached ? applied !== null && applied >= version.expected : null, applied, expected };
    const { heardAt } = this.options.hub;
    const heardSecondsAgo = heardAt === null ? null : (Date.now() - heardAt) / 1000;
    const listener = { ok: heardSecondsAgo !== null && heardSecondsAgo * 1000 <= (this.options.listenerStaleMs ?? 30_000), heardSecondsAgo };
    const checks = { database, migrations, listener };
    const failed = (Object.keys(checks) as ReadinessCheck[]).filter((name) => checks[name].ok === false);
    this.logChange(failed, version instanceof Error ? version : undefined, checks);
    return { ready: failed.length === 0, failed, checks };
  }

  /** The database's round trip: its answer, or why there is none. */
  private async reach(): Promise<SchemaVersion | 'timeout' | Error> {
    this.roundTrip ??= this.options.engine.schemaVersion().finally(() => (this.roundTrip = null));
    try {
      return await Promise.race([this.roundTrip, sleep(this.options.timeoutMs ?? 2000)]);
    } catch (error) {
      return toError(error);
    }
  }

  /** A line when the answer changes, not on every probe. */
  private logChange(failed: ReadinessCheck[], err: Error | undefined, checks: ReadinessReport['checks']): void {
    const key = failed.join(',');
    if (key === (this.lastFailed ?? '')) return;
    const first = this.lastFailed === null;
    this.lastFailed = key;
    if (failed.length) this.options.logger.warn({ failed, checks, err }, `not ready: ${failed.join(', ')}`);
    else if (!first) this.options.logger.info({ checks }, 'ready again');
  }
}

/** Serves `/ready`: 200 or 503 with the report as JSON. */
export function useReadiness(readiness: Readiness): Plugin {
  return {
    onRequest({ request, url, endResponse, fetchAPI }) {
      if (url.pathname !== READY_PATH) return;
      if (request.method !== 'GET' && request.method !== 'HEAD') {
        endResponse(new fetchAPI.Response('method not allowed', { status: 405, headers: { allow: 'GET, HEAD' } }));
        return;
      }
      return readiness.check().then((report) => {
        const body = JSON.stringify({ status: report.ready ? 'ready' : 'unready', failed: report.failed, checks: report.checks });
        const headers = { 'content-type': 'application/json; charset=utf-8', 'cache-control': 'no-store' };
        endResponse(new fetchAPI.Response(request.method === 'HEAD' ? null : body, { status: report.ready ? 200 : 503, headers }));
      });
    },
  };
}
