/**
 * The life of a claimed call on PostgreSQL, race by race: the worker's lock outlives its
 * commit, only the owning session ends a call, timeouts fail an attempt, the engine's
 * sessions ignore the server's defaults, cancel signals only the lock holder, and lock
 * keys never collide. Most tests drive the SQL routines from hand-made sessions, so each
 * interleaving happens in the order the test sets, not by luck.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import type { Closeable, Execution } from '../src/engine.js';
import { connectionConfig } from '../src/engines/postgres/connection.js';
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { startDemoDatabase, waitFor, type TestCluster } from './support/database.js';

let cluster: TestCluster;
let url: string;
let engine: PostgresEngine;
let sql: pg.Client;
const sessions: pg.Client[] = [];

const SCHEMA = `create schema lc;
  create procedure lc.record_sleep(tag text, seconds double precision) language plpgsql as $$
  begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$;
  create function lc.session() returns jsonb language sql as $$
    select jsonb_object_agg(name, setting) from pg_settings
     where name in ('transaction_isolation', 'statement_timeout', 'tcp_keepalives_idle', 'tcp_keepalives_interval', 'tcp_keepalives_count') $$;
  select asyncproc.register('lc.session()');
  select asyncproc.register('lc.record_sleep(text, double precision)');`;

before(async () => {
  ({ cluster, url, engine, sql } = await startDemoDatabase());
  await sql.query(SCHEMA);
  for (const queue of ['lc_commit', 'lc_owner', 'lc_cancel', 'lc_keys', 'lc_between']) await engine.configureQueue(queue, 1);
});
after(async () => {
  await Promise.all(sessions.map((s) => s.end().catch(() => undefined)));
  await sql?.end();
  await engine?.close();
  await cluster?.stop();
});

/** A session of its own (a worker, a second housekeeper, an unrelated backend). */
async function session(): Promise<pg.Client & { pid: number }> {
  const client = (await cluster.connect(url)) as pg.Client & { pid: number };
  client.pid = (await client.query('select pg_backend_pid() as pid')).rows[0].pid;
  sessions.push(client);
  return client;
}

async function submit(procedure: string, args: Record<string, unknown>, queue: string, maxAttempts = 1): Promise<Execution> {
  return (await engine.submit([{ procedure, arguments: args, queue, maxAttempts }]))[0];
}

async function claim(worker: pg.Client & { pid: number }, queue: string): Promise<string | null> {
  return (await worker.query(`select id from asyncproc.claim($1, 'w${worker.pid}')`, [queue])).rows[0].id;
}

const row = async (id: string) =>
  (await sql.query('select status, backend_pid, attempts, recoveries from asyncproc.executions where id = $1', [id])).rows[0];
const counts = async (id: string) => {
  const { status, attempts, recoveries } = await row(id);
  return { status, attempts, recoveries };
};
/** Until `count` run() statements of the worker `workerId` are on their way (each will claim the queue's next call as it ends). */
const runsOnTheirWay = (workerId: string, count = 1) =>
  waitFor(
    async () =>
      Number(
        (await sql.query(`select count(*) from pg_stat_activity where application_name like $1 and state = 'active' and query like '%asyncproc.run(%'`, [`asyncproc worker ${workerId}/%`])).rows[0].count,
      ) === count,
    10_000,
    `${count} run() of ${workerId} on its way`,
  );
const attempts = async (id: string) =>
  (await sql.query('select status from asyncproc.attempts where execution_id = $1 order by number', [id])).rows.map((r) => r.status);
const ledger = async (tag: string) => Number((await sql.query('select count(*) from demo.ledger where tag = $1', [tag])).rows[0].count);
/**
 * What the activator does with a non-transactional call a cancel stopped: record it
 * (asyncproc.conclude), again while the cancel's renewed signal (cancel_resignal, every 50 ms
 * while the cancel waits) cuts the record itself.
 */
async function concludeCancelled(worker: pg.Client & { pid: number }, id: string): Promise<void> {
  for (let attempt = 1; ; attempt++) {
    try {
      await worker.query('select * from asyncproc.conclude($1, $2, null, false, null, null, null, null, $3, $4, null, null)', [
        id, `w${worker.pid}`, '57014', 'canceling statement due to user request',
      ]);
      return;
    } catch (error) {
      if ((error as { code?: string }).code !== '57014' || attempt === 10) throw error;
    }
  }
}
/** Advisory locks a session holds (granted). */
const advisoryLocks = async (pid: number) =>
  Number((await sql.query(`select count(*) from pg_locks where pid = $1 and locktype = 'advisory' and granted`, [pid])).rows[0].count);
/** Resolves once the session waits on a lock (a row lock, an advisory lock). */
const blocked = (pid: number, what: string) =>
  waitFor(async () => (await sql.query(`select 1 from pg_stat_activity where pid = $1 and wait_event_type = 'Lock'`, [pid])).rowCount, 10_000, what);
