/**
 * Throughput and failures over the last minutes: ended executions counted in buckets by the time
 * they ended, fed by the live feed and seeded, when the overview opens, from the newest ended ones.
 */
import { credential, gql } from './api';
import { ENDED, type ChangeEvent, type Status } from './live';
import { Store } from './store';

export const BUCKET_SECONDS = 10;
export const WINDOW_MINUTES = 10;

interface Bucket {
  succeeded: number;
  failed: number;
  cancelled: number;
}

const buckets = new Map<number, Bucket>();
/** Tokens already counted: a resumed feed may repeat an event, a seed may overlap the feed. */
const counted = new Set<string>();
/** Bumped on every change, for views to render again. */
export const outcomesVersion = new Store(0);

function bucketOf(at: number): number {
  return Math.floor(at / 1000 / BUCKET_SECONDS) * BUCKET_SECONDS;
}

function count(token: string, status: Status, finishedAt: string | null) {
  if (!ENDED.includes(status) || counted.has(token)) return;
  counted.add(token);
  const key = bucketOf(finishedAt ? Date.parse(finishedAt) : Date.now());
  const bucket = buckets.get(key) ?? { succeeded: 0, failed: 0, cancelled: 0 };
  bucket[status.toLowerCase() as keyof Bucket]++;
  buckets.set(key, bucket);
  prune();
  outcomesVersion.set(outcomesVersion.get() + 1);
}

function prune() {
  const oldest = bucketOf(Date.now() - WINDOW_MINUTES * 60_000);
  for (const key of buckets.keys()) if (key < oldest) buckets.delete(key);
  if (counted.size > 50_000) counted.clear();
}

export function countEvent(event: ChangeEvent) {
  count(event.execution.token, event.status, event.execution.finishedAt);
}

/** Ended executions a seed reads at most (pages of SEED_PAGE, newest first). */
const SEED_LIMIT = 10_000;
const SEED_PAGE = 500; // the most a page of executions holds
const SEED = `query Seed($after: String) {
  executions(first: ${SEED_PAGE}, after: $after, filter: { status: [SUCCEEDED, FAILED, CANCELLED] }) {
    nodes { token status finishedAt } pageInfo { hasNextPage endCursor }
  }
}`;

let seeded = false;
/**
 * The executions that ended within the window, once per page load (and again after a change of
 * credentials), so the charts do not start empty: newest first, page by page, until a page has
 * none that ended within the window, or SEED_LIMIT were read.
 */
export async function seedOutcomes() {
  if (seeded) return;
  seeded = true;
  const since = Date.now() - WINDOW_MINUTES * 60_000;
  let after: string | null = null;
  for (let read = 0; read < SEED_LIMIT; read += SEED_PAGE) {
    const page: { executions: { nodes: { token: string; status: Status; finishedAt: string | null }[]; pageInfo: { hasNextPage: boolean; endCursor: string | null } } } =
      await gql(SEED, { after });
    const recent = page.executions.nodes.filter((e) => e.finishedAt && Date.parse(e.finishedAt) >= since);
    for (const e of recent) count(e.token, e.status, e.finishedAt);
    if (!recent.length || !page.executions.pageInfo.hasNextPage) return;
    after = page.executions.pageInfo.endCursor;
  }
}

// what one caller's credentials saw is not shown to the next: counted again from their own work
credential.watch(() => {
  buckets.clear();
  counted.clear();
  seeded = false;
  outcomesVersion.set(outcomesVersion.get() + 1);
});

/** [bucket starts (unix seconds), succeeded, failed] over the window, one entry per bucket, up to now. */
export function series(now = Date.now()): [number[], number[], number[]] {
  const last = bucketOf(now);
  const xs: number[] = [];
  const ok: number[] = [];
  const bad: number[] = [];
  for (let t = last - WINDOW_MINUTES * 60 + BUCKET_SECONDS; t <= last; t += BUCKET_SECONDS) {
    const bucket = buckets.get(t);
    xs.push(t);
    ok.push(bucket?.succeeded ?? 0);
    bad.push(bucket?.failed ?? 0);
  }
  return [xs, ok, bad];
}
