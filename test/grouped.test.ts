/**
 * Grouped commits (a queue's groupCommits.size > 1): several short calls in one transaction,
 * each under its own savepoint. Which calls shared a transaction is read from the xid that
 * ended each of them (asyncproc.executions.xid, stamped by finish()).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import type { Closeable } from '../src/engine.js';
import { EngineError } from '../src/engine.js';
import type { PostgresEngine } from '../src/engines/postgres/index.js';
import { startTestApp, type TestApp } from './support/app.js';
import { sleep, startDemoDatabase, waitFor, type TestCluster } from './support/database.js';

let cluster: TestCluster;
let url: string;
let engine: PostgresEngine;
let sql: pg.Client;

before(async () => {
  ({ cluster, url, engine, sql } = await startDemoDatabase());
  // what a group in flight holds locked (midGroup)
  await sql.query('create extension if not exists pgrowlocks');
  await sql.query(`create schema grouped;
    create procedure grouped.record_then_fail(tag text) language plpgsql as $$
    begin insert into demo.ledger (tag) values (tag); raise exception 'failed on purpose: %', tag; end $$;
    create procedure grouped.record_then_sleep(tag text, seconds double precision) language plpgsql as $$
    begin insert into demo.ledger (tag) values (tag); perform pg_sleep(seconds); end $$;
    create procedure grouped.timed_sleep(seconds double precision) language plpgsql as $$
    begin perform pg_sleep(seconds); end $$;
    create procedure grouped.autonomous(tag text) language plpgsql as $$
    begin insert into demo.ledger (tag) values (tag); commit; end $$;
    create procedure grouped.report(percent numeric) language plpgsql as $$
    begin perform asyncproc.progress(percent, 'grouped'); perform pg_sleep(0.3); end $$;
    select asyncproc.register('grouped.report(numeric)');
    select asyncproc.register('grouped.record_then_fail(text)');
    select asyncproc.register('grouped.record_then_sleep(text, double precision)');
    select asyncproc.register('grouped.timed_sleep(double precision)', timeout_ms => 300);
    select asyncproc.register('grouped.autonomous(text)', transactional => false);`);
});
after(async () => {
  await sql?.end();
  await engine?.close();
  await cluster?.stop();
});

type Call = [procedure: string, args: Record<string, unknown>];

/** Submit `calls` to `queue` in one transaction (so all are ready at once), in order. */
async function submit(queue: string, calls: Call[]): Promise<string[]> {
  await sql.query('begin');
  try {
    const tokens: string[] = [];
    for (const [procedure, args] of calls) {
      tokens.push((await sql.query('select asyncproc.invoke($1, $2::jsonb, $3) as token', [procedure, JSON.stringify(args), queue])).rows[0].token);
    }
    await sql.query('commit');
    return tokens;
  } catch (error) {
    await sql.query('rollback');
    throw error;
  }
}

interface Ended {
  token: string;
  status: string;
  xid: string;
  attempts: number;
  error_message: string | null;
}

/** Every call's end, in submission order, once all have ended. */
const allEnded = (tokens: string[], timeoutMs = 30_000) =>
  waitFor(
    async () => {
      const { rows } = await sql.query<Ended>(
        `select token, status, xid::text as xid, attempts, error_message from asyncproc.executions where token = any($1::uuid[]) order by id`,
        [tokens],
      );
      return rows.length === tokens.length && rows.every((r) => ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(r.status)) ? rows : null;
    },
    timeoutMs,
    'every call to end',
  );

const ledger = async (tag: string) => Number((await sql.query('select count(*) from demo.ledger where tag = $1', [tag])).rows[0].count);

/** Every call's tag has exactly one ledger row. */
async function eachRecordedOnce(calls: Call[]): Promise<void> {
  for (const [, args] of calls) assert.equal(await ledger(args.tag as string), 1, `${args.tag} has one ledger row`);
}

/** Two quick calls, a slow one (`seconds`), a quick one: a group is mid-way (3 calls in it) while the third runs. */
const slowThird = (prefix: string, seconds: number): Call[] => [
  ['demo.record', { tag: `${prefix}-1` }],
  ['demo.record', { tag: `${prefix}-2` }],
  ['grouped.record_then_sleep', { tag: `${prefix}-slow`, seconds }],
  ['demo.record', { tag: `${prefix}-4` }],
];