/** Ends a worker's session and waits until the server has let it go (and its locks). */
async function kill(worker: pg.Client & { pid: number }): Promise<void> {
  await worker.end();
  await waitFor(async () => !(await sql.query('select 1 from pg_stat_activity where pid = $1', [worker.pid])).rowCount, 10_000, 'the worker to go');
}

/**
 * A call RUNNING for a worker that died, whose pid the OS has since given to another
 * backend (recorded as the call's backend_pid): returns that unrelated session.
 */
async function orphanWithReusedPid(queue: string, id: string): Promise<pg.Client & { pid: number }> {
  const dead = await session();
  assert.equal(await claim(dead, queue), id);
  await kill(dead);
  const unrelated = await session();
  await sql.query('update asyncproc.executions set backend_pid = $2 where id = $1', [id, unrelated.pid]);
  return unrelated;
}

const settle = <T>(promise: Promise<T>) => promise.then((value) => ({ value }), (error: Error) => ({ error }));

describe("recover() and the commit of run() (item 4)", () => {
  const cases = [
    { name: 'a call that succeeded gets no bogus LOST attempt', procedure: 'demo.noop', args: {}, maxAttempts: 1, status: 'SUCCEEDED', history: [] },
    { name: 'a failing call with retries left: recover neither aborts nor leaks a lock', procedure: 'demo.fail', args: { message: 'no' }, maxAttempts: 2, status: 'WAITING', history: ['FAILED'] },
  ];
  for (const c of cases) {
    it(c.name, async () => {
      const x = await submit(c.procedure, c.args, 'lc_commit', c.maxAttempts);
      const y = await submit('demo.noop', {}, 'lc_commit');
      const worker = await session();
      assert.equal(await claim(worker, 'lc_commit'), x.id);
      // hold the next call's row, so run() stops in its claim of y: x's outcome is written, not committed
      const holder = await session();
      await holder.query('begin');
      await holder.query('select 1 from asyncproc.executions where id = $1 for update', [y.id]);
      const running = settle(worker.query(`select * from asyncproc.run($1, $2, 'lc_commit')`, [x.id, `w${worker.pid}`]));
      await blocked(worker.pid, 'run() to wait in its claim of the next call');
      const lockHolder = (await sql.query('select asyncproc.lock_holder($1) as pid', [x.id])).rows[0].pid;
      assert.equal(lockHolder, worker.pid, "the worker let go of the call's lock before its outcome committed");

      // housekeeping on another session, right then
      const housekeeper = await session();
      const recovering = settle(housekeeper.query('select asyncproc.recover() as n'));
      await Promise.race([recovering, blocked(housekeeper.pid, 'recover to finish or wait').catch(() => undefined)]);
      await holder.query('rollback');
      const ran = await running;
      assert.ok(!('error' in ran), `run() failed: ${'error' in ran ? ran.error.message : ''}`);
      const recovered = await recovering;
      assert.ok(!('error' in recovered), `recover() failed: ${'error' in recovered ? recovered.error.message : ''}`);
      assert.equal(recovered.value.rows[0].n, 0, 'recover took a call whose worker is alive');

      assert.equal((await row(x.id)).status, c.status);
      assert.deepEqual(await attempts(x.id), c.history);
      assert.equal(await advisoryLocks(housekeeper.pid), 0, 'recover left an advisory lock on its connection');
      await worker.query(`select * from asyncproc.run($1, $2, null)`, [y.id, `w${worker.pid}`]);
      assert.equal((await row(y.id)).status, 'SUCCEEDED');
    });
  }
});

describe('a cancel between the claim and the run', () => {
  it('stops the call before it starts: the signal found its worker idle, the request is honoured by run()', async () => {
    const x = await submit('lc.record_sleep', { tag: 'between', seconds: 0 }, 'lc_between');
    const worker = await session();
    assert.equal(await claim(worker, 'lc_between'), x.id);
    // the worker is idle between its claim and its run: pg_cancel_backend cancels nothing
    const cancelling = engine.cancelExecution(x.token);
    await waitFor(async () => (await sql.query('select cancel_requested from asyncproc.executions where id = $1', [x.id])).rows[0].cancel_requested, 5_000, 'the cancel to be asked');
    await assert.rejects(worker.query(`select * from asyncproc.run($1, $2, null)`, [x.id, `w${worker.pid}`]), (e: any) => e.code === '57014');
    // what the activator does with a cancelled run
    await worker.query(`select * from asyncproc.abandon($1, '57014', 'canceling statement due to user request')`, [x.id]);
    assert.equal((await cancelling).status, 'CANCELLED');
    assert.equal(await ledger('between'), 0, 'the call never ran');
  });

  it('the same for a non-transactional call: prepare_call() refuses to hand out its statement', async () => {
    await sql.query(`create or replace procedure lc.record_outside(tag text) language plpgsql as $$ begin insert into demo.ledger (tag) values (tag); end $$;
                     select asyncproc.register('lc.record_outside(text)', transactional => false);`);
    const x = await submit('lc.record_outside', { tag: 'between-outside' }, 'lc_between');
    const worker = await session();
    assert.equal(await claim(worker, 'lc_between'), x.id);
    const cancelling = engine.cancelExecution(x.token);
    await waitFor(async () => (await sql.query('select cancel_requested from asyncproc.executions where id = $1', [x.id])).rows[0].cancel_requested, 5_000, 'the cancel to be asked');
    await assert.rejects(worker.query('select * from asyncproc.prepare_call($1, 100)', [x.id]), (e: any) => e.code === '57014');
    // what the activator does with a failed non-transactional call
    await concludeCancelled(worker, x.id);
    assert.equal((await cancelling).status, 'CANCELLED');
    assert.equal(await ledger('between-outside'), 0, 'the call never ran');
  });
});

