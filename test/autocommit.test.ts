/**
 * Non-transactional calls on PostgreSQL (asyncproc.register(..., transactional => false)):
 * the worker sends the call at top level, with no transaction open, so a procedure may
 * COMMIT; the outcome is recorded afterwards (asyncproc.conclude) by the session that holds
 * the call's lock. Results and errors read as in the transactional mode; a timeout or a
 * failure is retried per max_attempts (re-running what the failed attempt committed); a
 * cancel ends it CANCELLED; a run whose worker is lost ends FAILED (AP008), never re-run.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import type { Closeable, Execution } from '../src/engine.js';
import type { PostgresEngine } from '../src/engines/postgres/index.js';
import { sleep, startDemoDatabase, waitFor, type TestCluster } from './support/database.js';

let cluster: TestCluster;
let url: string;
let engine: PostgresEngine;
let sql: pg.Client;
let activator: Closeable;
const sessions: pg.Client[] = [];

/** Each routine twice: `_tx` registered as before, `_ac` with transactional => false. */
const BOTH_MODES = `
  create procedure ac.commit_between_MODE(tag text) language plpgsql as $$
  begin
    insert into ac.log (tag, n) values (tag, 1);
    commit;
    insert into ac.log (tag, n) values (tag, 2);
  end $$;
  create procedure ac.outputs_MODE(a integer, inout b numeric, out c text, out d timestamptz, out big bigint,
                                  out arr integer[], out j jsonb, out nothing text)
  language plpgsql as $$
  begin
    b := b * 2; c := 'c' || a; d := '2024-03-01 12:34:56.789+00'; big := 9007199254740993;
    arr := array[a, null, 3]; j := jsonb_build_object('n', 1.50, 'deep', array[1, 2]);
  end $$;
  create function ac.rows_MODE(n integer) returns table (i integer, label text, at date, amount numeric) language sql as $$
    select g, 'row ' || g, date '2024-01-01' + g, g * 1.25 from generate_series(1, n) g $$;
  create function ac.scalar_MODE(x numeric) returns numeric language sql as $$ select x * 3 $$;
  create function ac.pair_MODE(x integer, out doubled integer, out label text) language sql as $$ select x * 2, 'x' || x $$;
  create procedure ac.fail_MODE(message text) language plpgsql as $$
  begin
    raise exception 'failed: %', message using detail = 'the detail', errcode = 'P0042';
  end $$;
  select asyncproc.register('ac.commit_between_MODE', transactional => TRANSACTIONAL);
  select asyncproc.register('ac.outputs_MODE', transactional => TRANSACTIONAL);
  select asyncproc.register('ac.rows_MODE', transactional => TRANSACTIONAL);
  select asyncproc.register('ac.scalar_MODE', transactional => TRANSACTIONAL);
  select asyncproc.register('ac.pair_MODE', transactional => TRANSACTIONAL);
  select asyncproc.register('ac.fail_MODE', transactional => TRANSACTIONAL);`;

const SCHEMA = `create schema ac;
  create table ac.log (tag text not null, n integer, xid xid8 not null default pg_current_xact_id());
  create table ac.starts (tag text not null);
  ${BOTH_MODES.replaceAll('MODE', 'tx').replaceAll('TRANSACTIONAL', 'true')}
  ${BOTH_MODES.replaceAll('MODE', 'ac').replaceAll('TRANSACTIONAL', 'false')}
  -- commits a start row, then sleeps: what a killed, cancelled or timed-out run leaves behind
  create procedure ac.sleeper(tag text, seconds double precision) language plpgsql as $$
  begin
    insert into ac.starts (tag) values (tag);
    commit;
    perform pg_sleep(seconds);
    insert into ac.log (tag, n) values (tag, 1);
  end $$;
  -- a purge in chunks, each committed on its own; fails once after chunk fail_at on its first attempt
  create procedure ac.chunks(tag text, chunks integer, fail_at integer default null) language plpgsql as $$
  declare first_attempt boolean;
  begin
    insert into ac.starts (tag) values (tag);
    commit;
    first_attempt := (select count(*) = 1 from ac.starts s where s.tag = chunks.tag);
    for i in 1..chunks loop
      insert into ac.log (tag, n) values (tag, i);
      commit;
      if i = fail_at and first_attempt then
        raise exception 'chunk % failed', i;
      end if;
    end loop;
  end $$;
  select asyncproc.register('ac.sleeper', transactional => false);
  select asyncproc.register('ac.chunks', transactional => false);`;