/** Calls per ending transaction. */
function groupSizes(rows: Ended[]): number[] {
  const sizes = new Map<string, number>();
  for (const r of rows) sizes.set(r.xid, (sizes.get(r.xid) ?? 0) + 1);
  return [...sizes.values()];
}

/** Submit `calls` to a new queue with that grouping, then start a worker for it (so every call is ready at its first claim). */
async function serve(queue: string, concurrency: number, size: number, maxMs: number, calls: Call[]): Promise<{ tokens: string[]; activator: Closeable }> {
  await engine.configureQueue(queue, concurrency, { size, maxMs });
  const tokens = await submit(queue, calls);
  return { tokens, activator: await engine.startActivator({ workerId: `grouped-${queue}`, queues: [queue] }) };
}

/**
 * The backend of the queue's (only) worker slot, once at least `calls` calls have run or are running in its
 * group: mid-group. The group holds each call's row locked until it ends (the first call's by its claim and
 * run(), each later one's as it takes it).
 */
const midGroup = (queue: string, calls: number) =>
  waitFor(
    async () => {
      const { rows } = await sql.query<{ pid: number; locks: string }>(
        `select a.pid, (select count(*) from pgrowlocks('asyncproc.executions') r where a.pid = any(r.pids)) as locks
           from pg_stat_activity a where a.application_name like $1`,
        [`asyncproc worker %/${queue}#0`],
      );
      return rows.find((r) => Number(r.locks) >= calls)?.pid ?? null;
    },
    15_000,
    `a group of ${calls} calls in flight`,
  );