describe('a cancel whose transaction is still open when the run reads the call', () => {
  // The cancel's signal found the worker idle (between its claim and its run), and the run's
  // read of cancel_requested came before the cancel committed: the run must wait for the
  // cancel's outcome, not start a call it read as not cancelled (a long call then ran to its
  // end, SUCCEEDED, the cancel lost).
  const cases = [
    { name: 'run() waits for it and honours it', tag: 'open-run', transactional: true, batch: false },
    { name: 'prepare_call() waits for it and honours it', tag: 'open-prepare', transactional: false, batch: false },
    { name: "the same for a batch member whose batch's cancel is open", tag: 'open-batch', transactional: true, batch: true },
  ];
  for (const c of cases) {
    it(c.name, async () => {
      const procedure = c.transactional ? 'lc.record_sleep' : 'lc.record_sleep_outside';
      if (!c.transactional) {
        await sql.query(`create or replace procedure lc.record_sleep_outside(tag text, seconds double precision) language plpgsql as $$
                           begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$;
                         select asyncproc.register('lc.record_sleep_outside(text, double precision)', transactional => false);`);
      }
      const call = { procedure, arguments: { tag: c.tag, seconds: 2 }, queue: 'lc_between' };
      const batch = c.batch ? await engine.submitBatch([[call]]) : null;
      const x = batch ? (await sql.query('select id, token from asyncproc.executions where batch_id = $1', [batch.id])).rows[0] : await submit(procedure, call.arguments, 'lc_between');
      const worker = await session();
      assert.equal(await claim(worker, 'lc_between'), x.id);
      const canceller = await session();
      await canceller.query('begin');
      if (batch) {
        const signalled = (await canceller.query('select * from asyncproc.cancel_batch_running($1::uuid) as pid', [batch.id])).rows.map((r) => r.pid);
        assert.deepEqual(signalled, [worker.pid]);
      } else {
        const { outcome, backend_pid } = (await canceller.query('select * from asyncproc.cancel($1::uuid)', [x.token])).rows[0];
        assert.deepEqual({ outcome, backend_pid }, { outcome: 'RUNNING', backend_pid: worker.pid });
      }
      // signalled while idle: nothing was cancelled, the worker's session goes on
      assert.equal((await worker.query('select 1 as one')).rows[0].one, 1);
      const statement = c.transactional ? 'select * from asyncproc.run($1, $2, null)' : 'select * from asyncproc.prepare_call($1, 100)';
      const values = c.transactional ? [x.id, `w${worker.pid}`] : [x.id];
      const reading = settle(worker.query(statement, values));
      await blocked(worker.pid, 'the read of the call to wait for the open cancel');
      await canceller.query('commit');
      const read = await reading;
      assert.ok('error' in read && (read.error as any).code === '57014', `the call was handed out: ${JSON.stringify('value' in read ? read.value.rows : read.error.message)}`);
      if (c.transactional) {
        await worker.query(`select * from asyncproc.abandon($1, '57014', 'canceling statement due to user request')`, [x.id]);
      } else {
        await worker.query('select * from asyncproc.conclude($1, $2, null, false, null, null, null, null, $3, $4, null, null)', [
          x.id, `w${worker.pid}`, '57014', 'canceling statement due to user request',
        ]);
      }
      assert.equal((await row(x.id)).status, 'CANCELLED');
      assert.equal(await ledger(c.tag), 0, 'the call ran');
      if (batch) assert.equal((await engine.getBatch(batch.id))?.status, 'CANCELLED');
    });
  }
});

describe('a cancel that finds the worker of a call run outside a transaction idle before its statement', () => {
  it('is signalled again once the statement runs: the call is stopped, not run to its end', async () => {
    const x = await submit('lc.record_sleep_outside', { tag: 'resignal', seconds: 3 }, 'lc_between');
    const worker = await session();
    assert.equal(await claim(worker, 'lc_between'), x.id);
    // the call's statement handed out: the flag read false, the gate passed
    const prepared = (await worker.query('select statement, arguments::text as arguments from asyncproc.prepare_call($1, 100)', [x.id])).rows[0];
    // the cancel now: its signal finds the worker idle, between that answer and the statement
    const cancelling = engine.cancelExecution(x.token);
    await waitFor(async () => (await sql.query('select cancel_requested from asyncproc.executions where id = $1', [x.id])).rows[0].cancel_requested, 5_000, 'the cancel to be asked');
    assert.equal((await worker.query('select 1 as one')).rows[0].one, 1, 'the first signal cancelled nothing');
    const ran = await settle(worker.query(prepared.statement, [prepared.arguments]));
    assert.ok('error' in ran && (ran.error as any).code === '57014', 'the statement ran to its end');
    await concludeCancelled(worker, x.id);
    assert.equal((await cancelling).status, 'CANCELLED');
    assert.equal(await ledger('resignal'), 0, "the call's writes were rolled back");
  });
});