before(async () => {
  ({ cluster, url, engine, sql } = await startDemoDatabase());
  await sql.query(SCHEMA);
  await engine.configureQueue('default', 2);
  await engine.configureQueue('ac_hand', 1); // served by hand-made sessions only
  await engine.configureQueue('ac_one', 1);
  activator = await engine.startActivator({ workerId: 'ac', queues: ['default', 'ac_one'], maxRows: 100 });
});
after(async () => {
  await activator?.close();
  await Promise.all(sessions.map((s) => s.end().catch(() => undefined)));
  await sql?.end();
  await engine?.close();
  await cluster?.stop();
});

async function submit(procedure: string, args: Record<string, unknown>, options: { maxAttempts?: number; queue?: string } = {}): Promise<Execution> {
  return (await engine.submit([{ procedure, arguments: args, ...options }]))[0];
}

/** Wait until every token has ended; their executions, in order. */
const finished = (tokens: string[], timeoutMs = 20_000) =>
  waitFor(
    async () => {
      const rows = await engine.getExecutions(tokens);
      return rows.every((r) => ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(r.status)) ? tokens.map((t) => rows.find((r) => r.token === t)!) : null;
    },
    timeoutMs,
    'every execution to end',
  );
const running = (token: string) =>
  waitFor(async () => {
    const e = await engine.getExecution(token);
    return e?.status === 'RUNNING' ? e : null;
  }, 10_000, 'the call to start');
const log = async (tag: string) => (await sql.query('select n from ac.log where tag = $1 order by xid, n', [tag])).rows.map((r) => r.n);
const starts = async (tag: string) => Number((await sql.query('select count(*) from ac.starts where tag = $1', [tag])).rows[0].count);
const history = async (id: string) =>
  (await sql.query('select status, error_number from asyncproc.attempts where execution_id = $1 order by number', [id])).rows;
const row = async (id: string) =>
  (await sql.query('select status, attempts, error_number, backend_pid, transactional from asyncproc.executions where id = $1', [id])).rows[0];

async function session(): Promise<pg.Client & { pid: number }> {
  const client = (await cluster.connect(url)) as pg.Client & { pid: number };
  client.pid = (await client.query('select pg_backend_pid() as pid')).rows[0].pid;
  sessions.push(client);
  return client;
}

describe('registration', () => {
  it('asyncproc.register(..., transactional => false) is kept, listed, and changed by a new registration', async () => {
    const procedures = await engine.listProcedures();
    const [ac, tx] = ['ac.commit_between_ac', 'ac.commit_between_tx'].map((name) => procedures.find((p) => p.name === name)!);
    assert.equal(ac.transactional, false);
    assert.equal(tx.transactional, true);
    await sql.query(`create procedure ac.re_registered() language plpgsql as $$ begin end $$`);
    assert.equal((await engine.registerProcedure('ac.re_registered', { transactional: false })).transactional, false);
    assert.equal((await engine.registerProcedure('ac.re_registered', {})).transactional, true, 'the default is transactional');
    // by position, the older parameters keep their meaning
    await sql.query(`select asyncproc.register('ac.re_registered()'::regprocedure, 'default', 3, 1000, '{}', false)`);
    const again = (await engine.listProcedures()).find((p) => p.name === 'ac.re_registered')!;
    assert.deepEqual([again.maxAttempts, again.timeoutMs, again.transactional], [3, 1000, false]);
  });
});