describe('grouped commits', () => {
  it('a grouped queue drains every call once, in fewer transactions than calls', async () => {
    const n = 200;
    const { tokens, activator } = await serve('g_drain', 2, 20, 1000, Array.from({ length: n }, (_, i): Call => ['demo.record', { tag: `drain-${i}` }]));
    try {
      const rows = await allEnded(tokens);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED' && r.attempts === 1));
      const { rows: counts } = await sql.query(`select count(*)::int as n, count(distinct tag)::int as tags from demo.ledger where tag like 'drain-%'`);
      assert.deepEqual(counts[0], { n, tags: n }, 'one ledger row per call');
      const sizes = groupSizes(rows);
      assert.ok(sizes.length <= n / 4, `${n} calls ended in ${sizes.length} transactions`);
      assert.ok(Math.max(...sizes) <= 20);
    } finally {
      await activator.close();
    }
  });

  it('a failing call of a group rolls back alone and ends FAILED; the others keep their writes', async () => {
    const { tokens, activator } = await serve('g_fail', 1, 10, 2000, [
      ['demo.record', { tag: 'gf-1' }],
      ['grouped.record_then_fail', { tag: 'gf-2' }],
      ['demo.record', { tag: 'gf-3' }],
    ]);
    try {
      const rows = await allEnded(tokens);
      assert.deepEqual(rows.map((r) => r.status), ['SUCCEEDED', 'FAILED', 'SUCCEEDED']);
      assert.equal(rows[1].error_message, 'failed on purpose: gf-2');
      assert.equal(new Set(rows.map((r) => r.xid)).size, 1, 'the three committed together');
      assert.deepEqual([await ledger('gf-1'), await ledger('gf-2'), await ledger('gf-3')], [1, 0, 1]);
    } finally {
      await activator.close();
    }
  });

  it("a call after a group's first records its start with its end: attempt, worker, session and times, and a retry as any call's", async () => {
    const calls: Call[] = [
      ['demo.record', { tag: 'gs-1' }],
      ['demo.record', { tag: 'gs-2' }],
      ['grouped.record_then_fail', { tag: 'gs-3' }],
      ['demo.record', { tag: 'gs-4' }],
    ];
    await engine.configureQueue('g_start', 1, { size: 10, maxMs: 5000 });
    await sql.query('begin');
    const tokens: string[] = [];
    for (const [i, [procedure, args]] of calls.entries()) {
      // the failing call may try twice: its first failure is retried
      const { rows } = await sql.query('select asyncproc.invoke($1, $2::jsonb, $3, max_attempts => $4) as token', [procedure, JSON.stringify(args), 'g_start', i === 2 ? 2 : 1]);
      tokens.push(rows[0].token);
    }
    await sql.query('commit');
    const activator = await engine.startActivator({ workerId: 'grouped-g_start', queues: ['g_start'] });
    try {
      const rows = await allEnded(tokens);
      assert.deepEqual(rows.map((r) => [r.status, r.attempts]), [['SUCCEEDED', 1], ['SUCCEEDED', 1], ['FAILED', 2], ['SUCCEEDED', 1]]);
      const { rows: recorded } = await sql.query(
        `select e.token, e.started_at, e.finished_at, e.worker, e.backend_pid, e.transactional, e.run_at, e.submitted_at
           from asyncproc.executions e where e.token = any($1::uuid[]) order by e.id`,
        [tokens],
      );
      const first = recorded[0];
      for (const r of recorded) {
        assert.equal(r.worker, 'grouped-g_start/g_start#0', 'the slot that ran it');
        assert.equal(r.backend_pid, first.backend_pid, "the slot's session");
        assert.equal(r.transactional, true);
        assert.ok(r.started_at >= r.submitted_at && r.finished_at >= r.started_at, JSON.stringify(r));
      }
      // in one group, one after the other: each started once the one before it had ended
      assert.equal(new Set([rows[0].xid, rows[1].xid, rows[3].xid]).size, 1, 'the quick calls committed together');
      assert.ok(recorded[1].started_at >= recorded[0].finished_at && recorded[3].started_at >= recorded[1].finished_at);
      // the first failure: an attempt of its own, as it started and ended, and a retry after a backoff
      const { rows: attempts } = await sql.query(
        `select a.number, a.status, a.started_at, a.finished_at, a.worker, a.backend_pid, a.error_message
           from asyncproc.attempts a join asyncproc.executions e on e.id = a.execution_id where e.token = $1`,
        [tokens[2]],
      );
      assert.equal(attempts.length, 1);
      assert.deepEqual([attempts[0].number, attempts[0].status, attempts[0].worker, attempts[0].backend_pid, attempts[0].error_message],
        [1, 'FAILED', 'grouped-g_start/g_start#0', first.backend_pid, 'failed on purpose: gs-3']);
      assert.ok(attempts[0].started_at >= recorded[1].finished_at && attempts[0].finished_at >= attempts[0].started_at);
      assert.ok(recorded[2].started_at > attempts[0].finished_at, 'the retry started after the failed attempt');
      assert.deepEqual([await ledger('gs-1'), await ledger('gs-2'), await ledger('gs-3'), await ledger('gs-4')], [1, 1, 0, 1]);
    } finally {
      await activator.close();
    }
  });

  it("a worker's backend killed mid-group: the whole group is undone and every call runs again exactly once", async () => {
    const calls: Call[] = [
      ...Array.from({ length: 10 }, (_, i): Call => ['demo.record', { tag: `crash-${i}` }]),
      ['grouped.record_then_sleep', { tag: 'crash-slow', seconds: 3 }],
      ...Array.from({ length: 5 }, (_, i): Call => ['demo.record', { tag: `crash-${10 + i}` }]),
    ];
    const { tokens, activator } = await serve('g_crash', 1, 100, 5000, calls);
    try {
      const pid = await midGroup('g_crash', 11);
      // nothing of the group is committed yet: the first call RUNNING, the rest PENDING
      const { rows: before } = await sql.query(`select status, count(*)::int as n from asyncproc.executions where queue = 'g_crash' group by status order by status`);
      assert.deepEqual(before, [{ status: 'PENDING', n: 15 }, { status: 'RUNNING', n: 1 }]);
      await sql.query('select pg_terminate_backend($1)', [pid]);
      const rows = await allEnded(tokens, 60_000);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED'), JSON.stringify(rows.map((r) => r.status)));
      await eachRecordedOnce(calls);
    } finally {
      await activator.close();
    }
  });

  it("a batch member claimed first runs in a transaction of its own, not at the head of a group (its batch's row stayed locked until the group committed)", async () => {
    const queue = 'g_member_first';
    await engine.configureQueue(queue, 1, { size: 10, maxMs: 2000 });
    const batch = await engine.submitBatch([[{ procedure: 'demo.record', arguments: { tag: 'member-first' }, queue }]]);
    const [member] = (await sql.query<{ token: string }>('select token from asyncproc.executions where batch_id = $1', [batch.id])).rows.map((r) => r.token);
    const calls: Call[] = Array.from({ length: 4 }, (_, i): Call => ['demo.record', { tag: `after-member-${i}` }]);
    const tokens = [member, ...(await submit(queue, calls))];
    const activator = await engine.startActivator({ workerId: `grouped-${queue}`, queues: [queue] });
    try {
      const rows = await allEnded(tokens);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED'), JSON.stringify(rows));
      const memberRow = rows.find((r) => r.token === member)!;
      assert.ok(rows.every((r) => r.token === member || r.xid !== memberRow.xid), 'no other call committed with the batch member');
      assert.equal(new Set(rows.filter((r) => r.token !== member).map((r) => r.xid)).size, 1, 'the others still committed together');
      assert.equal((await engine.getBatch(batch.id))?.status, 'SUCCEEDED');
      await eachRecordedOnce([['demo.record', { tag: 'member-first' }], ...calls]);
    } finally {
      await activator.close();
    }
  });

  it('a group never exceeds its size', async () => {
    const { tokens, activator } = await serve('g_size', 1, 3, 5000, Array.from({ length: 12 }, (): Call => ['demo.noop', {}]));
    try {
      const sizes = groupSizes(await allEnded(tokens));
      assert.equal(Math.max(...sizes), 3, `groups of ${sizes.join(', ')}`);
    } finally {
      await activator.close();
    }
  });

  it('a slow call closes its group by time', async () => {
    const { tokens, activator } = await serve('g_slow', 1, 100, 100, [
      ['demo.noop', {}],
      ['demo.sleep', { seconds: 0.5 }],
      ['demo.noop', {}],
      ['demo.noop', {}],
      ['demo.noop', {}],
    ]);
    try {
      const rows = await allEnded(tokens);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED'));
      assert.equal(rows[0].xid, rows[1].xid, 'the slow call joined the group begun before it');
      assert.ok(rows.slice(2).every((r) => r.xid !== rows[1].xid), 'no call joined after it');
    } finally {
      await activator.close();
    }
  });

  it("a call that becomes ready while a group runs, older than the group's calls, still joins the group", async () => {
    // claims inside a group start past its last call; finding nothing there, the group looks once
    // more from the start, where a call released meanwhile (due, or a retry) sits with its older id
    const queue = 'g_older';
    await engine.configureQueue(queue, 1, { size: 10, maxMs: 5000 });
    await sql.query('begin');
    let older: string;
    let slow: string;
    try {
      ({ token: older } = (await sql.query(`select asyncproc.invoke('demo.noop', '{}', $1, clock_timestamp() + interval '300 ms') as token`, [queue])).rows[0]);
      ({ token: slow } = (await sql.query(`select asyncproc.invoke('demo.sleep', '{"seconds": 1}', $1) as token`, [queue])).rows[0]);
      await sql.query('commit');
    } catch (error) {
      await sql.query('rollback');
      throw error;
    }
    const activator = await engine.startActivator({ workerId: `grouped-${queue}`, queues: [queue] });
    try {
      const rows = await allEnded([older, slow]);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED' && r.attempts === 1));
      const [first, second] = rows; // by id: the older call first
      assert.equal(first.token, older);
      assert.equal(first.xid, second.xid, 'the older call ran in the group of the slow one');
    } finally {
      await activator.close();
    }
  });

  it('a call with a timeout or a non-transactional one runs alone, with its own semantics', async () => {
    const { tokens, activator } = await serve('g_alone', 1, 100, 5000, [
      ['demo.record', { tag: 'alone-1' }],
      ['grouped.timed_sleep', { seconds: 2 }],
      ['demo.record', { tag: 'alone-3' }],
      ['grouped.autonomous', { tag: 'alone-4' }],
      ['demo.record', { tag: 'alone-5' }],
    ]);
    try {
      const rows = await allEnded(tokens);
      assert.deepEqual(rows.map((r) => r.status), ['SUCCEEDED', 'FAILED', 'SUCCEEDED', 'SUCCEEDED', 'SUCCEEDED']);
      assert.match(rows[1].error_message!, /timeout 300 ms/);
      for (const alone of [1, 3]) {
        assert.equal(rows.filter((r) => r.xid === rows[alone].xid).length, 1, `call ${alone + 1} committed alone`);
      }
      assert.deepEqual([await ledger('alone-1'), await ledger('alone-3'), await ledger('alone-4'), await ledger('alone-5')], [1, 1, 1, 1]);
    } finally {
      await activator.close();
    }
  });

  it('a cancel of a call sitting in an uncommitted group waits for the commit and finds it ended', async () => {
    const calls = slowThird('cg', 1.5);
    const { tokens, activator } = await serve('g_cancel', 1, 100, 5000, calls);
    try {
      await midGroup('g_cancel', 3);
      const asked = Date.now();
      await assert.rejects(engine.cancelExecution(tokens[1]), (e: unknown) => e instanceof EngineError && e.code === 'ALREADY_FINISHED');
      assert.ok(Date.now() - asked < 10_000, 'the cancel did not hang');
      const rows = await allEnded(tokens);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED'));
      assert.equal(new Set(rows.slice(0, 3).map((r) => r.xid)).size, 1, 'they committed as one group');
      await eachRecordedOnce(calls);
    } finally {
      await activator.close();
    }
  });

  it("a cancel of a group's first call while it runs: it ends CANCELLED, its writes undone, the others run once", async () => {
    const calls: Call[] = [
      ['grouped.record_then_sleep', { tag: 'cf-1', seconds: 5 }],
      ['demo.record', { tag: 'cf-2' }],
      ['demo.record', { tag: 'cf-3' }],
    ];
    const { tokens, activator } = await serve('g_cancel_first', 1, 100, 5000, calls);
    try {
      await waitFor(async () => (await engine.getExecution(tokens[0]))!.status === 'RUNNING', 10_000, 'the first call running');
      await sleep(300);
      assert.equal((await engine.cancelExecution(tokens[0])).status, 'CANCELLED');
      const rows = await allEnded(tokens);
      assert.deepEqual(rows.map((r) => r.status), ['CANCELLED', 'SUCCEEDED', 'SUCCEEDED']);
      assert.deepEqual([await ledger('cf-1'), await ledger('cf-2'), await ledger('cf-3')], [0, 1, 1]);
    } finally {
      await activator.close();
    }
  });

  it('progress reported by a call inside a group is kept for that call, not for the first one', async () => {
    const { tokens, activator } = await serve('g_progress', 1, 100, 5000, [
      ['grouped.report', { percent: 10 }],
      ['grouped.report', { percent: 20 }],
      ['grouped.report', { percent: 30 }],
    ]);
    try {
      const rows = await allEnded(tokens);
      assert.equal(new Set(rows.map((r) => r.xid)).size, 1, 'one group');
      const progress = () =>
        sql.query(
          `select e.token, p.percent::int as percent from asyncproc.executions e
             left join asyncproc.execution_progress p on p.execution_id = e.id where e.token = any($1::uuid[]) order by e.id`,
          [tokens],
        );
      await waitFor(async () => (await progress()).rows.every((r) => r.percent !== null), 5000, 'each call its progress');
      assert.deepEqual((await progress()).rows.map((r) => r.percent), [10, 20, 30]);
    } finally {
      await activator.close();
    }
  });

  it('a cancel signal that reaches a group mid-way rolls all of it back: every call then runs exactly once', async () => {
    const calls = slowThird('cs', 2);
    const { tokens, activator } = await serve('g_signal', 1, 100, 5000, calls);
    try {
      const pid = await midGroup('g_signal', 3);
      await sql.query('select pg_cancel_backend($1)', [pid]);
      const rows = await allEnded(tokens);
      assert.ok(rows.every((r) => r.status === 'SUCCEEDED'), JSON.stringify(rows.map((r) => r.status)));
      await eachRecordedOnce(calls);
      const { rows: first } = await sql.query('select recoveries from asyncproc.executions where token = $1', [tokens[0]]);
      assert.equal(first[0].recoveries, 1, 'the first call was started again (the others were never committed RUNNING)');
    } finally {
      await activator.close();
    }
  });
});