describe('a cancel that comes as a call outside a transaction ends', () => {
  it('cuts only the record of its end, which the worker sends again as often as it is cut: the call is recorded as it ended, never FAILED for it', async () => {
    await sql.query(`create or replace procedure lc.record_sleep_outside(tag text, seconds double precision) language plpgsql as $$
                       begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$;
                     select asyncproc.register('lc.record_sleep_outside(text, double precision)', transactional => false);`);
    await engine.configureQueue('lc_conclude', 1);
    const x = await submit('lc.record_sleep_outside', { tag: 'conclude-cut', seconds: 0.5 }, 'lc_conclude');
    const holder = await session();
    const activator = await engine.startActivator({ workerId: 'lc-conclude', queues: ['lc_conclude'] });
    try {
      await waitFor(async () => (await row(x.id)).status === 'RUNNING', 10_000, 'the call to run');
      const { backend_pid: pid } = await row(x.id);
      // its row held, as cancel_resignal holds it while it signals: the record of the call's end waits for it
      await holder.query('begin');
      await holder.query('select from asyncproc.executions where id = $1 for no key update', [x.id]);
      let cut: string | null = null;
      for (let signal = 0; signal < 3; signal++) {
        // a conclude() waiting for the row, each time a new one (the last one was cut)
        const waiting = await waitFor(async () => {
          const { rows } = await sql.query(
            `select query_start::text as started from pg_stat_activity where pid = $1 and wait_event_type = 'Lock' and query like '%asyncproc.conclude(%'`,
            [pid],
          );
          return rows[0] && rows[0].started !== cut ? rows[0].started : null;
        }, 10_000, `conclude() to wait for the row (signal ${signal + 1})`);
        cut = waiting;
        await sql.query('select pg_cancel_backend($1)', [pid]);
      }
      await holder.query('commit');
      await waitFor(async () => (await row(x.id)).status !== 'RUNNING', 10_000, 'the call to be recorded');
      assert.deepEqual(await counts(x.id), { status: 'SUCCEEDED', attempts: 1, recoveries: 0 }, 'recorded as it ended');
      assert.equal(await ledger('conclude-cut'), 1, 'ran once');
    } finally {
      await holder.query('rollback').catch(() => undefined);
      await activator.close();
    }
  });
});