describe('a procedure that COMMITs inside', () => {
  it('runs registered transactional => false: both inserts, in two transactions', async () => {
    const x = await submit('ac.commit_between_ac', { tag: 'commit-ac' });
    const [done] = await finished([x.token]);
    assert.equal(done.status, 'SUCCEEDED', `${done.error?.number} ${done.error?.message}`);
    assert.deepEqual(await log('commit-ac'), [1, 2]);
    const xids = await sql.query(`select count(distinct xid)::int as n from ac.log where tag = 'commit-ac'`);
    assert.equal(xids.rows[0].n, 2, 'the COMMIT inside ended a transaction');
    assert.equal((await row(x.id)).transactional, false, 'the claim records how the call ran');
  });

  it('fails with 2D000 when transactional, and leaves nothing', async () => {
    const x = await submit('ac.commit_between_tx', { tag: 'commit-tx' });
    const [done] = await finished([x.token]);
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error?.number, '2D000');
    assert.deepEqual(await log('commit-tx'), []);
  });

  it('commits in chunks: each chunk is its own transaction', async () => {
    const x = await submit('ac.chunks', { tag: 'chunks', chunks: 4 });
    const [done] = await finished([x.token]);
    assert.equal(done.status, 'SUCCEEDED', `${done.error?.number} ${done.error?.message}`);
    assert.deepEqual(await log('chunks'), [1, 2, 3, 4]);
    assert.equal((await sql.query(`select count(distinct xid)::int as n from ac.log where tag = 'chunks'`)).rows[0].n, 4);
  });

  it('a failure after chunks committed is retried per max_attempts, and the retry runs those chunks again', async () => {
    const x = await submit('ac.chunks', { tag: 'chunks-retry', chunks: 3, fail_at: 2 }, { maxAttempts: 2 });
    const [done] = await finished([x.token], 30_000);
    assert.equal(done.status, 'SUCCEEDED', `${done.error?.number} ${done.error?.message}`);
    assert.equal(done.attempts, 2);
    // what the failed attempt committed stays: the given-up guarantee, documented in RegisterOptions.transactional
    assert.deepEqual(await log('chunks-retry'), [1, 2, 1, 2, 3]);
    assert.deepEqual(await history(x.id), [{ status: 'FAILED', error_number: 'P0001' }]);
  });
});

describe('results and errors read as in the transactional mode', () => {
  const cases: [string, Record<string, unknown>][] = [
    ['outputs', { a: 7, b: '12345678901234567890.125' }],
    ['rows', { n: 150 }],
    ['rows', { n: 3 }],
    ['scalar', { x: '0.1' }],
    ['pair', { x: 21 }],
  ];
  for (const [routine, args] of cases) {
    it(`${routine}(${JSON.stringify(args)})`, async () => {
      const [tx, ac] = await engine.submit([
        { procedure: `ac.${routine}_tx`, arguments: args },
        { procedure: `ac.${routine}_ac`, arguments: args },
      ]);
      const [txDone, acDone] = await finished([tx.token, ac.token]);
      assert.equal(txDone.status, 'SUCCEEDED', `${txDone.error?.number} ${txDone.error?.message}`);
      assert.equal(acDone.status, 'SUCCEEDED', `${acDone.error?.number} ${acDone.error?.message}`);
      assert.deepEqual(acDone.result, txDone.result);
      // and the stored JSON itself, number for number
      const stored = await sql.query('select id, result from asyncproc.executions where id = any($1) order by id', [[tx.id, ac.id]]);
      assert.deepEqual(stored.rows[1].result, stored.rows[0].result);
    });
  }

  it('the rows of a function are capped (maxRows) and counted', async () => {
    const x = await submit('ac.rows_ac', { n: 150 });
    const [done] = await finished([x.token]);
    assert.equal(done.result?.rows?.length, 100);
    assert.equal(done.result?.rowCount, 150);
    assert.equal(done.result?.truncated, true);
  });

  it('OUT parameters keep their types (a bigint beyond 2^53, a numeric, a timestamp, an array, jsonb)', async () => {
    const x = await submit('ac.outputs_ac', { a: 7, b: '12345678901234567890.125' });
    const [done] = await finished([x.token]);
    const stored = (await sql.query(`select result->'outputParameters' as o from asyncproc.executions where id = $1`, [x.id])).rows[0].o;
    const text = (await sql.query(`select (result->'outputParameters')::text as t from asyncproc.executions where id = $1`, [x.id])).rows[0].t;
    assert.match(text, /"big": 9007199254740993\b/);
    assert.match(text, /"b": 24691357802469135780\.250\b/);
    assert.equal(stored.c, 'c7');
    assert.equal(stored.d, '2024-03-01T12:34:56.789+00:00');
    assert.deepEqual(stored.arr, [7, null, 3]);
    assert.deepEqual(stored.j, { n: 1.5, deep: [1, 2] });
    assert.equal(stored.nothing, null);
  });

  it('an error: SQLSTATE, message, detail and line as in the transactional mode', async () => {
    const [tx, ac] = await engine.submit([
      { procedure: 'ac.fail_tx', arguments: { message: 'no' } },
      { procedure: 'ac.fail_ac', arguments: { message: 'no' } },
    ]);
    const [txDone, acDone] = await finished([tx.token, ac.token]);
    assert.equal(acDone.status, 'FAILED');
    const pick = (e: Execution) => ({ number: e.error?.number, message: e.error?.message, detail: e.error?.detail, line: e.error?.line });
    assert.deepEqual(pick(acDone), pick(txDone));
    assert.deepEqual(pick(acDone), { number: 'P0042', message: 'failed: no: the detail', detail: 'the detail', line: 3 });
    assert.match(acDone.error?.context ?? '', /^PL\/pgSQL function ac\.fail_ac\(text\) line 3 at RAISE/);
  });
});