describe('grouped commits: a failure no savepoint catches, and what one call leaves to the next', () => {
  before(async () => {
    await sql.query(`
      create procedure grouped.record_then_assert(tag text) language plpgsql as $$
      begin insert into demo.ledger (tag) values (tag); assert false, 'asserted on purpose: ' || tag; end $$;
      -- its message reads like a lost connection (it was taken for one: the call ended FAILED AP010, lost five times)
      create procedure grouped.record_then_assert_closed(tag text) language plpgsql as $$
      begin insert into demo.ledger (tag) values (tag); assert false, 'order closed: connection terminated on purpose: ' || tag; end $$;
      create table grouped.parent (id integer primary key);
      create table grouped.child (parent integer references grouped.parent deferrable initially deferred);
      create procedure grouped.record_orphan(tag text) language plpgsql as $$
      begin insert into demo.ledger (tag) values (tag); insert into grouped.child values (-1); end $$;
      create table grouped.hot (id integer primary key, n integer not null);
      insert into grouped.hot values (1, 0), (2, 0);
      create procedure grouped.bump(row_id integer) language plpgsql as $$
      begin update grouped.hot set n = n + 1 where id = row_id; perform pg_sleep(0.005); end $$;
      create schema grouped_elsewhere;
      create table public.landing (tag text);
      create table grouped_elsewhere.landing (tag text);
      create procedure grouped.wander() language plpgsql as $$
      begin perform set_config('search_path', 'grouped_elsewhere, public', true); end $$;
      create procedure grouped.land(tag text) language plpgsql as $$
      begin insert into landing values (tag); end $$;
      select asyncproc.register('grouped.record_then_assert(text)');
      select asyncproc.register('grouped.record_then_assert_closed(text)');
      select asyncproc.register('grouped.record_orphan(text)');
      select asyncproc.register('grouped.bump(integer)');
      select asyncproc.register('grouped.wander()');
      select asyncproc.register('grouped.land(text)');`);
    // deadlocks are found sooner (the database of this file only)
    await sql.query(`alter database ${(await sql.query('select current_database() as d')).rows[0].d} set deadlock_timeout = '100ms'`);
  });

  for (const [name, procedure, error] of [
    ['an assert', 'grouped.record_then_assert', /asserted on purpose/],
    ['a deferred constraint at the commit', 'grouped.record_orphan', /violates foreign key constraint/],
    ['an assert whose message speaks of a closed connection', 'grouped.record_then_assert_closed', /connection terminated on purpose/],
  ] as const) {
    it(`${name} fails only its own call, with its own error: the group is given back, and its calls run one at a time`, async () => {
      const prefix = procedure.replace(/\W/g, '');
      const calls: Call[] = [
        ['demo.record', { tag: `${prefix}-1` }],
        ['demo.record', { tag: `${prefix}-2` }],
        ['demo.record', { tag: `${prefix}-3` }],
        [procedure, { tag: `${prefix}-bad` }],
        ['demo.record', { tag: `${prefix}-5` }],
      ];
      const { tokens, activator } = await serve(`g_${prefix}`, 1, 10, 2000, calls);
      try {
        const rows = await allEnded(tokens);
        assert.deepEqual(rows.map((r) => r.status), ['SUCCEEDED', 'SUCCEEDED', 'SUCCEEDED', 'FAILED', 'SUCCEEDED']);
        assert.match(rows[3].error_message!, error);
        assert.deepEqual(rows.map((r) => r.attempts), [1, 1, 1, 1, 1], 'no call was charged an attempt for another');
        for (const [i, [, args]] of calls.entries()) assert.equal(await ledger(args.tag as string), i === 3 ? 0 : 1, `${args.tag}`);
      } finally {
        await activator.close();
      }
    });
  }

  it('two groups that deadlock on rows their calls update in turn: no call fails for it, and each runs once', async () => {
    const n = 120;
    // each call updates one of two rows, and alone never waits long; a group holds the rows of all its
    // calls to its commit, so two groups that took one row each wait for the other's
    const calls: Call[] = Array.from({ length: n }, (_, i): Call => ['grouped.bump', { row_id: 1 + (i % 2) }]);
    await engine.configureQueue('g_hot', 2, { size: 20, maxMs: 1000 });
    const tokens = await submit('g_hot', calls);
    const activator = await engine.startActivator({ workerId: 'grouped-g_hot', queues: ['g_hot'] });
    try {
      const rows = await allEnded(tokens, 120_000);
      const failed = rows.filter((r) => r.status !== 'SUCCEEDED');
      assert.deepEqual(failed.map((r) => r.error_message), [], 'no call failed');
      assert.deepEqual((await sql.query('select n from grouped.hot order by id')).rows.map((r) => r.n), [n / 2, n / 2], 'each call once');
    } finally {
      await activator.close();
    }
  });

  it("a call that changes the search path for the rest of the transaction ends its group: the next call runs with the queue's own", async () => {
    const { tokens, activator } = await serve('g_path', 1, 10, 2000, [
      ['grouped.wander', {}],
      ['grouped.land', { tag: 'landed' }],
    ]);
    try {
      const rows = await allEnded(tokens);
      assert.deepEqual(rows.map((r) => r.status), ['SUCCEEDED', 'SUCCEEDED']);
      assert.equal(new Set(rows.map((r) => r.xid)).size, 2, 'not in one transaction');
      assert.deepEqual((await sql.query(`select tag from public.landing`)).rows, [{ tag: 'landed' }]);
      assert.deepEqual((await sql.query(`select tag from grouped_elsewhere.landing`)).rows, []);
    } finally {
      await activator.close();
    }
  });
});

