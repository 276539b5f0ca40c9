/**
 * `npm run bench`: asyncproc on an embedded PostgreSQL, each figure beside a named peer measured
 * on the same server in the same run. Prints numbers; asserts nothing. Each measurement runs
 * BENCH_ROUNDS times (3); a figure is the median [min–max], a ratio the median of same-round ratios.
 *
 *   drain          DRAIN queued no-op calls at concurrency 10 — graphile-worker unbatched; and asyncproc with grouped
 *                  commits (BENCH_GROUP_SIZE calls a commit, BENCH_GROUP_CONCURRENCY slots) — graphile-worker's batch-job
 *                  mode (BENCH_GRAPHILE_BATCH items a job)
 *   concurrency    drain at concurrency 1, 10, 50, 100
 *   scale-out      drain by 1, 2 and 4 `worker` processes (the CLI, children of the bench), the database's CPU per call
 *   growth         drain and submit → start latency with BENCH_HISTORY finished executions in history,
 *                  and with BENCH_QUEUES queues holding pending work, against an empty database; and
 *                  mutation response → executionCompleted with the history (each event is a read of the feed)
 *   invoke         GraphQL `invoke` mutations/s from 10 HTTP clients in a separate process, the service without its worker
 *                  pool (enqueue only) and as deployed — pg-boss `send` from 10 callers
 *   latency        mutation response → executionCompleted (graphql-ws), LATENCY sequential calls —
 *                  graphile-worker addJob → handler start
 *   fan-out        N executionEvents subscribers while no-op calls run (bench/fanout.ts): BENCH_FANOUT=1,10,50,200
 *                  (sizes, '' to skip), BENCH_FANOUT_CALLS=3000. No peer: graphile-worker has no subscriptions.
 *                  Then BENCH_FANOUT_WATCHERS=1000 executionCompleted subscribers (a call each) alone and beside
 *                  50 executionEvents subscribers, and BENCH_MANY_WATCHERS=10000 alone (delay, memory a subscriber).
 * and at the end one table of the performance issue's targets.
 *
 * BENCH_QUICK=1: every part, short (one round, fewer calls). BENCH_ONLY=drain,edge: only the parts named
 * (drain, concurrency, scale, growth, edge, fanout).
 * BENCH_SOAK=<seconds> runs bench/soak.ts instead: a steady load, memory and database size every minute.
 */
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { cpus, tmpdir } from 'node:os';
import path from 'node:path';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { freePort } from '../test/support/database.js';
import {
  claimLatencies, CONCURRENCY, describeLatencies, drainAsyncproc, drainGraphileBatched, drainGraphileWorker, GRAPHILE_BATCH, graphileLatencies, GROUP_CONCURRENCY, GROUP_SIZE,
} from './drains.js';
import { CALLERS, completionLatencies, invokeRate, pgBossSendRate, startService } from './edge.js';
import { describeFanout, runFanout, type FanoutRun } from './fanout.js';
import { describeDrains, DRAIN, freshDatabase, mid, percentile, query, QUICK, ROUNDS, spread, watchCluster, type Drain } from './measure.js';
import { drainWorkers, seedHistory, seedQueues } from './scale.js';
import { printTargets, ratioCell, type Target } from './targets.js';

const LATENCY = Number(process.env.BENCH_LATENCY ?? (QUICK ? 100 : 500));
const FANOUT = (process.env.BENCH_FANOUT ?? (QUICK ? '50' : '1,10,50,200')).split(',').filter(Boolean).map(Number);
const FANOUT_CALLS = Number(process.env.BENCH_FANOUT_CALLS ?? (QUICK ? 500 : 3000));
/** executionCompleted subscribers (one call each) beside 0 and 50 executionEvents subscribers, and the many-subscriber case. */
const WATCHERS = Number(process.env.BENCH_FANOUT_WATCHERS ?? (QUICK ? 200 : 1000));
const MANY_WATCHERS = Number(process.env.BENCH_MANY_WATCHERS ?? (QUICK ? 1000 : 10_000));
const CURVE = [1, 10, 50, 100];
const PROCESSES = [1, 2, 4];
const HISTORY = Number(process.env.BENCH_HISTORY ?? (QUICK ? 100_000 : 1_000_000));
const QUEUES = Number(process.env.BENCH_QUEUES ?? 1000);
const PER_QUEUE = 10;
const CLAIMS = QUICK ? 50 : 200;
/** BENCH_ONLY=drain,edge,…: only these parts (drain, concurrency, scale, growth, edge, fanout). */
const ONLY = process.env.BENCH_ONLY;

