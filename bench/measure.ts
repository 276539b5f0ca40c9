/**
 * What every part of `npm run bench` measures with: the database's and this process's CPU,
 * rounds with their median and spread, percentiles, and one-off SQL.
 */
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import pg from 'pg';
import { clusterCpuMs } from './clusterCpu.js';

/** BENCH_QUICK=1: every part, short (under two minutes in all). */
export const QUICK = process.env.BENCH_QUICK === '1';
export const ROUNDS = Number(process.env.BENCH_ROUNDS ?? (QUICK ? 1 : 3));
/** Calls one drain round runs. */
export const DRAIN = Number(process.env.BENCH_DRAIN ?? (QUICK ? 2_000 : 20_000));

let postmasterPid = 0;
export async function watchCluster(dataDir: string): Promise<void> {
  postmasterPid = Number((await readFile(path.join(dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
}

/** CPU time (ms) of this process, or of other processes of ours (worker children) when given. */
export async function nodeCpuMs(pids: number[] = []): Promise<number> {
  if (!pids.length) {
    const { user, system } = process.cpuUsage();
    return (user + system) / 1000;
  }
  let ticks = 0;
  for (const pid of pids) {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    ticks += Number(fields[11]) + Number(fields[12]);
  }
  return ticks * 10; // USER_HZ = 100
}

export interface Drain {
  rate: number;
  nodeUs: number;
  postgresUs: number;
}

export interface CpuMark {
  node: number;
  postgres: number;
  at: number;
}
export async function cpuMark(pids: number[] = []): Promise<CpuMark> {
  return { node: await nodeCpuMs(pids), postgres: await clusterCpuMs(postmasterPid), at: performance.now() };
}
/** Rate and CPU µs per call between two marks; `seconds` overrides the wall time (the database's own clock). */
export function drainBetween(items: number, a: CpuMark, b: CpuMark, seconds = (b.at - a.at) / 1000): Drain {
  return { rate: items / seconds, nodeUs: ((b.node - a.node) * 1000) / items, postgresUs: ((b.postgres - a.postgres) * 1000) / items };
}

/** Rate and CPU microseconds per call of this process and of the database while `fn` drains `items`. */
export async function measureDrain(items: number, fn: () => Promise<void>): Promise<Drain> {
  const a = await cpuMark();
  await fn();
  return drainBetween(items, a, await cpuMark());
}

export const mid = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)];

export function median(drains: Drain[]): Drain {
  return { rate: mid(drains.map((d) => d.rate)), nodeUs: mid(drains.map((d) => d.nodeUs)), postgresUs: mid(drains.map((d) => d.postgresUs)) };
}

/** `median [min–max]` of rounds, `digits` after the point. */
export function spread(values: number[], digits = 0): string {
  if (values.length < 2) return values[0]?.toFixed(digits) ?? '-';
  return `${mid(values).toFixed(digits)} [${Math.min(...values).toFixed(digits)}–${Math.max(...values).toFixed(digits)}]`;
}

export const describeDrain = (d: Drain) => `${d.rate.toFixed(0)}/s, CPU per call: node ${d.nodeUs.toFixed(0)} µs + postgres ${d.postgresUs.toFixed(0)} µs`;
export const describeDrains = (ds: Drain[]) =>
  `${spread(ds.map((d) => d.rate))}/s, CPU per call: node ${spread(ds.map((d) => d.nodeUs))} µs + postgres ${spread(ds.map((d) => d.postgresUs))} µs`;

export function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

export async function withClient<T>(url: string, fn: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end();
  }
}

export const query = (url: string, text: string, values: unknown[] = []) => withClient(url, (c) => c.query(text, values));

/** Until `countSql` counts nothing left (a bench loop; no test waits like this). */
export async function waitDrained(url: string, countSql: string): Promise<void> {
  await withClient(url, async (client) => {
    for (;;) {
      const { rows } = await client.query(countSql);
      if (Number(rows[0].n) === 0) return;
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  });
}

/** A fresh database on the bench's cluster; its URL. */
export async function freshDatabase(serverUrl: string, name: string): Promise<string> {
  await query(serverUrl, `drop database if exists ${name} with (force)`);
  await query(serverUrl, `create database ${name}`);
  return serverUrl.replace(/\/postgres$/, `/${name}`);
}

/** `total` calls of `fn` from `callers` concurrent callers, each calling again as soon as its call returns; calls/s. */
export async function concurrently(callers: number, total: number, fn: () => Promise<unknown>): Promise<number> {
  let started = 0;
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: callers }, async () => {
      while (started < total) {
        started++;
        await fn();
      }
    }),
  );
  return total / ((performance.now() - t0) / 1000);
}