describe('groupCommits over GraphQL', () => {
  let t: TestApp;
  before(async () => {
    t = await startTestApp(url);
  });
  after(async () => {
    await t?.stop();
  });

  const configure = (input: Record<string, unknown>) =>
    t.gql(`mutation($i: ConfigureQueueInput!) { configureQueue(input: $i) { queue { name concurrency groupCommits { size maxMs } } } }`, { i: input });

  it('configureQueue sets and keeps it; bad values are BAD_USER_INPUT and change nothing; workers pick it up', async () => {
    const created = await configure({ name: 'g_api', concurrency: 1 });
    assert.deepEqual(created.body.data.configureQueue.queue.groupCommits, { size: 1, maxMs: 50 }, 'off by default');
    const set = await configure({ name: 'g_api', concurrency: 1, groupCommits: { size: 8, maxMs: 2000 } });
    assert.deepEqual(set.body.data.configureQueue.queue.groupCommits, { size: 8, maxMs: 2000 });
    const kept = await configure({ name: 'g_api', concurrency: 2 });
    assert.deepEqual(kept.body.data.configureQueue.queue, { name: 'g_api', concurrency: 2, groupCommits: { size: 8, maxMs: 2000 } });
    for (const bad of [{ size: 0 }, { size: 1001 }, { maxMs: 0 }, { maxMs: 10_001 }]) {
      const { status, body } = await configure({ name: 'g_api', concurrency: 3, groupCommits: bad });
      assert.equal(status, 200);
      assert.equal(body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(bad));
    }
    const listed = await t.gql(`{ queues { name concurrency groupCommits { size maxMs } } }`);
    assert.deepEqual(
      listed.body.data.queues.find((q: { name: string }) => q.name === 'g_api'),
      { name: 'g_api', concurrency: 2, groupCommits: { size: 8, maxMs: 2000 } },
      'nothing changed',
    );
    // the service's own workers run the queue grouped now
    await sleep(300);
    const tokens = await submit('g_api', Array.from({ length: 16 }, (): Call => ['demo.noop', {}]));
    const sizes = groupSizes(await allEnded(tokens));
    assert.ok(Math.max(...sizes) > 1 && Math.max(...sizes) <= 8, `groups of ${sizes.join(', ')}`);
  });
});