const ratios = (ours: number[], theirs: number[]) => ours.map((o, i) => o / theirs[i]);
const rates = (drains: Drain[]) => drains.map((d) => d.rate);
const section = (title: string) => console.log(`\n${title}`);

/**
 * `fn` for each setting, starting one further along in each round (so no setting always runs
 * first or last on a machine whose load drifts); results in the settings' order.
 */
async function inTurn<T>(settings: number[], round: number, fn: (setting: number) => Promise<T>): Promise<T[]> {
  const results = new Array<T>(settings.length);
  for (let k = 0; k < settings.length; k++) {
    const i = (k + round - 1) % settings.length;
    results[i] = await fn(settings[i]);
  }
  return results;
}

/** `n` rounds of `fn`, each printed as it ends. */
async function rounds<T>(label: string, fn: (round: number) => Promise<T>, describe: (t: T) => string): Promise<T[]> {
  const results: T[] = [];
  for (let round = 1; round <= ROUNDS; round++) {
    results.push(await fn(round));
    console.log(`  ${label} round ${round}: ${describe(results.at(-1)!)}`);
  }
  return results;
}

type Part = (db: (name: string) => Promise<string>, targets: Target[]) => Promise<void>;

/** The parts of a run, in order; BENCH_ONLY names some of them (comma-separated). */
const PARTS: Record<string, Part> = {
  drain: async (db, targets) => {
    // rounds alternate ours and theirs, so a noisy moment of the machine hits both
    section(
      `drain: ${DRAIN} no-op calls, concurrency ${CONCURRENCY}; asyncproc one commit a call, and grouped (${GROUP_SIZE} calls at most a commit, concurrency ${GROUP_CONCURRENCY}); graphile-worker unbatched, and batched (${GRAPHILE_BATCH} items a job, rate and CPU per item)`,
    );
    const [ourUrl, groupedUrl, peerUrl, batchedUrl] = [
      await db('bench_asyncproc'), await db('bench_asyncproc_grouped'), await db('bench_graphile'), await db('bench_graphile_batched'),
    ];
    const drains = await rounds(
      'drain',
      async () => ({
        ours: await drainAsyncproc(ourUrl),
        peer: await drainGraphileWorker(peerUrl),
        grouped: await drainAsyncproc(groupedUrl, GROUP_CONCURRENCY, DRAIN, GROUP_SIZE),
        batched: await drainGraphileBatched(batchedUrl),
      }),
      (r) =>
        `asyncproc ${describeDrains([r.ours])} | graphile-worker ${describeDrains([r.peer])} (${(r.ours.rate / r.peer.rate).toFixed(2)}×) | ` +
        `asyncproc grouped ${describeDrains([r.grouped])} | batched ${describeDrains([r.batched])} (${(r.grouped.rate / r.batched.rate).toFixed(2)}×)`,
    );
    const ours = drains.map((d) => d.ours);
    const grouped = drains.map((d) => d.grouped);
    console.log(`  asyncproc:                          ${describeDrains(ours)}`);
    console.log(`  graphile-worker:                    ${describeDrains(drains.map((d) => d.peer))}`);
    console.log(`  asyncproc grouped (size ${String(GROUP_SIZE).padEnd(3)}):      ${describeDrains(grouped)}`);
    console.log(`  graphile-worker batched:            ${describeDrains(drains.map((d) => d.batched))}`);
    targets.push(
      { target: `drain, concurrency ${CONCURRENCY}: ≥ 2.0× graphile-worker unbatched`, ours: `${spread(rates(ours))}/s`, peer: `${spread(rates(drains.map((d) => d.peer)))}/s`, ...ratioCell(ratios(rates(ours), rates(drains.map((d) => d.peer))), 2.0) },
      {
        target: `grouped commits: ≥ 1.0× graphile-worker batched (asyncproc grouped, size ${GROUP_SIZE}, concurrency ${GROUP_CONCURRENCY})`,
        ours: `${spread(rates(grouped))}/s`,
        peer: `${spread(rates(drains.map((d) => d.batched)))}/s`,
        ...ratioCell(ratios(rates(grouped), rates(drains.map((d) => d.batched))), 1.0),
      },
    );
  },
  concurrency: async (db, targets) => {
    section(`drain versus concurrency: ${DRAIN} no-op calls, one process, a fresh database each`);
    const curve = await rounds(
      'concurrency',
      (round) => inTurn(CURVE, round, async (c) => drainAsyncproc(await db(`bench_curve_${c}`), c)),
      (r) => r.map((d, i) => `${CURVE[i]}: ${d.rate.toFixed(0)}/s`).join(', '),
    );
    for (const [i, c] of CURVE.entries()) console.log(`  concurrency ${String(c).padStart(3)}: ${describeDrains(curve.map((r) => r[i]))}`);
    targets.push({ target: 'drain versus concurrency 1, 10, 50, 100 (the curve)', ours: CURVE.map((c, i) => `${c}: ${mid(rates(curve.map((r) => r[i]))).toFixed(0)}/s`).join(', '), peer: '', ratio: '', met: null });
  },
  scale: async (db, targets) => {
    section(`scale-out: ${DRAIN} no-op calls by 1, 2 and 4 \`worker\` processes sharing the queue's limit of ${CONCURRENCY}, a fresh database each (node CPU: all worker processes)`);
    const scale = await rounds(
      'scale-out',
      (round) => inTurn(PROCESSES, round, async (p) => drainWorkers(await db(`bench_scale_${p}`), p)),
      (r) => r.map((d, i) => `${PROCESSES[i]}: ${d.rate.toFixed(0)}/s`).join(', '),
    );
    for (const [i, p] of PROCESSES.entries()) console.log(`  ${p} process${p > 1 ? 'es' : ''}: ${describeDrains(scale.map((r) => r[i]))}`);
    targets.push({
      target: 'scale-out: drain by 1, 2, 4 worker processes (postgres CPU per call)',
      ours: PROCESSES.map((p, i) => `${p}: ${mid(rates(scale.map((r) => r[i]))).toFixed(0)}/s (${mid(scale.map((r) => r[i].postgresUs)).toFixed(0)} µs)`).join(', '),
      peer: '', ratio: '', met: null,
    });
  },
  growth: async (db, targets) => {
    section(`growth: drain (${DRAIN} calls) and submit → start latency (${CLAIMS} single calls) with ${HISTORY.toLocaleString('en')} finished executions in history, and with ${QUEUES} queues holding ${PER_QUEUE} pending calls each; mutation response → executionCompleted (${LATENCY} calls) with the history`);
    const growthDbs = { empty: await db('bench_empty'), history: await db('bench_history'), queues: await db('bench_queues') };
    let t0 = performance.now();
    await seedHistory(growthDbs.history, HISTORY);
    console.log(`  ${HISTORY.toLocaleString('en')} finished executions inserted in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    t0 = performance.now();
    await seedQueues(growthDbs.queues, QUEUES, PER_QUEUE);
    console.log(`  ${QUEUES} queues and ${(QUEUES * PER_QUEUE).toLocaleString('en')} pending calls in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    const kinds = ['empty', 'history', 'queues'] as const;
    const growth = await rounds(
      'growth',
      async () => {
        const round = {} as Record<(typeof kinds)[number], { drain: Drain; claims: number[]; completions?: number[] }>;
        for (const kind of kinds) round[kind] = { drain: await drainAsyncproc(growthDbs[kind]), claims: await claimLatencies(growthDbs[kind], CLAIMS) };
        // every subscriber's event is a read of the change feed: it must not grow with the history (the
        // queues' database is left out: its pending calls are for no worker, and a service would run them)
        for (const kind of ['empty', 'history'] as const) {
          const service = await startService(growthDbs[kind]);
          round[kind].completions = await completionLatencies(service.endpoint, LATENCY).finally(() => service.stop());
        }
        return round;
      },
      (r) => kinds.map((k) => `${k} ${r[k].drain.rate.toFixed(0)}/s, start p50 ${percentile(r[k].claims, 50).toFixed(2)} ms${r[k].completions ? `, completion p50 ${percentile(r[k].completions!, 50).toFixed(2)} ms` : ''}`).join(' | '),
    );
    for (const kind of kinds) {
      const p50s = growth.map((r) => percentile(r[kind].claims, 50));
      const p99s = growth.map((r) => percentile(r[kind].claims, 99));
      console.log(`  ${kind.padEnd(7)}: drain ${describeDrains(growth.map((r) => r[kind].drain))}; submit → start p50 ${spread(p50s, 2)} ms, p99 ${spread(p99s, 2)} ms`);
    }
    const completionP50s = (kind: 'empty' | 'history') => growth.map((r) => percentile(r[kind].completions!, 50));
    targets.push({
      target: `mutation → executionCompleted p50 with ${HISTORY.toLocaleString('en')} finished in history: within 10%`,
      ours: `${spread(completionP50s('history'), 2)} ms`,
      peer: `empty ${spread(completionP50s('empty'), 2)} ms`,
      ...ratioCell(ratios(completionP50s('history'), completionP50s('empty')), 1.1, 'at most'),
    });
    for (const kind of ['history', 'queues'] as const) {
      const what = kind === 'history' ? `${HISTORY.toLocaleString('en')} finished in history` : `${QUEUES} queues holding pending work`;
      const drainRatios = growth.map((r) => r[kind].drain.rate / r.empty.drain.rate);
      const claimRatios = growth.map((r) => percentile(r[kind].claims, 50) / percentile(r.empty.claims, 50));
      targets.push(
        { target: `drain with ${what}: within 10% of an empty database`, ours: `${spread(rates(growth.map((r) => r[kind].drain)))}/s`, peer: `empty ${spread(rates(growth.map((r) => r.empty.drain)))}/s`, ...ratioCell(drainRatios, 0.9) },
        { target: `submit → start p50 with ${what}: within 10%`, ours: `${spread(growth.map((r) => percentile(r[kind].claims, 50)), 2)} ms`, peer: `empty ${spread(growth.map((r) => percentile(r.empty.claims, 50)), 2)} ms`, ...ratioCell(claimRatios, 1.1, 'at most') },
      );
    }
  },
  edge: async (db, targets) => {
    section(
      `GraphQL edge: invoke from ${CALLERS} HTTP clients in a separate process — the service without its worker pool (enqueue only, like pg-boss send), ` +
        `and as deployed (the pool runs the calls meanwhile); pg-boss send from ${CALLERS} callers; then ${LATENCY} sequential calls`,
    );
    const [edgeUrl, enqueueUrl, bossUrl, graphileLatencyUrl] = [await db('bench_edge'), await db('bench_enqueue'), await db('bench_pgboss'), await db('bench_graphile_latency')];
    const edge = await rounds(
      'edge',
      async () => {
        const enqueueOnly = await startService(enqueueUrl, false);
        const enqueue = await invokeRate(enqueueOnly.endpoint).finally(() => enqueueOnly.stop());
        const send = await pgBossSendRate(bossUrl);
        const service = await startService(edgeUrl);
        try {
          const deployed = await invokeRate(service.endpoint);
          const latencies = await completionLatencies(service.endpoint, LATENCY);
          return { enqueue, deployed, send, latencies, peerLatencies: await graphileLatencies(graphileLatencyUrl, LATENCY) };
        } finally {
          await service.stop();
        }
      },
      (r) => `invoke ${r.enqueue.toFixed(0)}/s (as deployed ${r.deployed.toFixed(0)}/s), pg-boss send ${r.send.toFixed(0)}/s (${(r.enqueue / r.send).toFixed(2)}×); ` +
        `→ executionCompleted ${describeLatencies(r.latencies)}; graphile-worker addJob → handler ${describeLatencies(r.peerLatencies)}`,
    );
    const invokes = edge.map((r) => r.enqueue);
    const deployed = edge.map((r) => r.deployed);
    const sends = edge.map((r) => r.send);
    const p = (which: 'latencies' | 'peerLatencies', q: number) => edge.map((r) => percentile(r[which], q));
    console.log(`  invoke: ${spread(invokes)} mutations/s without the pool, ${spread(deployed)} as deployed; pg-boss send: ${spread(sends)}/s`);
    console.log(`  mutation response → executionCompleted: p50 ${spread(p('latencies', 50), 1)} ms, p95 ${spread(p('latencies', 95), 1)} ms, p99 ${spread(p('latencies', 99), 1)} ms`);
    console.log(`  graphile-worker addJob → handler start: p50 ${spread(p('peerLatencies', 50), 1)} ms, p95 ${spread(p('peerLatencies', 95), 1)} ms, p99 ${spread(p('peerLatencies', 99), 1)} ms`);
    targets.push(
      { target: `invoke, ${CALLERS} clients: ≥ 1,200 mutations/s (without the pool; as deployed)`, ours: `${spread(invokes)}/s; ${spread(deployed)}/s`, peer: '', ratio: `${(mid(invokes) / 1200).toFixed(2)}× of 1,200`, met: mid(invokes) >= 1200 },
      { target: `invoke, ${CALLERS} clients: ≥ 2.0× pg-boss send (${CALLERS} callers)`, ours: `${spread(invokes)}/s`, peer: `${spread(sends)}/s`, ...ratioCell(ratios(invokes, sends), 2.0) },
      { target: 'mutation → executionCompleted p50 ≤ 2 ms (peer: addJob → handler start)', ours: `${spread(p('latencies', 50), 1)} ms`, peer: `${spread(p('peerLatencies', 50), 1)} ms`, ratio: `${mid(ratios(p('latencies', 50), p('peerLatencies', 50))).toFixed(2)}×`, met: mid(p('latencies', 50)) <= 2 },
      { target: 'mutation → executionCompleted p99 ≤ 6 ms', ours: `${spread(p('latencies', 99), 1)} ms`, peer: `${spread(p('peerLatencies', 99), 1)} ms`, ratio: `${mid(ratios(p('latencies', 99), p('peerLatencies', 99))).toFixed(2)}×`, met: mid(p('latencies', 99)) <= 6 },
    );
  },
  fanout: async (db, targets) => {
    const fanouts: FanoutRun[] = [];
    if (FANOUT.length) {
      section(`executionEvents fan-out, ${FANOUT_CALLS} no-op calls (no peer: graphile-worker has no subscriptions)`);
      for (const [i, n] of FANOUT.entries()) {
        fanouts.push(await runFanout(await db(`bench_fanout_${i}`), n, FANOUT_CALLS));
        console.log(`  ${describeFanout(fanouts.at(-1)!)}`);
      }
    }
    const fifty = fanouts.find((f) => f.subscribers === 50);
    let watchers: { alone: FanoutRun; busy: FanoutRun } | null = null;
    let many: FanoutRun | null = null;
    if (WATCHERS > 0) {
      section(`${WATCHERS} executionCompleted subscribers (a socket and a call each; all calls due at one instant), alone and beside 50 executionEvents subscribers`);
      const alone = await runFanout(await db('bench_watchers_alone'), 0, FANOUT_CALLS, WATCHERS);
      console.log(`  ${describeFanout(alone)}`);
      const busy = await runFanout(await db('bench_watchers_busy'), 50, FANOUT_CALLS, WATCHERS);
      console.log(`  ${describeFanout(busy)}`);
      watchers = { alone, busy };
    }
    if (MANY_WATCHERS > 0) {
      section(`${MANY_WATCHERS} executionCompleted subscribers, a socket and a call each`);
      many = await runFanout(await db('bench_watchers_many'), 0, MANY_WATCHERS, MANY_WATCHERS);
      console.log(`  ${describeFanout(many)}`);
    }
    const w = (run: FanoutRun) => run.watchers!;
    targets.push(
      many
        ? {
            target: `${many.watchers!.count} graphql-ws subscribers, each on its own call: all within 1 s of it, ≤ 30 KB each`,
            ours: `max ${w(many).maxMs.toFixed(0)} ms (p99 ${w(many).p99Ms.toFixed(0)}), ${(w(many).bytesPerWatcher / 1024).toFixed(1)} KB each, missing ${w(many).missing}`,
            peer: 'no subscriptions',
            ratio: '',
            met: w(many).missing === 0 && w(many).maxMs <= 1000 && w(many).bytesPerWatcher <= 30 * 1024,
          }
        : { target: '10,000 graphql-ws subscribers on their own tokens: all within 1 s, ≤ 30 KB each', ours: 'not measured (BENCH_MANY_WATCHERS=0)', peer: '', ratio: '', met: null },
      watchers
        ? {
            target: `${WATCHERS} executionCompleted subscribers not slowed by 50 executionEvents subscribers (p99 after the call's end; peer: the same alone)`,
            ours: `p99 ${w(watchers.busy).p99Ms.toFixed(0)} ms, max ${w(watchers.busy).maxMs.toFixed(0)} ms`,
            peer: `p99 ${w(watchers.alone).p99Ms.toFixed(0)} ms, max ${w(watchers.alone).maxMs.toFixed(0)} ms`,
            ratio: `${(w(watchers.busy).p99Ms / w(watchers.alone).p99Ms).toFixed(2)}×`,
            met: w(watchers.busy).p99Ms <= 1.2 * w(watchers.alone).p99Ms,
          }
        : { target: 'executionCompleted subscribers not slowed by executionEvents subscribers', ours: 'not measured (BENCH_FANOUT_WATCHERS=0)', peer: '', ratio: '', met: null },
      fifty
        ? { target: `50 executionEvents subscribers each see all ${fifty.calls} completions exactly once`, ours: `missing ${fifty.missing}, repeated ${fifty.repeats}; last ${(fifty.delayMs / 1000).toFixed(2)} s after the last completion`, peer: 'no subscriptions', ratio: '', met: fifty.missing === 0 && fifty.repeats === 0 && !fifty.errors.length }
        : { target: '50 executionEvents subscribers each see every completion once', ours: 'not measured (BENCH_FANOUT without 50)', peer: '', ratio: '', met: null },
    );
  },
};

async function main() {
  if (process.env.BENCH_SOAK) {
    // a long steady load instead of the rates (bench/soak.ts): not part of the usual run
    const { soak } = await import('./soak.js');
    return soak();
  }
  const started = performance.now();
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-bench-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  await watchCluster(server.dataDir);
  const db = (name: string) => freshDatabase(server.url, name);
  const targets: Target[] = [];
  try {
    const version = (await query(server.url, 'show server_version')).rows[0].server_version;
    console.log(
      `asyncproc benchmark — embedded PostgreSQL ${version}, default settings, Node ${process.version}, ${cpus().length} cores; ` +
        `${ROUNDS} round(s): median [min–max]${QUICK ? '; BENCH_QUICK' : ''}`,
    );

    for (const [name, part] of Object.entries(PARTS)) {
      if (!ONLY || ONLY.split(',').includes(name)) await part(db, targets);
    }
    printTargets(targets);
    console.log(`\nbench ran ${((performance.now() - started) / 1000).toFixed(0)} s`);
  } finally {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}

await main();
