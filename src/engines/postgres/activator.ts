import pg from 'pg';
import type { ActivatorOptions, Closeable, ExecutionStatus, GroupCommits } from '../../engine.js';
import { toError } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { connectionConfig, cutShort, liftSessionLimits, trackedClient } from './connection.js';
import type { Notifier } from './notifier.js';
import type { ProgressRelay, ProgressSource } from './progress.js';
import { rowFromJson, toExecution } from './rows.js';
import { purgeFinished } from './purge.js';
import { fireDueSchedules } from './schedules.js';

/**
 * The PostgreSQL activator: a pool of worker slots per queue, each on its own
 * connection. A slot holds a session-level advisory lock naming one of the
 * queue's `concurrency` slots, so the limit holds across every worker process;
 * a claimed call is tied to the claiming session by a second advisory lock, so a
 * dead worker's call is started again within a tick (asyncproc.recover) and a
 * live one is never started twice. A non-transactional call (registered with
 * transactional false) is sent by the slot at top level under that same lock and
 * recorded afterwards (asyncproc.conclude); lost with its worker, it ends FAILED.
 * On a queue with grouped commits (group_size > 1) a slot runs short transactional calls
 * several to a transaction (asyncproc.run_group), each under its own savepoint.
 */
export interface PostgresActivatorOptions extends ActivatorOptions {
  connectionString: string;
  logger: Logger;
  notifier: Notifier;
  /** Forwards the progress the calls report (asyncproc.progress()). */
  progress?: ProgressRelay;
  /**
   * Cut short the connections the shared pool has on their way: the stop's housekeeping waited in
   * one for the connect timeout (30 s) while the database took no new connections.
   */
  cutPoolConnects?: () => void;
  /** Period of the housekeeping tick (recover lost calls, release due ones, fallback wake). @default 1000 */
  tickMs?: number;
  /** Finished history older than this is purged. @default 7 days */
  retentionMs?: number;
}

// pg_catalog's, named: a function of another schema of the role's search_path with the exact
// argument types (hashtextextended(text, integer)) would be chosen over it for the literal 0, and
// every slot of every queue would then lock one key (found by a probe of a hostile search_path)
const SLOT_KEY = `select pg_catalog.pg_try_advisory_lock(pg_catalog.hashtextextended($1, 0)) as ok`;
/** The time one housekeeping round may spend purging. */
const PURGE_BUDGET_MS = 2000;
/**
 * How often a worker loop that holds none of its queue's slots (other processes hold them all)
 * tries again, with no connection meanwhile: between this and twice this, so that the loops of
 * many processes do not connect at one instant.
 */
const PROBE_MS = 5000;
/**
 * Loops of one queue in one process that may be connected at once while they look for a slot.
 * A raised limit then costs the database at most this many connections a process beyond the
 * slots themselves (every loop connecting at once, 4 processes raised to 100 opened 400 sessions
 * past max_connections, and an invoke failed for want of one).
 */
const PROBES = 4;
/** Tries at recording a non-transactional call's end (asyncproc.conclude) that a cancel's signals cut. */
const CONCLUDE_TRIES = 10;
/** Claims between two vacuums of the ready table. */
const VACUUM_EVERY = 2000;
const slotName = (queue: string, slot: number) => `asyncproc queue slot ${queue}#${slot}`;
/** A worker's connection: the queue slot it holds, and the statement_timeout armed on it (ms, 0: none). */
type SlotClient = ProgressSource & {
  slot?: number;
  statementTimeout?: number;
  loop?: number;
  /** How the call it runs now runs (see executionId). */
  transactional?: boolean;
  /** The token of the call it runs now (the stop's log names calls by it: `grep <token>`). */
  token?: string | null;
  /** Its server process (pg sets it from BackendKeyData; not in pg's types). */
  processID?: number;
  /** A transactional call's own statement (run, run_group) is on its way: the one statement the stop's hand-back may cancel. */
  signalable?: boolean;
  /** The stop's cancel of that statement (handBack), until pg_cancel_backend has answered; no statement is sent before it has. */
  handingBack?: Promise<void>;
  /** Calls this loop still runs one at a time, not grouped, after a group of its failed together (runGroup). */
  alone?: number;
};
const CONNECTION_ERRORS = new Set(['57P01', '57P02', '57P03', '08000', '08003', '08006', '08001', '08004']);

/**
 * Whether the slot's session is gone. An error the server sent (a DatabaseError) says so by its
 * SQLSTATE alone: its message is the call's own (an ASSERT saying "order closed", a constraint of a
 * table named connection_log), which read as a lost connection failed the call as lost five times,
 * and the good calls of its group with it. Any other error (the socket's, pg's own "Connection
 * terminated") by its code or its words.
 */
