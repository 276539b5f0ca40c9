/**
 * Prometheus metrics at `/metrics` (prom-client, a registry of our own). Everything is read
 * through the Engine interface and the completion hub, so both engines report the same names.
 *
 * Completions are counted from the change feed the hub reads: while /metrics has been
 * scraped within `interestMs`, the hub reads every change (as it does for any subscriber);
 * when nobody scrapes it goes back to skipping reads nobody wants. Each instance reads
 * every completion of the database, whoever ran it, so two instances count the same
 * completions twice: aggregate these counters with max(), not sum().
 */
import { performance } from 'node:perf_hooks';
import { getOperationAST, type DocumentNode } from 'graphql';
import type { Plugin } from 'graphql-yoga';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { CompletionHub, HubObserver } from './completionHub.js';
import { isTerminal, toError, type Change, type Engine, type QueueInfo } from './engine.js';
import type { Logger } from './logger.js';

export const METRICS_PATH = '/metrics';
const PREFIX = 'asyncproc_';

export interface MetricsOptions {
  engine: Engine;
  hub: CompletionHub;
  logger: Logger;
  /** One listQueues() serves the queue gauges this long, so a storm of scrapes costs one query. @default 5000 */
  queueCacheMs?: number;
  /** The hub reads every change for the counters while /metrics was scraped within this. @default 300000 */
  interestMs?: number;
  /** Distinct operation names kept as labels; later ones are counted as `other`. @default 100 */
  maxOperationNames?: number;
}

const SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600];

let processRegistry: Registry | undefined;
/** CPU, memory, event loop, GC: collected once per process (each collection keeps an observer for good). */
function processMetrics(): Registry {
  if (!processRegistry) {
    processRegistry = new Registry();
    collectDefaultMetrics({ register: processRegistry, prefix: PREFIX });
  }
  return processRegistry;
}

export class ServiceMetrics implements HubObserver {
  readonly registry: Registry;
  private scrapedAt = -Infinity;
  private queues: { at: number; list: Promise<QueueInfo[]> } | null = null;
  private queueFailures = 0;
  private webSockets: () => number = () => 0;
  private readonly operationNames = new Set<string>();

  private readonly finished: Counter<'procedure' | 'status'>;
  private readonly waited: Histogram<'queue'>;
  private readonly ran: Histogram<'procedure'>;
  private readonly delivered: Counter;
  private readonly reconnects: Counter;
  private readonly operations: Histogram<'type' | 'name'>;

  constructor(private readonly options: MetricsOptions) {
    const own = new Registry();
    const registers = [own];
    const { hub } = options;
    const metrics = this;
    new Gauge({
      name: `${PREFIX}queue_executions`,
      help: 'Executions of each queue by status (waiting, pending, running), read from the database at scrape time',
      labelNames: ['queue', 'status'],
      registers,
      async collect() {
        this.reset();
        for (const queue of await metrics.listQueues()) {
          for (const status of ['waiting', 'pending', 'running'] as const) this.set({ queue: queue.name, status }, queue[status]);
        }
      },
    });
    new Gauge({
      name: `${PREFIX}queue_concurrency`,
      help: 'Concurrency limit of each queue',
      labelNames: ['queue'],
      registers,
      async collect() {
        this.reset();
        for (const queue of await metrics.listQueues()) this.set({ queue: queue.name }, queue.concurrency);
      },
    });
    new Gauge({
      name: `${PREFIX}queue_paused`,
      help: 'Whether each queue is paused (1: it takes calls but starts none)',
      labelNames: ['queue'],
      registers,
      async collect() {
        this.reset();
        for (const queue of await metrics.listQueues()) this.set({ queue: queue.name }, queue.paused ? 1 : 0);
      },
    });
    this.finished = new Counter({
      name: `${PREFIX}executions_finished_total`,
      help: 'Executions seen ending, by status and procedure (per instance: every instance sees every completion; aggregate with max)',
      labelNames: ['procedure', 'status'],
      registers,
    });
    this.waited = new Histogram({
      name: `${PREFIX}execution_wait_seconds`,
      help: 'From submission (or runAt, when later) to start, of executions seen ending',
      labelNames: ['queue'],
      buckets: SECONDS,
      registers,
    });
    this.ran = new Histogram({
      name: `${PREFIX}execution_run_seconds`,
      help: 'From start to finish, of executions seen ending',
      labelNames: ['procedure'],
      buckets: SECONDS,
      registers,
    });
    this.reconnects = new Counter({ name: `${PREFIX}listener_reconnects_total`, help: 'Times the listener lost its connection (it reconnects by itself)', registers });
    const lag = (name: string, help: string, at: () => number | null) =>
      new Gauge({
        name: `${PREFIX}${name}`,
        help: `${help} (+Inf: never)`,
        registers,
        collect() {
          const then = at();
          this.set(then === null ? Infinity : (Date.now() - then) / 1000);
        },
      });
    lag('listener_lag_seconds', 'Seconds since the listener last heard from the database', () => hub.heardAt);
    lag('feed_lag_seconds', 'Seconds since the completion hub last read the change feed successfully', () => hub.feedReadAt);
    new Gauge({
      name: `${PREFIX}subscriptions`,
      help: 'Open subscriptions (executionCompleted, executionEvents, batchCompleted), WebSocket and SSE',
      registers,
      collect() {
        this.set(hub.size);
      },
    });
    new Gauge({
      name: `${PREFIX}websocket_connections`,
      help: 'Open graphql-ws connections',
      registers,
      collect() {
        this.set(metrics.webSockets());
      },
    });
    this.delivered = new Counter({ name: `${PREFIX}events_delivered_total`, help: 'Values handed to subscriptions (events and completions)', registers });
    this.operations = new Histogram({
      name: `${PREFIX}graphql_operation_duration_seconds`,
      help: 'GraphQL operations: execution (query, mutation) or set-up (subscription) time, by type and name (`other` past the cap of names)',
      labelNames: ['type', 'name'],
      buckets: SECONDS.slice(0, 12),
      registers,
    });
    this.registry = Registry.merge([processMetrics(), own]);
    hub.observe(this);
  }