describe('a stop with calls running (stopGraceMs)', () => {
  before(async () => {
    await sql.query(`create or replace procedure lc.record_sleep_outside(tag text, seconds double precision) language plpgsql as $$
                       begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$;
                     select asyncproc.register('lc.record_sleep_outside(text, double precision)', transactional => false);`);
  });

  it('waits the grace, then hands the transactional call back (rolled back, PENDING at once, run again once by the next worker); one outside a transaction is waited for', async () => {
    await engine.configureQueue('lc_stop', 2);
    const [inside, outside] = await engine.submit([
      { procedure: 'lc.record_sleep', arguments: { tag: 'stop-inside', seconds: 4 }, queue: 'lc_stop' },
      { procedure: 'lc.record_sleep_outside', arguments: { tag: 'stop-outside', seconds: 1.5 }, queue: 'lc_stop' },
    ]);
    const activator = await engine.startActivator({ workerId: 'lc-stop', queues: ['lc_stop'], stopGraceMs: 300 });
    await waitFor(async () => (await row(inside.id)).status === 'RUNNING' && (await row(outside.id)).status === 'RUNNING', 10_000, 'both to run');
    await activator.close();
    assert.equal((await row(outside.id)).status, 'SUCCEEDED', 'the call outside a transaction was waited for');
    assert.equal(await ledger('stop-outside'), 1);
    const handedBack = await row(inside.id);
    assert.equal(handedBack.status, 'PENDING', 'the transactional call went back to its queue');
    assert.equal(await ledger('stop-inside'), 0, 'its writes rolled back');
    assert.equal(Number((await sql.query('select count(*) from asyncproc.ready where id = $1', [inside.id])).rows[0].count), 1, 'ready for the next worker');
    const next = await engine.startActivator({ workerId: 'lc-stop-next', queues: ['lc_stop'] });
    try {
      await waitFor(async () => (await row(inside.id)).status === 'SUCCEEDED', 15_000, 'the next worker to run it');
    } finally {
      await next.close();
    }
    assert.equal(await ledger('stop-inside'), 1, 'once');
  });

  it('a call the ending statement claimed before the stop is given back unstarted (one outside a transaction is never started while stopping)', async () => {
    await engine.configureQueue('lc_given', 1);
    const [first, claimedNext] = await engine.submit([
      { procedure: 'lc.record_sleep', arguments: { tag: 'given-first', seconds: 1 }, queue: 'lc_given' },
      { procedure: 'lc.record_sleep_outside', arguments: { tag: 'given-next', seconds: 0 }, queue: 'lc_given' },
    ]);
    const activator = await engine.startActivator({ workerId: 'lc-given', queues: ['lc_given'], stopGraceMs: 30_000 });
    // run() is on its way, asked to claim the queue's next call as it ends (the stop comes after)
    await runsOnTheirWay('lc-given');
    await activator.close();
    assert.equal((await row(first.id)).status, 'SUCCEEDED', 'the running call was waited for (within the grace)');
    assert.deepEqual(await counts(claimedNext.id), { status: 'PENDING', attempts: 0, recoveries: 0 }, 'given back: not started, not an attempt, not an interruption');
    assert.equal(await ledger('given-next'), 0, 'not started while stopping');
    assert.equal(Number((await sql.query('select count(*) from asyncproc.ready where id = $1', [claimedNext.id])).rows[0].count), 1, 'ready for the next worker');
    const next = await engine.startActivator({ workerId: 'lc-given-next', queues: ['lc_given'] });
    try {
      await waitFor(async () => (await row(claimedNext.id)).status === 'SUCCEEDED', 15_000, 'the next worker to run it');
    } finally {
      await next.close();
    }
    assert.equal(await ledger('given-next'), 1, 'once');
  });

  it("a hand-back signal sent late (the pool busy) as the call ends never reaches the call its slot claimed next", async () => {
    // the service's pool has one connection, held while the grace ends: the stop's cancel of the
    // first call waits for it, and is sent a second after that call ended, when its run() has
    // claimed the next one, outside a transaction, which would be cut after starting
    await engine.configureQueue('lc_late', 1);
    const late = createPostgresEngine({ connectionString: url, poolSize: 1 });
    const [first, claimedNext] = await late.submit([
      { procedure: 'lc.record_sleep', arguments: { tag: 'late-first', seconds: 1 }, queue: 'lc_late' },
      { procedure: 'lc.record_sleep_outside', arguments: { tag: 'late-next', seconds: 2 }, queue: 'lc_late', maxAttempts: 1 },
    ]);
    const activator = await late.startActivator({ workerId: 'lc-late', queues: ['lc_late'], stopGraceMs: 300 });
    try {
      await runsOnTheirWay('lc-late');
      const held = late.pool.query('select pg_sleep(2)');
      await activator.close();
      await held;
    } finally {
      await late.close();
    }
    assert.equal((await row(first.id)).status, 'SUCCEEDED', 'the first call ended before the signal went');
    assert.equal(await ledger('late-first'), 1);
    const next = await engine.startActivator({ workerId: 'lc-late-next', queues: ['lc_late'] });
    try {
      await waitFor(async () => ['SUCCEEDED', 'FAILED'].includes((await row(claimedNext.id)).status), 15_000, 'the next call to end');
    } finally {
      await next.close();
    }
    assert.deepEqual(await counts(claimedNext.id), { status: 'SUCCEEDED', attempts: 1, recoveries: 0 }, 'not cut by a signal meant for the call before it');
    assert.equal(await ledger('late-next'), 1, 'once');
  });

  it('a call handed back by six stops in a row (six rolling restarts) is PENDING each time, and then runs once', async () => {
    await engine.configureQueue('lc_restarts', 1);
    const [call] = await engine.submit([{ procedure: 'lc.record_sleep', arguments: { tag: 'restarts', seconds: 3 }, queue: 'lc_restarts' }]);
    for (let stop = 1; stop <= 6; stop++) {
      const activator = await engine.startActivator({ workerId: `lc-restart-${stop}`, queues: ['lc_restarts'], stopGraceMs: 100 });
      await waitFor(async () => (await row(call.id)).status === 'RUNNING', 10_000, `run ${stop}`);
      await activator.close();
      assert.deepEqual(await counts(call.id), { status: 'PENDING', attempts: 0, recoveries: 0 }, `after stop ${stop}`);
    }
    assert.equal(await ledger('restarts'), 0);
    const last = await engine.startActivator({ workerId: 'lc-restart-last', queues: ['lc_restarts'] });
    try {
      await waitFor(async () => (await row(call.id)).status === 'SUCCEEDED', 15_000, 'the last run');
    } finally {
      await last.close();
    }
    assert.equal(await ledger('restarts'), 1, 'once');
  });
});