function isConnectionError(error: unknown): boolean {
  if (error instanceof pg.DatabaseError) return CONNECTION_ERRORS.has(error.code ?? '');
  const code = (error as { code?: string })?.code;
  return code === undefined || CONNECTION_ERRORS.has(code) || /terminat|Connection|ECONN|closed/i.test(String(error));
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** Something slots can wait on; a signal wakes one waiter, or is kept for the next. */
class Doorbell {
  private waiters: (() => void)[] = [];
  private pending = 0;
  private closed = false;
  /** Every wait ends now, and every later one at once (the stop: a loop that begins a wait after it must not sleep on). */
  close(): void {
    this.closed = true;
    this.ring(true);
  }
  ring(all = false): void {
    if (all) {
      const woken = this.waiters.splice(0);
      woken.forEach((w) => w());
      if (!woken.length) this.pending = 1;
      return;
    }
    const waiter = this.waiters.shift();
    if (waiter) waiter();
    else this.pending = Math.min(this.pending + 1, 1);
  }
  wait(timeoutMs: number): Promise<void> {
    if (this.closed) return Promise.resolve();
    if (this.pending > 0) {
      this.pending--;
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.waiters = this.waiters.filter((w) => w !== done);
        resolve();
      };
      const timer = setTimeout(done, timeoutMs);
      this.waiters.push(done);
    });
  }
}

class QueueWorkers {
  readonly doorbell = new Doorbell();
  /** Rung when a slot of the queue may have come free here (more concurrency, or stopping). */
  readonly vacancy = new Doorbell();
  /** Rung when a loop's look for a slot ends (see takeProbe). */
  private readonly turns = new Doorbell();
  /** Loops connected to look for a slot, holding none yet. */
  private probing = 0;
  /** When a look last found every slot held elsewhere (0: a slot may be free here since). */
  private lastFullAt = 0;
  private readonly slots = new Map<number, Promise<void>>();
  /** The connections of this queue's loops (each running a call while its executionId is set). */
  readonly clients = new Set<SlotClient>();
  constructor(
    readonly name: string,
    public concurrency: number,
    /** Read by each slot before each call, so a change applies from the next one. */
    public grouping: GroupCommits,
    private readonly activator: PostgresActivator,
  ) {
    this.resize(concurrency);
  }
  /** More slots start now; surplus ones end after their current call. */
  resize(concurrency: number): void {
    this.concurrency = concurrency;
    for (let i = 0; i < concurrency; i++) {
      if (!this.slots.has(i)) this.slots.set(i, this.runSlot(i).finally(() => this.slots.delete(i)));
    }
    this.wakeAll();
  }
  /** Every loop of the queue looks again now: those with a slot for work, those without for a slot. */
  wakeAll(): void {
    this.doorbell.ring(true);
    this.vacant();
  }
  /**
   * The stop: every wait of the queue's loops ends, now and from now on, so each sees the stop at
   * once (a loop that began its wait just after a ring slept on up to 10 s, and held the stop).
   */
  stopWaiting(): void {
    this.doorbell.close();
    this.vacancy.close();
    this.turns.close();
  }
  /** A slot may have come free here (more concurrency, a surplus loop ended, stopping): the loops without one look now. */
  private vacant(): void {
    this.lastFullAt = 0;
    this.vacancy.ring(true);
    this.turns.ring(true);
  }

  /**
   * Whether a loop that holds no slot may connect now to look for one: PROBES loops of the queue
   * at a time (waiting for a turn), and none for PROBE_MS after a look found every slot held
   * elsewhere, unless one may have come free here since (vacant). Then one look every PROBE_MS or
   * so stands for all the waiting loops of the process, instead of one session each.
   */
  private async takeProbe(index: number): Promise<boolean> {
    for (;;) {
      if (this.activator.stopping || index >= this.concurrency || Date.now() - this.lastFullAt < PROBE_MS) return false;
      if (this.probing < PROBES) {
        this.probing++;
        return true;
      }
      await this.turns.wait(PROBE_MS);
    }
  }
  /** A look for a slot ended; `full`: it found every slot held elsewhere. */
  private endProbe(full: boolean): void {
    this.probing--;
    if (full) this.lastFullAt = Date.now();
    this.turns.ring(true);
  }
  done(): Promise<void> {
    return Promise.all(this.slots.values()).then(() => undefined);
  }

  private async runSlot(index: number): Promise<void> {
    const { options } = this.activator;
    const worker = `${options.workerId}/${this.name}#${index}`;
    let client: SlotClient | null = null;
    let backoff = 100;
    /** This loop is connected (or connecting) to look for a slot: one of the queue's PROBES. */
    let probing = false;
    while (!this.activator.stopping && index < this.concurrency) {
      try {
        if (!client) {
          if (!(await this.takeProbe(index))) {
            // stopping, or surplus now: the loop ends (a wait would hold the stop up to 10 s)
            if (!this.activator.stopping && index < this.concurrency) await this.vacancy.wait(PROBE_MS * (1 + Math.random()));
            continue;
          }
          probing = true;
          client = await this.activator.connect(`asyncproc worker ${worker}`);
          this.clients.add(client);
          client.loop = index;
          options.progress?.attach(client);
          backoff = 100;
        }
        if (!(await this.acquireSlot(client))) {
          // every slot is held elsewhere: give the connection back while waiting (connections then
          // follow the slots held, not processes × concurrency), and stay off the doorbell, whose
          // rings are meant for loops that can claim
          await this.drop(client);
          client = null;
          probing = false;
          this.endProbe(true);
          await this.vacancy.wait(PROBE_MS * (1 + Math.random()));
          continue;
        }
        if (probing) {
          probing = false;
          this.endProbe(false);
        }
        await this.work(client, worker);
        await this.doorbell.wait(this.activator.tickMs);
      } catch (error) {
        const err = toError(error);
        options.logger.warn({ err, worker }, 'worker slot lost its connection; reconnecting');
        options.onError?.(err);
        if (client) await this.drop(client);
        client = null;
        if (probing) {
          probing = false;
          this.endProbe(false);
        }
        // no wait before the next attempt once the stop has begun: there is none
        if (!this.activator.stopping) await sleep(backoff);
        backoff = Math.min(backoff * 2, 5000);
      }
    }
    if (client) await this.drop(client);
    if (probing) this.endProbe(false);
    // a surplus loop's slot is free now: a loop of this process waiting for one need not wait for its next probe
    this.vacant();
  }

