/**
 * Positions in the change feed, and the cursors clients resume from.
 *
 * Every change of an execution row is stamped with a number that says which writer made
 * it: the writing transaction's id on PostgreSQL (`pg_current_xact_id()`), the rowversion
 * on SQL Server. Those numbers are handed out when the write happens, not when it commits,
 * so "everything up to n" is not a safe cursor: n may be seen while n - 1 is still open
 * and commits later. A position is therefore a snapshot in PostgreSQL's sense — xmin,
 * xmax and the in-progress list between them — and says exactly which writers it has
 * seen: every number below xmin, none from xmax on, and between them all but the listed
 * ones. A reader that read with snapshot S has read every change S sees; the changes it
 * has not read are exactly those S does not see, however late they commit, and on
 * PostgreSQL no reader waits for a long transaction to end before it may move on.
 *
 * SQL Server positions are snapshots with no in-progress list (every rowversion below
 * MIN_ACTIVE_ROWVERSION() has committed, none above is read yet). There a reader does wait:
 * MIN_ACTIVE_ROWVERSION() stays below any open transaction of the database that wrote a
 * rowversion, so such a transaction holds the feed back until it ends.
 *
 * The text form is PostgreSQL's own (`xmin:xmax:xip,xip`), decimal.
 *
 * A cursor is a position, and may say more: that of one writer the snapshot does not see,
 * the changes up to some order have been read too (`;writer:order` after the snapshot). A
 * PostgreSQL transaction that changed 10,000 calls is one writer; a subscriber that left in
 * the middle of its changes resumes after the last one it read, not from that writer's first
 * (a client that always left before the end started it over each time, and never got past).
 * SQL Server gives every change a writer of its own: its cursors never carry one.
 */

export interface Snapshot {
  xmin: bigint;
  xmax: bigint;
  /** Writers in progress at the snapshot, ascending, each in [xmin, xmax). */
  xip: readonly bigint[];
}

/** A client's cursor is refused beyond this size (a real one lists the writers in progress). */
const MAX_CURSOR_LENGTH = 65_536;
const SNAPSHOT = /^(\d{1,20}):(\d{1,20}):((?:\d{1,20})(?:,\d{1,20})*)?$/;
const MAX_XID = (1n << 64n) - 1n;

/**
 * Parses a position; null when the text is not one (wrong shape, out of order, out of range):
 * every text it accepts is one PostgreSQL's pg_snapshot accepts too (test/postgres.test.ts).
 */
export function parseSnapshot(text: string): Snapshot | null {
  if (text.length > MAX_CURSOR_LENGTH) return null;
  const match = SNAPSHOT.exec(text);
  if (!match) return null;
  const xmin = BigInt(match[1]);
  const xmax = BigInt(match[2]);
  const xip = match[3] ? match[3].split(',').map(BigInt) : [];
  // 0 is no writer's number on either engine (PostgreSQL's pg_snapshot refuses it: 22P02)
  if (xmin < 1n || xmax > MAX_XID || xmin > xmax) return null;
  let last = -1n;
  for (const x of xip) {
    if (x < xmin || x >= xmax || x <= last) return null;
    last = x;
  }
  return { xmin, xmax, xip };
}

/** A client's cursor: a position, and how far into one writer it does not see it has read. */
export interface Cursor {
  snapshot: Snapshot;
  /** Of `writer` (not seen by the snapshot), the changes up to `order` were read. */
  partial: { writer: bigint; order: bigint } | null;
}

const PARTIAL = /^(\d{1,20}):(\d{1,20})$/;
const MAX_ORDER = (1n << 63n) - 1n;

/** Parses a cursor (a position, `;writer:order` after it when it stopped inside a writer); null when malformed. */
export function parseCursor(text: string): Cursor | null {
  const cut = text.indexOf(';');
  const snapshot = parseSnapshot(cut < 0 ? text : text.slice(0, cut));
  if (!snapshot) return null;
  if (cut < 0) return { snapshot, partial: null };
  const match = PARTIAL.exec(text.slice(cut + 1));
  if (!match) return null;
  const partial = { writer: BigInt(match[1]), order: BigInt(match[2]) };
  // a writer the position sees has been read whole: no part of it is left to say
  if (partial.writer > MAX_XID || partial.order > MAX_ORDER || sees(snapshot, partial.writer)) return null;
  return { snapshot, partial };
}

export function formatCursor(cursor: Cursor): string {
  const { snapshot, partial } = cursor;
  return partial ? `${formatSnapshot(snapshot)};${partial.writer}:${partial.order}` : formatSnapshot(snapshot);
}

export function formatSnapshot(snapshot: Snapshot): string {
  return `${snapshot.xmin}:${snapshot.xmax}:${snapshot.xip.join(',')}`;
}

/** Whether the writer `x` is seen by the snapshot (its changes were read). */
export function sees(snapshot: Snapshot, x: bigint): boolean {
  if (x < snapshot.xmin) return true;
  if (x >= snapshot.xmax) return false;
  return !snapshot.xip.includes(x);
}

/**
 * The position that sees what `floor` sees and, of what `upper` sees, the writers below
 * `bound`. A reader at `floor` that then read `upper`'s changes in writer order up to
 * `bound` is exactly there. `bound` may not exceed upper.xmax.
 */
export function extend(floor: Snapshot, upper: Snapshot, bound: bigint): Snapshot {
  const below = bound < upper.xmax ? bound : upper.xmax;
  const xmax = floor.xmax > below ? floor.xmax : below;
  const unseen = new Set<bigint>();
  // below the bound: unseen when neither sees it (under upper.xmax, upper misses only its xip)
  for (const x of upper.xip) if (x < below && !sees(floor, x)) unseen.add(x);
  // from the bound to floor.xmax: what floor misses there
  for (const x of floor.xip) if (x >= below) unseen.add(x);
  const xip = [...unseen].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  return { xmin: xip.length ? xip[0] : xmax, xmax, xip };
}

/** The position that sees everything either sees (a later read is usually a superset). */
export function union(a: Snapshot, b: Snapshot): Snapshot {
  return extend(a, b, b.xmax);
}