  /** Where graphql-ws connections are counted (the server's WebSocketServer). */
  countWebSockets(count: () => number): void {
    this.webSockets = count;
  }

  /** The exposition text; records the scrape (the hub then reads every change for a while). */
  scrape(): Promise<string> {
    this.scrapedAt = Date.now();
    return this.registry.metrics();
  }

  wantsChanges(): boolean {
    return Date.now() - this.scrapedAt < (this.options.interestMs ?? 300_000);
  }

  onChanges(changes: readonly Change[]): void {
    for (const { execution } of changes) {
      if (!isTerminal(execution.status)) continue;
      this.finished.inc({ procedure: execution.procedure, status: execution.status });
      const { startedAt, finishedAt } = execution;
      if (!startedAt) continue; // cancelled before it started
      const ready = Math.max(execution.submittedAt.getTime(), execution.runAt?.getTime() ?? 0);
      this.waited.observe({ queue: execution.queue }, Math.max(0, startedAt.getTime() - ready) / 1000);
      if (finishedAt) this.ran.observe({ procedure: execution.procedure }, Math.max(0, finishedAt.getTime() - startedAt.getTime()) / 1000);
    }
  }

  onDelivered(count: number): void {
    this.delivered.inc(count);
  }

  onListenerError(): void {
    this.reconnects.inc();
  }

  /** The queues, read at most once per `queueCacheMs`; a failed read leaves the gauges empty (and is logged once). */
  private async listQueues(): Promise<QueueInfo[]> {
    const now = Date.now();
    if (!this.queues || now - this.queues.at >= (this.options.queueCacheMs ?? 5000)) {
      this.queues = { at: now, list: this.options.engine.listQueues() };
    }
    try {
      const list = await this.queues.list;
      this.queueFailures = 0;
      return list;
    } catch (error) {
      if (this.queueFailures++ === 0) this.options.logger.warn({ err: toError(error) }, 'metrics: could not read the queues');
      return [];
    }
  }

  /** Operation type and name as labels; names past the cap become `other`, so clients cannot grow the label set. */
  private operationLabels(document: DocumentNode, operationName: string | null | undefined): { type: string; name: string } {
    const operation = getOperationAST(document, operationName);
    let name = operation?.name?.value.slice(0, 64) ?? 'anonymous';
    if (!this.operationNames.has(name)) {
      if (this.operationNames.size < (this.options.maxOperationNames ?? 100)) this.operationNames.add(name);
      else name = 'other';
    }
    return { type: operation?.operation ?? 'unknown', name };
  }

  /** Serves /metrics (GET) and times every operation. */
  plugin(): Plugin {
    const since = () => performance.now();
    return {
      onRequest: ({ request, url, endResponse, fetchAPI }) => {
        if (url.pathname !== METRICS_PATH) return;
        if (request.method !== 'GET') {
          endResponse(new fetchAPI.Response('method not allowed', { status: 405, headers: { allow: 'GET' } }));
          return;
        }
        return this.scrape().then(
          (text) => endResponse(new fetchAPI.Response(text, { headers: { 'content-type': this.registry.contentType, 'cache-control': 'no-store' } })),
          (error) => {
            this.options.logger.error({ err: toError(error) }, 'metrics: scrape failed');
            endResponse(new fetchAPI.Response('metrics could not be collected', { status: 500 }));
          },
        );
      },
      onExecute: ({ args }) => {
        const started = since();
        const labels = this.operationLabels(args.document, args.operationName);
        return { onExecuteDone: () => void this.operations.observe(labels, (since() - started) / 1000) };
      },
      onSubscribe: ({ args }) => {
        const started = since();
        const labels = this.operationLabels(args.document, args.operationName);
        return { onSubscribeResult: () => void this.operations.observe(labels, (since() - started) / 1000) };
      },
    };
  }
}