  /** A loop's connection closed, and no longer one of this queue's (handBack looks among them). */
  private async drop(client: SlotClient): Promise<void> {
    this.clients.delete(client);
    await client.end().catch(() => undefined);
  }

  /** Hold one of the queue's slots (session-level lock: released when this connection closes). */
  private async acquireSlot(client: SlotClient): Promise<boolean> {
    if (client.slot !== undefined && client.slot < this.concurrency) return true;
    if (client.slot !== undefined) {
      await client.query('select pg_catalog.pg_advisory_unlock(pg_catalog.hashtextextended($1, 0))', [slotName(this.name, client.slot)]);
      client.slot = undefined;
    }
    for (let slot = 0; slot < this.concurrency; slot++) {
      const { rows } = await client.query<{ ok: boolean }>(SLOT_KEY, [slotName(this.name, slot)]);
      if (rows[0].ok) {
        client.slot = slot;
        return true;
      }
    }
    return false;
  }

  /** Claim and run until the queue has nothing ready for this slot. */
  private async work(client: SlotClient, worker: string): Promise<void> {
    const claimed = (
      await client.query<ClaimRow>({
        name: 'asyncproc-claim',
        text: 'select id, seq, timeout_ms, transactional, token, procedure, more from asyncproc.claim($1, $2, 0, true)',
        values: [this.name, worker],
      })
    ).rows[0];
    if (claimed.id !== null) this.activator.options.notifier.event(claimed.id, claimed.seq!, 'RUNNING');
    let next: Claimed = {
      id: claimed.id,
      timeoutMs: claimed.timeout_ms ?? 0,
      transactional: claimed.transactional ?? true,
      token: claimed.token,
      procedure: claimed.procedure,
    };
    // the first claim says whether more is ready; a later one is made while more was coming
    let more = claimed.more === true;
    while (next.id !== null) {
      // the token and procedure on every line of a call, so `grep <token>` tells its story in every process
      const call = { token: next.token, procedure: next.procedure, queue: this.name, worker };
      if (this.activator.stopping || !this.allowed(client)) {
        // claimed by the statement that ended the last call, asked for before the stop or before
        // the queue's concurrency fell below this slot: not started, given back (a call outside a
        // transaction is never started while stopping; a slot over the limit starts nothing)
        next = await this.release(client, next.id, call, this.activator.stopping ? 'the worker is stopping' : "the queue's concurrency was lowered, or it was paused");
        continue;
      }
      this.activator.options.logger.info(call, 'execution started');
      this.activator.claimed++;
      // whoever found work lets one more idle sibling look for more
      if (more) this.doorbell.ring();
      more = true;
      // statement_timeout is armed when a statement starts, so the call's own timeout is set
      // before the statement that runs it (a round trip only when it differs from the last)
      await armTimeout(client, next.timeoutMs);
      client.executionId = next.id;
      client.transactional = next.transactional;
      client.token = next.token;
      const grouped = next.transactional && this.grouping.size > 1 && next.timeoutMs === 0 && !client.alone;
      client.group = grouped ? { size: this.grouping.size, others: new Set() } : null;
      next = !next.transactional
        ? await this.runAtTopLevel(client, worker, next.id, next.timeoutMs, call)
        : grouped
          ? await this.runGroup(client, worker, next.id, call)
          : await this.runAlone(client, worker, next.id, next.timeoutMs, call);
    }
    client.executionId = null;
    client.group = null;
  }

  /**
   * The queue to claim the next call from, in the statement that ends this one; none while
   * stopping, and none once the queue's concurrency fell below this loop or the slot it holds
   * (configureQueue lowered it): the loop then ends after its current call, as resize() says,
   * instead of going on until the queue is empty with more calls running than the limit.
   */
  private nextQueue(client: SlotClient): string | null {
    return !this.activator.stopping && this.allowed(client) ? this.name : null;
  }

  /** Whether this loop and the slot it holds are within the queue's concurrency (configureQueue may lower it). */
  private allowed(client: SlotClient): boolean {
    const within = (n: number | undefined) => n !== undefined && n < this.concurrency;
    return within(client.loop) && within(client.slot);
  }
  /** The row cap of results. */
  private get maxRows(): number {
    return this.activator.options.maxRows ?? 100;
  }

  /** A transactional call in a transaction of its own (counted down, after a group of this loop failed together). */
  private runAlone(client: SlotClient, worker: string, current: string, timeoutMs: number, call: CallLog): Promise<Claimed> {
    if (client.alone) client.alone--;
    return this.runInTransaction(client, worker, current, timeoutMs, call);
  }