describe('a lowered concurrency', () => {
  it('a slot over the new limit starts nothing more: the call its ending statement claimed is given back unstarted', async () => {
    await engine.configureQueue('lc_lower', 2);
    const first = await engine.submit([
      { procedure: 'lc.record_sleep', arguments: { tag: 'lower-first-0', seconds: 1.5 }, queue: 'lc_lower' },
      { procedure: 'lc.record_sleep', arguments: { tag: 'lower-first-1', seconds: 1.5 }, queue: 'lc_lower' },
    ]);
    const activator = await engine.startActivator({ workerId: 'lc-lower', queues: ['lc_lower'] });
    try {
      // both run() statements are on their way, each asked to claim the queue's next call as it ends
      await runsOnTheirWay('lc-lower', 2);
      const next = await engine.submit([
        { procedure: 'lc.record_sleep', arguments: { tag: 'lower-next-0', seconds: 0.5 }, queue: 'lc_lower' },
        { procedure: 'lc.record_sleep', arguments: { tag: 'lower-next-1', seconds: 0.5 }, queue: 'lc_lower' },
      ]);
      await engine.configureQueue('lc_lower', 1);
      await waitFor(async () => (await sql.query(`select 1 from asyncproc.executions where id = any($1::bigint[]) and status <> 'SUCCEEDED'`, [[...first, ...next].map((c) => c.id)])).rowCount === 0, 20_000, 'every call to end');
      // the first two were running when the limit fell (they end, as documented); the next two start after it: one at a time
      const { rows } = await sql.query<{ started: Date; finished: Date }>(
        `select started_at as started, finished_at as finished from asyncproc.executions where id = any($1::bigint[]) order by started_at`,
        [next.map((c) => c.id)],
      );
      assert.ok(rows[1].started >= rows[0].finished, `the next calls ran at once against a limit of 1: ${JSON.stringify(rows)}`);
      assert.equal(await ledger('lower-next-0') + (await ledger('lower-next-1')), 2, 'each once');
    } finally {
      await activator.close();
      await engine.configureQueue('lc_lower', 1);
    }
  });
});

describe('only the session that claimed a call ends it (item 5)', () => {
  it('a worker that lost its lock cannot run, finish or abandon the new run of its call', async () => {
    const x = await submit('lc.record_sleep', { tag: 'owner', seconds: 0 }, 'lc_owner');
    const stale = await session();
    assert.equal(await claim(stale, 'lc_owner'), x.id);
    // the lock is lost while the session lives (a procedure may call pg_advisory_unlock_all)
    await stale.query('select pg_advisory_unlock_all()');
    await sql.query('select asyncproc.recover()');
    const fresh = await session();
    assert.equal(await claim(fresh, 'lc_owner'), x.id);

    await stale.query(`select * from asyncproc.abandon($1, '57014', 'canceling statement due to user request')`, [x.id]);
    assert.deepEqual(await row(x.id), { status: 'RUNNING', backend_pid: fresh.pid, attempts: 1, recoveries: 1 }, 'abandon() changed the new run');
    await stale.query(`select * from asyncproc.finish($1, true, '{}')`, [x.id]);
    assert.equal((await row(x.id)).status, 'RUNNING', 'finish() ended the new run');
    await stale.query(`select * from asyncproc.run($1, 'stale', null)`, [x.id]);
    assert.equal(await ledger('owner'), 0, 'the stale worker ran the call a second time');
    assert.equal((await row(x.id)).status, 'RUNNING');

    await fresh.query(`select * from asyncproc.run($1, 'fresh', null)`, [x.id]);
    assert.equal((await row(x.id)).status, 'SUCCEEDED');
    assert.equal(await ledger('owner'), 1);
  });
});

describe('cancel and the lock holder (item 9)', () => {
  it("never signals a dead worker's pid, now an unrelated backend's", async () => {
    const x = await submit('demo.noop', {}, 'lc_cancel');
    const unrelated = await orphanWithReusedPid('lc_cancel', x.id);
    const sleeping = settle(unrelated.query('select pg_sleep(1.5)'));
    await engine.cancelExecution(x.token);
    const slept = await sleeping;
    assert.ok(!('error' in slept), `an unrelated backend's statement was cancelled: ${'error' in slept ? slept.error.message : ''}`);
    // nobody runs it: recover ends it as asked
    await sql.query('select asyncproc.recover()');
    assert.equal((await row(x.id)).status, 'CANCELLED');
  });

  it('recover ends a call whose cancel was requested CANCELLED, never runs it again', async () => {
    const x = await submit('demo.noop', {}, 'lc_cancel');
    const worker = await session();
    assert.equal(await claim(worker, 'lc_cancel'), x.id);
    const { rows } = await sql.query('select outcome, backend_pid from asyncproc.cancel($1)', [x.token]);
    assert.deepEqual(rows[0], { outcome: 'RUNNING', backend_pid: worker.pid }, 'the holder of the lock is the one to signal');
    await kill(worker); // the worker dies before the signal lands
    await sql.query('select asyncproc.recover()');
    assert.equal((await row(x.id)).status, 'CANCELLED');
    assert.equal((await sql.query('select count(*) from asyncproc.ready where id = $1', [x.id])).rows[0].count, '0');
  });

  it("cancelBatch signals no dead worker's pid either", async () => {
    const batch = await engine.submitBatch([[{ procedure: 'demo.noop', arguments: {}, queue: 'lc_cancel' }]]);
    const [member] = await engine.getBatchExecutions(batch.id);
    await orphanWithReusedPid('lc_cancel', member.id);
    const { rows } = await sql.query('select pid from asyncproc.cancel_batch_running($1) pid', [batch.id]);
    assert.deepEqual(rows, []);
  });
});