describe('timeout and cancel', () => {
  before(async () => {
    await sql.query(`create procedure ac.timed(tag text, seconds double precision) language plpgsql as $$
      begin insert into ac.starts (tag) values (tag); commit; perform pg_sleep(seconds); end $$;
      select asyncproc.register('ac.timed', timeout_ms => 400, transactional => false)`);
  });

  it('timeoutMs ends a longer call FAILED with 57014 after max_attempts, and no attempt more', async () => {
    const x = await submit('ac.timed', { tag: 'timed', seconds: 5 }, { maxAttempts: 2 });
    const [done] = await finished([x.token], 30_000);
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error?.number, '57014');
    assert.match(done.error?.message ?? '', /timeout 400 ms/);
    assert.equal(done.attempts, 2);
    assert.deepEqual(await history(x.id), [{ status: 'FAILED', error_number: '57014' }]);
    await sleep(1500);
    assert.equal(await starts('timed'), 2, 'each attempt committed its start; none ran after the last');
  });

  it('a call without a timeout runs with none after a timed one on the same worker', async () => {
    const [timed, untimed] = await engine.submit([
      { procedure: 'ac.timed', arguments: { tag: 'arm', seconds: 0 }, queue: 'ac_one' },
      { procedure: 'ac.sleeper', arguments: { tag: 'unarmed', seconds: 0.8 }, queue: 'ac_one' },
    ]);
    const [t, u] = await finished([timed.token, untimed.token]);
    assert.equal(t.status, 'SUCCEEDED');
    assert.equal(u.status, 'SUCCEEDED', `${u.error?.number} ${u.error?.message}`);
  });

  it('cancelExecution ends a running call CANCELLED; what it committed stays, nothing after', async () => {
    const x = await submit('ac.sleeper', { tag: 'cancelled', seconds: 10 }, { maxAttempts: 3 });
    await running(x.token);
    await waitFor(async () => (await starts('cancelled')) === 1, 10_000, 'the call to commit its start');
    await engine.cancelExecution(x.token);
    const [done] = await finished([x.token]);
    assert.equal(done.status, 'CANCELLED');
    assert.equal(done.error?.number, '57014');
    assert.equal(done.attempts, 1);
    assert.deepEqual(await log('cancelled'), []);
    assert.equal(await starts('cancelled'), 1);
  });
});