  /**
   * A transactional call: asyncproc.run() runs it and records its outcome in one transaction.
   * When a subscriber of this process awaits its end, run() also returns the row it left, which
   * goes to that subscriber with the change: it hears the end without a read of the feed.
   */
  private async runInTransaction(client: SlotClient, worker: string, current: string, timeoutMs: number, call: CallLog): Promise<Claimed> {
    const started = Date.now();
    try {
      const ran = (
        // a named (prepared) statement: parsed and planned once per connection
        await this.signalable(client, client.query<EndedRow>({
          name: 'asyncproc-run',
          text: 'select done_seq, done_status, next_id, next_seq, next_timeout_ms, next_transactional, next_token, next_procedure, done_row from asyncproc.run($1, $2, $3, $4, $5)',
          values: [current, worker, this.nextQueue(client), this.maxRows, call.token !== null && this.activator.options.notifier.awaited(call.token)],
        }))
      ).rows[0];
      return this.ended(current, ran, call);
    } catch (error) {
      return this.abandon(client, current, error, timeoutMs, started, call);
    }
  }

  /**
   * A grouped commit: asyncproc.run_group() runs this call and more of the queue in one
   * transaction; after its commit, each call it ended is logged and notified here. A cancel or
   * an error that escapes the calls' own capture rolls the whole group back: only this call was
   * committed RUNNING, so only this one is abandoned or given back (the others are PENDING again).
   */
  private async runGroup(client: SlotClient, worker: string, current: string, call: CallLog): Promise<Claimed> {
    const started = Date.now();
    let rows: GroupRow[];
    try {
      rows = (
        await this.signalable(client, client.query<GroupRow>({
          name: 'asyncproc-run-group',
          text: 'select id, seq, status, token, procedure, timeout_ms, transactional from asyncproc.run_group($1, $2, $3, $4, $5, $6)',
          values: [current, worker, this.nextQueue(client), this.grouping.size, this.grouping.maxMs, this.maxRows],
        }))
      ).rows;
    } catch (error) {
      if (isConnectionError(error) || client.handingBack !== undefined) return this.abandon(client, current, error, 0, started, call);
      // An error no call's savepoint caught (an assert, a cancel a call raised itself, a deadlock
      // between groups, a deferred constraint at the commit) rolled the whole group back, and
      // which of its calls failed is not known. Recorded as this call's, it failed the calls that
      // did nothing wrong, one after another as each came first. So this call is given back
      // (PENDING, not an attempt; CANCELLED if a cancel was asked for it), the others
      // are PENDING again (never committed), and this loop runs as many calls as a group may hold
      // one at a time: the failing call then fails alone, with its own error. A cancel signal
      // without a request (57014) counts as any interruption of a call (one of five).
      const err = error as pg.DatabaseError;
      const ended = await this.abandonCall(client, current, err.code ?? null, err.message, false, err.code !== '57014');
      const { logger } = this.activator.options;
      if (ended.done_status === 'CANCELLED') logger.info({ ...call, code: err.code, error: err.message }, 'execution stopped (cancelled or timed out)');
      else {
        client.alone = this.grouping.size;
        logger.warn({ ...call, code: err.code, error: err.message }, 'a group of calls failed together; given back, they run one at a time');
      }
      return this.ended(current, ended, call);
    }
    const { logger } = this.activator.options;
    let next: EndedRow = { done_seq: null, done_status: null, next_id: null };
    for (const row of rows) {
      if (row.status === 'RUNNING') {
        next = { ...next, next_id: row.id, next_seq: row.seq, next_timeout_ms: row.timeout_ms, next_transactional: row.transactional, next_token: row.token, next_procedure: row.procedure };
      } else if (row.id === current) {
        this.ended(current, { done_seq: row.seq, done_status: row.status, next_id: null }, call);
      } else {
        // claimed, run and ended inside the group: its start is logged now, after the commit
        const member = { ...call, token: row.token, procedure: row.procedure };
        this.activator.claimed++;
        logger.info({ ...member, grouped: current }, 'execution started');
        this.ended(row.id, { done_seq: row.seq, done_status: row.status, next_id: null }, member);
      }
    }
    return this.ended(current, next, call);
  }

  /** The call escaped run()'s own error capture (cancelled statement, timeout): end it here. */
  private async abandon(client: SlotClient, current: string, error: unknown, timeoutMs: number, started: number, call: CallLog): Promise<Claimed> {
    if (isConnectionError(error)) throw error;
    const err = error as pg.DatabaseError;
    const timedOut = isOwnTimeout(err, timeoutMs, started);
    // the stop's cancel (a cancel on request is CANCELLED whatever this says: abandon reads the request first)
    const handedBack = client.handingBack !== undefined && err.code === '57014' && !timedOut;
    this.activator.options.logger.info({ ...call, code: err.code, timedOut, handedBack, error: err.message }, 'execution stopped (cancelled or timed out)');
    return this.ended(current, await this.abandonCall(client, current, err.code ?? null, describe(err, timedOut, timeoutMs), timedOut, handedBack), call);
  }

  /** A call claimed here and not started, given back to its queue (the worker is stopping, or the slot is over the limit). */
  private async release(client: SlotClient, current: string, call: CallLog, why: string): Promise<Claimed> {
    this.activator.options.logger.info({ ...call, why }, 'execution given back unstarted');
    return this.ended(current, await this.abandonCall(client, current, '57014', `given back unstarted: ${why}`, false, true), call);
  }