describe('lock keys (item 10)', () => {
  it('calls whose ids differ by 2^31 - 1 do not block each other', async () => {
    await sql.query('alter table asyncproc.executions alter column id restart with 10000000000');
    const x = await submit('demo.noop', {}, 'lc_keys');
    await sql.query(`alter table asyncproc.executions alter column id restart with ${10000000000 + 2147483647}`);
    const y = await submit('demo.noop', {}, 'lc_keys');
    assert.equal(BigInt(y.id) - BigInt(x.id), 2147483647n);
    const first = await session();
    assert.equal(await claim(first, 'lc_keys'), x.id);
    const second = await session();
    await second.query(`set lock_timeout = '2s'`);
    assert.equal(await claim(second, 'lc_keys'), y.id);
    const holders = await sql.query('select asyncproc.lock_holder($1) x, asyncproc.lock_holder($2) y', [x.id, y.id]);
    assert.deepEqual(holders.rows[0], { x: first.pid, y: second.pid });
    for (const [worker, id] of [[first, x.id], [second, y.id]] as const) await worker.query('select * from asyncproc.run($1, $2, null)', [id, 'w']);
    assert.deepEqual([(await row(x.id)).status, (await row(y.id)).status], ['SUCCEEDED', 'SUCCEEDED']);
  });
});

describe('timeouts (item 6)', () => {
  let activator: Closeable;
  before(async () => {
    await sql.query(`create procedure lc.timed(tag text, seconds double precision) language plpgsql as $$
      begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$`);
    await engine.configureQueue('lc_timeout', 2);
    await engine.registerProcedure('lc.timed', { queue: 'lc_timeout', timeoutMs: 500 });
    await engine.registerProcedure('lc.session', { queue: 'lc_timeout' });
    activator = await engine.startActivator({ workerId: 'lc-timeouts', queues: ['lc_timeout'] });
  });
  after(() => activator?.close());

  it("a procedure's timeoutMs ends a longer call as a failed attempt, retried like any failure", async () => {
    const [slow, quick] = await engine.submit([
      { procedure: 'lc.timed', arguments: { tag: 'timed-out', seconds: 3 }, maxAttempts: 2 },
      { procedure: 'lc.timed', arguments: { tag: 'in-time', seconds: 0.05 } },
    ]);
    const [timedOut, inTime] = await finished([slow.token, quick.token], 20_000);
    assert.equal(inTime.status, 'SUCCEEDED');
    assert.equal(timedOut.status, 'FAILED');
    assert.equal(timedOut.attempts, 2);
    assert.equal(timedOut.error?.number, '57014');
    assert.deepEqual(await attempts(slow.id), ['FAILED']);
    assert.equal(await ledger('timed-out'), 0, "a timed-out call's writes are rolled back");
    assert.equal(await ledger('in-time'), 1);
  });

  it('a call cancelled while it runs keeps that run in its history, as its last attempt (CANCELLED)', async () => {
    const [call] = await engine.submit([{ procedure: 'demo.sleep', arguments: { seconds: 5 }, queue: 'lc_timeout', maxAttempts: 2 }]);
    await waitFor(async () => (await engine.getExecution(call.token))?.status === 'RUNNING', 10_000, 'the call to start');
    const cancelled = await engine.cancelExecution(call.token);
    const ended = await waitFor(async () => {
      const e = await engine.getExecution(call.token);
      return e?.status === 'CANCELLED' ? e : null;
    }, 10_000, 'the call to end CANCELLED');
    assert.ok(cancelled);
    const history = (await engine.getHistory([call.id])).get(call.id)!;
    assert.deepEqual(history.map((a) => [a.number, a.status]), [[ended.attempts, 'CANCELLED']]);
    assert.ok(history[0].startedAt && history[0].finishedAt, 'when it ran and when it was stopped');
  });

  it('a stray cancel under a timeout is not taken for the timeout: the call goes back to its queue', async () => {
    const [call] = await engine.submit([{ procedure: 'lc.timed', arguments: { tag: 'stray', seconds: 0.3 } }]);
    const { backend_pid: pid } = await waitFor(async () => {
      const r = await row(call.id);
      return r.status === 'RUNNING' ? r : null;
    }, 10_000, 'the call to start');
    await sql.query('select pg_cancel_backend($1)', [pid]); // meant for the call before it, say
    const [ended] = await finished([call.token]);
    assert.equal(ended.status, 'SUCCEEDED');
    assert.equal((await row(call.id)).recoveries, 1);
    assert.equal(await ledger('stray'), 1);
  });

  it('a call without a timeout runs with none, whatever the previous call on the session armed', async () => {
    const [timed] = await engine.submit([{ procedure: 'lc.timed', arguments: { tag: 'arm', seconds: 0 } }]);
    const [untimed] = await engine.submit([{ procedure: 'lc.session', arguments: {} }]);
    const [, settings] = await finished([timed.token, untimed.token]);
    assert.equal((settings.result?.returnValue as Record<string, string>).statement_timeout, '0');
  });
});