describe('a worker lost mid-call', () => {
  it('pg_terminate_backend of its session: FAILED with AP008 exactly once, never run again', async () => {
    const x = await submit('ac.sleeper', { tag: 'killed', seconds: 10 }, { maxAttempts: 3 });
    await running(x.token);
    await waitFor(async () => (await starts('killed')) === 1, 10_000, 'the call to commit its start');
    const { backend_pid: pid } = await row(x.id);
    await sql.query('select pg_terminate_backend($1)', [pid]);
    const [done] = await finished([x.token]);
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error?.number, 'AP008');
    assert.match(done.error?.message ?? '', /worker lost during a non-transactional call; its effects may be partly done/);
    assert.equal(done.attempts, 1);
    // a few housekeeping ticks later: still one start, still FAILED, nothing queued
    await sleep(2500);
    assert.equal(await starts('killed'), 1);
    assert.equal((await row(x.id)).status, 'FAILED');
    assert.equal((await sql.query('select count(*)::int as n from asyncproc.ready where id = $1', [x.id])).rows[0].n, 0);
    const events = await sql.query(`select count(*)::int as n from asyncproc.executions where id = $1 and status = 'FAILED'`, [x.id]);
    assert.equal(events.rows[0].n, 1);
  });

  it('a session that claimed it and died before sending it: FAILED (AP008), not run', async () => {
    const x = await submit('ac.sleeper', { tag: 'claimed-only', seconds: 0 }, { queue: 'ac_hand', maxAttempts: 3 });
    const worker = await session();
    assert.equal((await worker.query(`select id, transactional from asyncproc.claim('ac_hand', 'hand')`)).rows[0].transactional, false);
    await worker.end();
    // recover (ours, or the activator's tick) takes the lost call
    await waitFor(async () => (await sql.query('select asyncproc.recover()'), (await row(x.id)).status !== 'RUNNING'), 10_000, 'recover to take the lost call');
    assert.deepEqual(
      { status: (await row(x.id)).status, number: (await row(x.id)).error_number, starts: await starts('claimed-only') },
      { status: 'FAILED', number: 'AP008', starts: 0 },
    );
  });

  it('while its worker lives, recover leaves the call alone through the top-level statement, and conclude records it', async () => {
    const x = await submit('ac.sleeper', { tag: 'alive', seconds: 1.5 }, { queue: 'ac_hand' });
    const worker = await session();
    assert.equal((await worker.query(`select id from asyncproc.claim('ac_hand', 'hand')`)).rows[0].id, x.id);
    const prepared = (await worker.query('select statement, arguments::text as arguments from asyncproc.prepare_call($1)', [x.id])).rows[0];
    assert.match(prepared.statement, /^call ac\.sleeper\(/);
    const call = worker.query(prepared.statement, [prepared.arguments]);
    await waitFor(async () => (await starts('alive')) === 1, 10_000, 'the call to commit its start');
    assert.equal((await sql.query('select asyncproc.recover() as n')).rows[0].n, 0, 'recover took a call whose worker is alive');
    await call;
    assert.equal((await sql.query('select asyncproc.recover() as n')).rows[0].n, 0, 'recover took a call finished but not yet recorded');
    await worker.query(`select * from asyncproc.conclude($1, 'hand', null, true, null, null, null, null, null, null, null, null)`, [x.id]);
    assert.equal((await row(x.id)).status, 'SUCCEEDED');
    assert.deepEqual(await log('alive'), [1]);
  });

  it('a worker that lost its lock cannot run it nor record an outcome over the one recover wrote', async () => {
    const x = await submit('ac.sleeper', { tag: 'stale', seconds: 0 }, { queue: 'ac_hand', maxAttempts: 3 });
    const stale = await session();
    assert.equal((await stale.query(`select id from asyncproc.claim('ac_hand', 'stale')`)).rows[0].id, x.id);
    await stale.query('select pg_advisory_unlock_all()');
    await sql.query('select asyncproc.recover()');
    assert.equal((await row(x.id)).status, 'FAILED');
    assert.equal((await stale.query('select * from asyncproc.prepare_call($1)', [x.id])).rowCount, 0, 'prepare_call gave a lost call to run');
    await stale.query(`select * from asyncproc.conclude($1, 'stale', null, true, null, null, null, null, null, null, null, null)`, [x.id]);
    assert.deepEqual([(await row(x.id)).status, (await row(x.id)).error_number], ['FAILED', 'AP008']);
  });
});