  /** asyncproc.abandon() of a call this slot holds, with no statement timeout armed. */
  private async abandonCall(client: SlotClient, current: string, code: string | null, message: string, timedOut: boolean, handedBack: boolean): Promise<EndedRow> {
    // the call's (or the last call's) timeout may still be armed on the session: a short one (a few
    // ms) would cut this record too (it may wait for the row), and the slot would then drop its
    // session as lost (recover: LOST, then AP010)
    await armTimeout(client, 0);
    return (
      await client.query<EndedRow>('select done_seq, done_status, null as next_id from asyncproc.abandon($1, $2, $3, $4, $5)', [current, code, message, timedOut, handedBack])
    ).rows[0];
  }

  /**
   * A transactional call's own statement, which the stop's hand-back may cancel while it is on its
   * way, and only then: once it has settled, nothing more is sent on the session before that
   * cancel (if one was sent) has been answered. A cancel signal that reaches a session between
   * statements is dropped ("Query cancel is supposed to be a no-op when there is no query in
   * progress", PostgreSQL's postgres.c), and the next statement is sent after pg_cancel_backend
   * answered, that is after the signal was raised: it can never cut the statement after the
   * call's (the next call's, or the record of this one's end).
   */
  private async signalable<T>(client: SlotClient, statement: Promise<T>): Promise<T> {
    client.signalable = true;
    try {
      return await statement;
    } finally {
      client.signalable = false;
      if (client.handingBack) await client.handingBack;
    }
  }