/** Wait until every token has ended; their executions, in order. */
const finished = (tokens: string[], timeoutMs = 15_000) =>
  waitFor(
    async () => {
      const rows = await engine.getExecutions(tokens);
      const ended = rows.every((r) => ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(r.status));
      return ended ? tokens.map((token) => rows.find((r) => r.token === token)!) : null;
    },
    timeoutMs,
    'every execution to end',
  );

describe("the server's defaults do not reach the engine's sessions (items 6, 7, 8)", () => {
  for (const isolation of ['repeatable read', 'serializable']) {
    it(`default_transaction_isolation = '${isolation}', statement_timeout = 300ms: batches settle, calls run once, in full`, async () => {
      const name = `lc_${isolation.replace(' ', '_')}`;
      const dbUrl = await cluster.createDatabase(name);
      const setup = createPostgresEngine({ connectionString: dbUrl });
      await setup.migrate();
      await setup.installDemo();
      await setup.pool.query(SCHEMA);
      await setup.configureQueue('default', 4);
      await setup.pool.query(`alter database ${name} set default_transaction_isolation = '${isolation}'`);
      await setup.pool.query(`alter database ${name} set statement_timeout = '300ms'`);
      await setup.close();

      const defaulted = createPostgresEngine({ connectionString: dbUrl });
      const activator = await defaulted.startActivator({ workerId: 'lc-defaults' });
      try {
        const sleep = (tag: string, seconds: number) => ({ procedure: 'lc.record_sleep', arguments: { tag, seconds } });
        const batch = await defaulted.submitBatch([
          [sleep('stage-1', 0.1), sleep('stage-1', 0.1), sleep('stage-1', 0.1), sleep('stage-1', 0.1)],
          [sleep('stage-2', 0.1), sleep('stage-2', 0.1), { procedure: 'lc.session', arguments: {} }],
        ]);
        // longer than the server's statement_timeout, and allowed one attempt
        const [long] = await defaulted.submit([{ ...sleep('long', 1), maxAttempts: 1 }]);
        const ended = await waitFor(async () => {
          const b = await defaulted.getBatch(batch.id);
          return b && b.status !== 'RUNNING' ? b : null;
        }, 30_000, 'the batch to end');
        assert.equal(ended.status, 'SUCCEEDED');
        const members = await defaulted.getBatchExecutions(batch.id);
        assert.deepEqual(members.map((m) => m.status), members.map(() => 'SUCCEEDED'));
        const longRun = await waitFor(async () => {
          const [e] = await defaulted.getExecutions([long.token]);
          return ['SUCCEEDED', 'FAILED'].includes(e.status) ? e : null;
        }, 30_000, 'the long call to end');
        assert.equal(longRun.status, 'SUCCEEDED', `${longRun.error?.number} ${longRun.error?.message}`);
        const counts = await defaulted.pool.query(`select tag, count(*)::int as n from demo.ledger group by tag order by tag`);
        assert.deepEqual(counts.rows, [{ tag: 'long', n: 1 }, { tag: 'stage-1', n: 4 }, { tag: 'stage-2', n: 2 }]);

        // a worker session, seen from inside a call, and a pool session
        const worker = members.find((m) => m.procedure === 'lc.session')!.result?.returnValue;
        assert.deepEqual(worker, {
          transaction_isolation: 'read committed',
          statement_timeout: '0',
          tcp_keepalives_idle: '10',
          tcp_keepalives_interval: '5',
          tcp_keepalives_count: '3',
        });
        const pool = (await defaulted.pool.query(`select current_setting('transaction_isolation') as iso, current_setting('tcp_keepalives_idle') as idle`)).rows[0];
        assert.deepEqual(pool, { iso: 'read committed', idle: '10' });
        // nothing SUCCEEDED was rewritten later (40001 on a settle, a bogus retry)
        await new Promise((resolve) => setTimeout(resolve, 1500));
        assert.deepEqual((await defaulted.getBatchExecutions(batch.id)).map((m) => m.status), members.map(() => 'SUCCEEDED'));
      } finally {
        await activator.close();
        await defaulted.close();
      }
    });
  }
});

describe('connection settings (items 7, 8)', () => {
  it("every connection gets them, after any options the URL carries", async () => {
    const withOptions = `${url}?options=${encodeURIComponent('-c search_path=demo,public')}`;
    const client = new pg.Client(connectionConfig(withOptions));
    await client.connect();
    try {
      const { rows } = await client.query(`select current_setting('search_path') as path, current_setting('default_transaction_isolation') as iso,
        current_setting('tcp_keepalives_count') as count`);
      assert.deepEqual(rows[0], { path: 'demo,public', iso: 'read committed', count: '3' });
    } finally {
      await client.end();
    }
  });
});