  /**
   * A non-transactional call: its statement is sent at top level, with no transaction open,
   * while the claim's session-level lock names the call (recover sees it alive); then
   * asyncproc.conclude() records the outcome in a transaction of its own, as the owner.
   */
  private async runAtTopLevel(client: SlotClient, worker: string, current: string, timeoutMs: number, call: CallLog): Promise<Claimed> {
    const started = Date.now();
    let outcome: { succeeded: boolean; function: string | null; names: string[] | null; types: number[] | null; values: (string | null)[] | null } = {
      succeeded: false, function: null, names: null, types: null, values: null,
    };
    let failure: pg.DatabaseError | null = null;
    try {
      const prepared = (
        await client.query<{ statement: string; arguments: string | null; kind: string }>({
          name: 'asyncproc-prepare-call',
          // the arguments as text: through JSON.parse, numbers beyond 2^53 would lose digits
          text: 'select statement, arguments::text as arguments, kind from asyncproc.prepare_call($1, $2)',
          values: [current, this.maxRows],
        })
      ).rows[0];
      if (prepared) {
        const result = await client.query<(string | null)[]>({
          text: prepared.statement,
          values: prepared.arguments === null ? [] : [prepared.arguments],
          rowMode: 'array',
          types: RAW_TEXT, // conclude reads each value back as its type
        });
        if (prepared.kind !== 'p') outcome = { ...outcome, succeeded: true, function: result.rows[0]?.[0] ?? null };
        else if (result.fields.length) {
          outcome = {
            ...outcome,
            succeeded: true,
            names: result.fields.map((f) => f.name),
            types: result.fields.map((f) => f.dataTypeID),
            values: result.rows[0] ?? result.fields.map(() => null),
          };
        } else outcome = { ...outcome, succeeded: true };
      }
      // no row: not ours to run (recover took it from a lost lock); conclude only releases it
    } catch (error) {
      if (isConnectionError(error)) throw error;
      failure = error as pg.DatabaseError;
    }
    const timedOut = failure !== null && isOwnTimeout(failure, timeoutMs, started);
    const conclude = () =>
      client.query<EndedRow>({
        name: 'asyncproc-conclude',
        text: `select done_seq, done_status, next_id, next_seq, next_timeout_ms, next_transactional, next_token, next_procedure
                 from asyncproc.conclude($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
        values: [
          current, worker, this.nextQueue(client), outcome.succeeded, outcome.function, outcome.names, outcome.types, outcome.values,
          failure ? (failure.code ?? 'XX000') : null,
          failure ? describe(failure, timedOut, timeoutMs) : null,
          failure?.detail ?? null,
          failure?.where ?? null,
        ],
      });
    let ended: EndedRow | undefined;
    // stopped by its timeout (or a cancel): the timeout still armed would cut the record of it as well
    if (failure?.code === '57014') await armTimeout(client, 0);
    for (let attempt = 1; !ended; attempt++) {
      try {
        ended = (await conclude()).rows[0];
      } catch (error) {
        if (isConnectionError(error)) throw error;
        // The call's effects are committed; a late cancel or the call's own timeout cut the record
        // of them. Again with no timeout armed. A cancel waiting for the call's end signals this
        // session again (cancel_resignal) while conclude() waits for the row the signal's statement
        // holds, every 50 ms at most, so only a cancel's cut is sent again past the second try;
        // anything else, or past CONCLUDE_TRIES, the slot drops its session and recover ends the
        // call FAILED (AP008) rather than run it twice.
        if (attempt >= CONCLUDE_TRIES || (attempt > 1 && (error as { code?: string }).code !== '57014')) throw error;
        this.activator.options.logger.warn({ err: toError(error), token: call.token, procedure: call.procedure, attempt }, 'recording a non-transactional call failed; once more');
        await armTimeout(client, 0);
      }
    }
    return this.ended(current, ended, call);
  }

  /**
   * A failed attempt that will be retried, logged with its number and error (read back from the
   * attempts it was moved to: retries are few, and `grep <token>` then tells why each one failed).
   */
  private async logRetry(current: string, call: CallLog): Promise<void> {
    const { logger } = this.activator.options;
    const attempt = await this.activator.lastAttempt(current).catch(() => null);
    logger.info(
      { ...call, status: 'WAITING', ...(attempt ? { attempt: attempt.number, error: { number: attempt.error_number, message: attempt.error_message?.slice(0, 500) } } : {}) },
      'execution will retry',
    );
  }

  /** Notify what a run or an abandon ended and claimed; the next call to run. */
  private ended(current: string, row: EndedRow, call: CallLog): Claimed {
    const { notifier, logger } = this.activator.options;
    if (row.done_status === 'WAITING') void this.logRetry(current, call);
    else if (row.done_status) logger.info({ ...call, status: row.done_status }, 'execution ended');
    if (row.done_seq !== null) notifier.event(current, row.done_seq, row.done_status!, row.done_row ? toExecution(rowFromJson(row.done_row)) : undefined);
    if (row.done_status === 'WAITING') this.activator.scheduleDue(); // a retry with backoff
    if (row.next_id !== null) notifier.event(row.next_id, row.next_seq!, 'RUNNING');
    return {
      id: row.next_id,
      timeoutMs: row.next_timeout_ms ?? 0,
      transactional: row.next_transactional ?? true,
      token: row.next_token ?? null,
      procedure: row.next_procedure ?? null,
    };
  }
}

/** Set the session's statement_timeout (ms, 0: none), unless it is armed already. */
async function armTimeout(client: SlotClient, timeoutMs: number): Promise<void> {
  if (client.statementTimeout === timeoutMs) return;
  await client.query(`select set_config('statement_timeout', $1, false)`, [String(timeoutMs)]);
  client.statementTimeout = timeoutMs;
}

/**
 * Both a timeout and a cancel signal are 57014; only our own timeout can fire after that long
 * (the session's is 0 otherwise), and the message is localized.
 */
function isOwnTimeout(err: pg.DatabaseError, timeoutMs: number, started: number): boolean {
  return err.code === '57014' && timeoutMs > 0 && Date.now() - started >= timeoutMs;
}

function describe(err: pg.DatabaseError, timedOut: boolean, timeoutMs: number): string {
  return timedOut ? `${err.message} (timeout ${timeoutMs} ms)` : err.message;
}

/** Every value as the text the server sent. */
const RAW_TEXT: pg.CustomTypesConfig = { getTypeParser: () => (value: string) => value } as unknown as pg.CustomTypesConfig;

interface ClaimRow {
  more: boolean | null;
  id: string | null;
  seq: string | null;
  timeout_ms: number | null;
  transactional: boolean | null;
  token: string | null;
  procedure: string | null;
}

/** What an execution's log lines carry. */
interface CallLog {
  token: string | null;
  procedure: string | null;
  queue: string;
  worker: string;
}

/** The next call a slot runs (id null: none claimed). */
interface Claimed {
  id: string | null;
  timeoutMs: number;
  transactional: boolean;
  token: string | null;
  procedure: string | null;
}

/** A row of asyncproc.run_group(): a call it ended, or (status RUNNING) the next one it claimed. */
interface GroupRow {
  id: string;
  seq: string;
  status: ExecutionStatus;
  token: string | null;
  procedure: string | null;
  timeout_ms: number | null;
  transactional: boolean | null;
}

/** What run(), conclude() and abandon() report: the call they ended, the next one they claimed. */
interface EndedRow {
  done_seq: string | null;
  done_status: ExecutionStatus | null;
  next_id: string | null;
  next_seq?: string | null;
  next_timeout_ms?: number | null;
  next_transactional?: boolean | null;
  next_token?: string | null;
  next_procedure?: string | null;
  /** The ended call's row as JSON (run() with with_row). */
  done_row?: Record<string, unknown> | null;
}

export class PostgresActivator implements Closeable {
  stopping = false;
  readonly tickMs: number;
  /** Calls claimed since the ready table was last vacuumed by this process. */
  claimed = 0;
  private vacuumRefused = false;
  private readonly queues = new Map<string, QueueWorkers>();
  private waker: pg.Client | null = null;
  private wakerRetry: NodeJS.Timeout | null = null;
  private wakerConnecting: Promise<void> = Promise.resolve();
  /** Connections on their way (connect()). */
  private readonly opening = new Set<pg.Client>();
  private readonly Client = trackedClient(this.opening);
  private ticker: NodeJS.Timeout | null = null;
  private lastPurge = 0;
  private housekeeping: Promise<void> = Promise.resolve();
  private dueTimer: NodeJS.Timeout | null = null;
  private scheduling = false;
  private rescheduling = false;

  constructor(readonly options: PostgresActivatorOptions, private readonly pool: pg.Pool) {
    this.tickMs = options.tickMs ?? 1000;
  }

  /** The latest attempt recorded for an execution (a failed one that is being retried). */
  async lastAttempt(id: string): Promise<{ number: number; error_number: string | null; error_message: string | null } | null> {
    const { rows } = await this.pool.query<{ number: number; error_number: string | null; error_message: string | null }>(
      'select number, error_number, error_message from asyncproc.attempts where execution_id = $1 order by number desc limit 1',
      [id],
    );
    return rows[0] ?? null;
  }

  async connect(applicationName: string): Promise<pg.Client> {
    // none begins once the stop has begun (close() cuts short those under way)
    if (this.stopping) throw new Error('the activator is stopping');
    // one still on its way when the stop comes is cut short there (close())
    const client: SlotClient = new this.Client({
      // no statement_timeout but the one a call's procedure sets: a server default must not cut calls
      ...connectionConfig(this.options.connectionString, { statement_timeout: '0' }),
      application_name: applicationName,
    });
    client.statementTimeout = 0;
    client.on('error', (error) => this.options.logger.debug({ err: error }, 'worker connection error'));
    await client.connect();
    await liftSessionLimits(client);
    // a killed worker's running statement is abandoned within a second, so its call is recovered promptly
    await client.query(`set client_connection_check_interval = 1000`).catch(() => undefined);
    return client;
  }

  async start(): Promise<void> {
    await this.listenForWork();
    await this.refreshQueues();
    this.ticker = setInterval(() => {
      this.housekeeping = this.housekeeping.then(() => this.tick());
    }, this.tickMs);
  }

  private async listenForWork(): Promise<void> {
    let backoff = 100;
    /** A connection was made before this one: its notifications may have been missed since. */
    let deafened = false;
    const connect = async (): Promise<void> => {
      try {
        const client = await this.connect(`asyncproc activator ${this.options.workerId}`);
        client.on('notification', (msg) => {
          // this process's own wake: its activators were woken (wake()) when it was queued
          if (msg.channel === 'asyncproc_wake' && this.options.notifier.sentBy(msg.processId)) return;
          if (msg.channel === 'asyncproc_queues') {
            this.refreshQueuesSoon();
            return;
          }
          this.queues.get(msg.payload ?? '')?.doorbell.ring();
          this.scheduleDue();
        });
        client.on('error', () => undefined);
        client.on('end', () => {
          this.waker = null;
          again();
        });
        await client.query('listen asyncproc_wake; listen asyncproc_queues');
        // stopped while this connection was on its way (a reconnect the close did not see): it
        // must not outlive the stop
        if (this.stopping) {
          await client.end().catch(() => undefined);
          return;
        }
        this.waker = client;
        backoff = 100;
        // anything enqueued while we were deaf is found now, and a change of a queue's settings
        // made meanwhile (its concurrency, a pause or a resume) is read again
        for (const queue of this.queues.values()) queue.doorbell.ring(true);
        if (deafened) this.refreshQueuesSoon();
        deafened = true;
      } catch (error) {
        this.options.onError?.(toError(error));
        backoff = Math.min(backoff * 2, 5000);
        again();
      }
    };
    /** The next attempt after a wait; close() clears the wait and waits for an attempt under way. */
    const again = () => {
      if (this.stopping) return;
      this.wakerRetry = setTimeout(() => {
        this.wakerRetry = null;
        this.wakerConnecting = connect();
      }, backoff);
    };
    await connect();
  }

  /** refreshQueues after the housekeeping under way. */
  private refreshQueuesSoon(): void {
    this.housekeeping = this.housekeeping.then(() => this.refreshQueues().catch((err) => this.options.onError?.(toError(err))));
  }

  /**
   * The queues' settings, read again. A paused queue has no slots here: its loops end after their
   * call and give their connections back (take_ready, not this, is what keeps its calls from
   * starting in every process).
   */
  private async refreshQueues(): Promise<void> {
    const { rows } = await this.pool.query<{ name: string; concurrency: number; group_size: number; group_ms: number; paused: boolean }>(
      'select name, concurrency, group_size, group_ms, paused from asyncproc.queues order by name',
    );
    for (const row of rows) {
      if (this.options.queues && !this.options.queues.includes(row.name)) continue;
      const grouping = { size: row.group_size, maxMs: row.group_ms };
      const slots = row.paused ? 0 : row.concurrency;
      const existing = this.queues.get(row.name);
      if (!existing) this.queues.set(row.name, new QueueWorkers(row.name, slots, grouping, this));
      else {
        existing.grouping = grouping;
        if (existing.concurrency !== slots) existing.resize(slots);
      }
    }
  }

  /**
   * Arm one timer for the earliest WAITING call's runAt, so it is released when due,
   * not on the next tick. Called whenever a call may have started waiting.
   */
  scheduleDue(): void {
    if (this.stopping) return;
    if (this.scheduling) {
      this.rescheduling = true;
      return;
    }
    this.scheduling = true;
    void (async () => {
      try {
        do {
          this.rescheduling = false;
          const { rows } = await this.pool.query<{ ms: number | null }>(
            `select extract(epoch from asyncproc.next_due() - clock_timestamp()) * 1000 as ms`,
          );
          if (this.dueTimer) clearTimeout(this.dueTimer);
          this.dueTimer = null;
          const ms = rows[0].ms === null ? null : Number(rows[0].ms);
          if (ms !== null && !this.stopping) {
            this.dueTimer = setTimeout(() => {
              this.dueTimer = null;
              this.pool.query('select asyncproc.release_due()').then(
                () => this.scheduleDue(),
                (error) => this.options.logger.warn({ err: toError(error) }, 'releasing due calls failed; the tick retries'),
              );
            }, Math.min(Math.max(ms, 0), 60_000));
          }
        } while (this.rescheduling);
      } catch (error) {
        this.options.logger.warn({ err: toError(error) }, 'scheduling due calls failed; the tick retries');
      } finally {
        this.scheduling = false;
      }
    })();
  }

  private async tick(): Promise<void> {
    if (this.stopping) return;
    try {
      const { rows: recovered } = await this.pool.query<{ token: string; procedure: string; status: string; error_number: string | null }>(
        'select token, procedure, status, error_number from asyncproc.recover_lost()',
      );
      for (const r of recovered) {
        this.options.logger.warn(
          { token: r.token, procedure: r.procedure, status: r.status, errorNumber: r.error_number ?? undefined },
          r.status === 'PENDING' ? 'execution recovered: its worker was lost; it runs again' : 'execution ended: its worker was lost',
        );
      }
      await this.pool.query('select asyncproc.release_due()');
      for (const { token, procedure, queue, status, runAt, schedule, submittedBy } of await fireDueSchedules(this.pool)) {
        // as a client's invoke is logged, so `grep <token>` begins with its submit
        this.options.logger.info({ token, procedure, queue, status, runAt, schedule, by: submittedBy }, 'execution submitted');
      }
      if (!this.dueTimer) this.scheduleDue();
      await this.vacuumReady();
      if (Date.now() - this.lastPurge > 60_000) {
        this.lastPurge = Date.now();
        await this.purge();
        await this.refreshQueues();
      }
    } catch (error) {
      this.options.logger.warn({ err: toError(error) }, 'activator housekeeping failed; will retry');
    }
    // a fallback in case a notification was missed
    for (const queue of this.queues.values()) queue.doorbell.ring();
  }

  /** Retention, a bounded amount per housekeeping round (see purge.ts). */
  private async purge(): Promise<number> {
    const total = await purgeFinished(this.pool, this.options.retentionMs ?? 7 * 86_400_000, {
      budgetMs: PURGE_BUDGET_MS,
      stopped: () => this.stopping,
    });
    if (total) this.options.logger.info({ purged: total }, 'purged finished history past the retention');
    return total;
  }

  /** Work was just committed on these queues (by this process): wake a slot at once; some of it due later (`waiting`): arm its timer. */
  wake(queues: Iterable<string>, waiting = false): void {
    for (const queue of queues) this.queues.get(queue)?.doorbell.ring();
    if (waiting) this.scheduleDue();
  }

  /**
   * Every claim deletes a ready row, and a claim's index scan walks past the dead ones
   * until they are vacuumed; autovacuum (once a minute at best) is too slow for a busy
   * queue, so the activator vacuums that small table itself after many claims.
   */
  private async vacuumReady(): Promise<void> {
    if (this.claimed < VACUUM_EVERY || this.vacuumRefused) return;
    this.claimed = 0;
    try {
      await this.pool.query('vacuum (skip_locked) asyncproc.ready');
    } catch (error) {
      this.vacuumRefused = true; // not the table's owner: autovacuum does it, later
      this.options.logger.warn({ err: toError(error) }, 'cannot vacuum asyncproc.ready; leaving it to autovacuum');
    }
  }

  async close(): Promise<void> {
    this.stopping = true;
    if (this.ticker) clearInterval(this.ticker);
    if (this.dueTimer) clearTimeout(this.dueTimer);
    // every connection on its way is cut short, a database that does not answer would hold the
    // stop for the connect timeout: a worker's, the wake listener's reconnect, and the shared
    // pool's, which the housekeeping under way may wait in (its statement fails, and the tick
    // with it). None of this activator's begins from now on (connect()).
    this.opening.forEach(cutShort);
    this.options.cutPoolConnects?.();
    await this.housekeeping;
    for (const queue of this.queues.values()) queue.stopWaiting();
    const done = Promise.all([...this.queues.values()].map((q) => q.done()));
    const graceMs = this.options.stopGraceMs ?? Infinity;
    if (Number.isFinite(graceMs)) {
      let timer: NodeJS.Timeout | undefined;
      const over = await Promise.race([done.then(() => false), new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(true), graceMs)))]);
      clearTimeout(timer);
      if (over) await this.handBack(graceMs);
    }
    await done;
    if (this.wakerRetry) clearTimeout(this.wakerRetry);
    // a reconnect that got through ends its connection once it sees the stop
    await this.wakerConnecting;
    await this.waker?.end().catch(() => undefined);
  }

  /**
   * The stop's grace is over: cancel the statement of every transactional call still running
   * here. Its transaction rolls back and abandon() puts it back in its queue, PENDING again at
   * once (not an attempt, nor one of the five interruptions a call may have), where another
   * worker takes it, or this service after its restart. Only a statement on its way is signalled
   * (SlotClient.signalable), every one at once, and its session sends nothing more before the
   * signal was raised (signalable()): a signal landing as the call ends is dropped, never taken
   * by the next statement. A call the ending statement claimed is given back unstarted (work()).
   * A call outside a transaction is left to end: what it committed cannot be undone.
   */
  private async handBack(graceMs: number): Promise<void> {
    const { logger } = this.options;
    const clients = [...this.queues.values()].flatMap((q) => [...q.clients]);
    const back = clients.filter((c) => c.signalable);
    // marked before any await: a statement that settles from now on waits for its signal
    for (const client of back) {
      client.handingBack = this.pool.query('select pg_cancel_backend($1)', [client.processID]).then(
        () => undefined,
        (err) => logger.warn({ err }, 'could not hand a call back'),
      );
    }
    logger.warn(
      {
        graceMs,
        handedBack: back.map((c) => c.token),
        waitedFor: clients.filter((c) => c.executionId != null && !c.signalable).map((c) => c.token),
      },
      'stop: the grace is over; running calls go back to their queues, to run again from the start',
    );
    await Promise.all(back.map((c) => c.handingBack));
  }
}
