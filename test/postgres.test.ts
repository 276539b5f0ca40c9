/** PostgreSQL-specific behaviour: migrator, SQL interface, argument types, savepoints, result shapes, purge. */
import assert from 'node:assert/strict';
import { cp, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { EngineError } from '../src/engine.js';
import type { Closeable, Execution, InvokeCall } from '../src/engine.js';
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { migrate } from '../src/engines/postgres/migrator.js';
import { connect } from '../src/index.js';
import { parseSnapshot } from '../src/changeCursor.js';
import { CompletionHub, untilQuiet } from '../src/completionHub.js';
import { readChanges } from '../src/engines/postgres/executions.js';
import { silentLogger } from '../src/logger.js';
import { peakConcurrency, sleep, startDemoDatabase, waitFor, type TestCluster } from './support/database.js';
import { capturingLogger } from './support/logs.js';

let cluster: TestCluster;
let url: string;
let engine: PostgresEngine;
let activator: Closeable;
let sql: pg.Client;

before(async () => {
  ({ cluster, url, engine, sql } = await startDemoDatabase());
  await sql.query(`create schema pgtest;
    create table pgtest.effects (tag text not null);
    create procedure pgtest.write_then_fail(tag text) language plpgsql as $$
      begin insert into pgtest.effects values (tag); raise exception 'after writing %', tag using errcode = '22012'; end $$;
    create procedure pgtest.types(
      n numeric, ts timestamptz, flags boolean[], doc jsonb, ids integer[], out echo jsonb, label text default 'none')
    language plpgsql as $$ begin echo := jsonb_build_object('n', n, 'ts', ts, 'flags', flags, 'doc', doc, 'ids', ids, 'label', label); end $$;
    create function pgtest.twice(x integer) returns integer language sql as $$ select x * 2 $$;
    create function pgtest.series(n integer) returns table (i integer, sq integer) language sql as $$ select g, g * g from generate_series(1, n) g $$;
    create procedure pgtest.unregistered() language plpgsql as $$ begin end $$;
    create procedure pgtest.detailed() language plpgsql as $$
    begin
      raise exception 'bad thing' using detail = 'the detail', errcode = '22023';
    end $$;`);
  for (const routine of ['pgtest.detailed', 'pgtest.write_then_fail', 'pgtest.types', 'pgtest.twice', 'pgtest.series']) await engine.registerProcedure(routine);
  activator = await engine.startActivator({ workerId: 'pgtest' });
});
after(async () => {
  await activator?.close();
  await sql?.end();
  await engine?.close();
  await cluster?.stop();
});

async function run(procedure: string, args: Record<string, unknown>): Promise<Execution> {
  const { token } = await engine.withTransaction((tx) => engine.invoke(tx, { procedure, arguments: args }));
  return waitFor(async () => {
    const e = await engine.getExecution(token);
    return e && ['SUCCEEDED', 'FAILED'].includes(e.status) ? e : null;
  });
}

describe('migrator', () => {
  it('applies each version once, also when several processes start at once', async () => {
    const fresh = await cluster.createDatabase();
    const engines = Array.from({ length: 3 }, () => createPostgresEngine({ connectionString: fresh }));
    try {
      await Promise.all(engines.map((e) => e.migrate()));
      await Promise.all(engines.map((e) => e.installDemo()));
      await engines[0].migrate();
      const { rows } = await engines[0].pool.query('select version, count(*)::int as n from asyncproc.migrations group by version');
      assert.ok(rows.length >= 1);
      assert.ok(rows.every((r) => r.n === 1));
      const demo = await engines[0].listProcedures();
      assert.ok(demo.some((p) => p.name === 'demo.add'));
    } finally {
      await Promise.all(engines.map((e) => e.close()));
    }
  });

  it('applies the pending migrations and the changed routines in one transaction: a routine that fails undoes the migrations too', async () => {
    const fresh = await cluster.createDatabase();
    const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-migrate-'));
    const pool = new pg.Pool({ connectionString: fresh, max: 2 });
    try {
      await cp(new URL('../sql/postgres/', import.meta.url), dir, { recursive: true });
      // a new migration whose work a routine must complete, and that routine broken
      await writeFile(path.join(dir, '0099_half.sql'), 'create table asyncproc.half_done (id int);');
      await writeFile(path.join(dir, 'routines', 'zz_broken.sql'), "do $$ begin raise exception 'this routine file is broken'; end $$;");
      await assert.rejects(migrate(pool, dir), /zz_broken/);
      const { rows } = await pool.query(`select to_regclass('asyncproc.half_done') as t, to_regclass('asyncproc.migrations') as m`);
      assert.deepEqual(rows[0], { t: null, m: null }, 'nothing of the failed upgrade was committed');
    } finally {
      await pool.end();
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('connect() of the library', () => {
  it('refuses, by name, a database without the schema or with older routines than the package calls (migrate: true installs them)', async () => {
    const fresh = await cluster.createDatabase();
    await assert.rejects(connect({ connectionString: fresh }), /no asyncproc schema: start the asyncproc service .* or connect with migrate: true/);
    const migrated = await connect({ connectionString: fresh, migrate: true });
    await migrated.close();
    await migrated.close(); // twice: no "Called end on pool more than once"
    const again = await connect({ connectionString: fresh });
    await again.close();
    // an older release's routines (a service not yet upgraded)
    const admin = new pg.Client({ connectionString: fresh });
    await admin.connect();
    try {
      await admin.query('alter table asyncproc.routines_revision disable trigger user');
      await admin.query('update asyncproc.routines_revision set revision = revision - 1');
    } finally {
      await admin.end();
    }
    await assert.rejects(connect({ connectionString: fresh }), /routines are revision \d+, this package needs \d+/);
  });
});

describe('the change feed', () => {
  // no trigger stamps a change (a PL/pgSQL call per update cost the drain about a twelfth of its
  // database work): each UPDATE of executions that moves seq stamps xid in the same SET list
  it('every routine that moves an execution in the feed stamps its writer', async () => {
    const dir = new URL('../sql/postgres/routines/', import.meta.url);
    let updates = 0;
    for (const file of (await readdir(dir)).filter((f) => f.endsWith('.sql'))) {
      const text = await readFile(new URL(file, dir), 'utf8');
      for (const statement of text.split(/;/).filter((s) => /update\s+asyncproc\.executions\b/i.test(s) && /\bseq\s*=/.test(s))) {
        updates++;
        assert.match(statement, /seq = nextval\('asyncproc\.change_seq'\), xid = pg_current_xact_id\(\)/, `${file}: ${statement.trim().slice(0, 200)}`);
      }
    }
    assert.ok(updates >= 10, 'the check sees the updates');
    const { rows } = await sql.query(`select tgname from pg_trigger where tgrelid = 'asyncproc.executions'::regclass and not tgisinternal`);
    assert.ok(!rows.some((r) => r.tgname === 'executions_stamp_change'));
  });

  it("this process's listeners hear its own commits at once, not when their NOTIFY comes back, and whether they ended their call", async () => {
    let heard = 0;
    const hints: (boolean | undefined)[] = [];
    let rows = 0;
    const listener = await engine.startListener({
      onChange: (own) => {
        heard++;
        hints.push(own?.terminal);
        if (own?.execution) rows++;
      },
      onError: () => undefined,
    });
    try {
      // quiet first: no notification of earlier work is still on its way
      for (let seen = -1; seen !== heard; ) {
        seen = heard;
        await new Promise((resolve) => setTimeout(resolve, 300));
      }
      heard = 0;
      hints.length = 0;
      const [{ token }] = await engine.submit([{ procedure: 'demo.noop', arguments: {} }]);
      // the continuation of the submit runs before any I/O: only the in-process path can have told the listener
      assert.ok(heard >= 1, 'the listener was told before the NOTIFY could come back');
      assert.deepEqual(hints, [false], 'a submit does not end its call');
      await waitFor(async () => (await engine.getExecution(token))?.status === 'SUCCEEDED' || null);
      await new Promise((resolve) => setTimeout(resolve, 300)); // the NOTIFYs come back meanwhile
      // the claim (not an end), the end; the NOTIFYs of this process's own commits are not heard again
      assert.deepEqual(hints, [false, false, true]);
      assert.equal(rows, 0, 'a listener that awaits no end is handed no row (the worker does not read it back)');
      await listener.close();
      const after = heard;
      await engine.submit([{ procedure: 'demo.noop', arguments: {} }]);
      assert.equal(heard, after, 'a closed listener is told nothing');
    } finally {
      await listener.close();
    }
  });
});

describe('the completion hub on this process\'s own changes', () => {
  it('reads the feed for its own change only when a stream or an end needs it', async () => {
    let reads = 0;
    // the engine itself, its reads of the feed counted
    const counted = Object.create(engine) as PostgresEngine;
    counted.readChanges = (...args) => (reads++, engine.readChanges(...args));
    counted.currentPosition = () => (reads++, engine.currentPosition());
    const hub = new CompletionHub(counted, silentLogger, { pollMs: 600_000 });
    await hub.start();
    const listener = await engine.startListener(hub);
    const quiet = async () => {
      for (let seen = -1; seen !== reads; ) {
        seen = reads;
        await new Promise((resolve) => setTimeout(resolve, 300));
      }
    };
    const runOne = async () => {
      await quiet();
      const before = reads;
      const [{ token }] = await engine.submit([{ procedure: 'demo.noop', arguments: {} }]);
      await waitFor(async () => (await engine.getExecution(token))?.status === 'SUCCEEDED' || null);
      await quiet();
      return reads - before;
    };
    try {
      // nobody listens for a submit or a claim: the end alone is read
      assert.equal(await runOne(), 1);
      // a stream hands out every change: the submit, the claim and the end are read as they come
      // (a read finds each row as it is then: a claim that came first hides the PENDING)
      const stream = hub.events({}, null);
      const statuses: string[] = [];
      const taking = (async () => {
        for await (const event of stream) if (statuses.push(event.status) && event.status === 'SUCCEEDED') break;
      })();
      assert.ok((await runOne()) >= 2);
      await taking;
      assert.equal(statuses.at(-1), 'SUCCEEDED');
    } finally {
      await listener.close();
      await hub.close();
    }
  });
});

describe('executionCompleted begun as its call ends', () => {
  // the engine itself, whose read of the execution answers what it read only after the call has
  // ended and the hub has read the end: the subscription's one read is older than the end
  function staleReader(): PostgresEngine {
    const stale = Object.create(engine) as PostgresEngine;
    stale.getExecution = async (token) => {
      const then = await engine.getExecution(token);
      await waitFor(async () => (await engine.getExecution(token))?.status === 'SUCCEEDED' || null);
      await new Promise((resolve) => setTimeout(resolve, 300));
      return then;
    };
    return stale;
  }

  it('hears the end its read missed, once; a caller refused is told NOT_FOUND and leaves no watch', async () => {
    const hub = new CompletionHub(staleReader(), silentLogger, { pollMs: 600_000 });
    await hub.start();
    const listener = await engine.startListener(hub);
    try {
      const [call] = await engine.submit([{ procedure: 'demo.sleep', arguments: { seconds: 0.3 } }]);
      const values: string[] = [];
      const ending = (async () => {
        for await (const execution of await hub.completed(call.token)) values.push(execution.status);
      })();
      const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error(`no end heard (${values.join()})`)), 10_000));
      await Promise.race([ending, timeout]);
      assert.deepEqual(values, ['SUCCEEDED']);
      assert.equal(hub.size, 0, 'the watch ended with the subscription');

      const [other] = await engine.submit([{ procedure: 'demo.sleep', arguments: { seconds: 0.3 } }]);
      await assert.rejects(hub.completed(other.token, () => false), (e: any) => e.code === 'NOT_FOUND');
      assert.equal(hub.size, 0, 'a refused subscription leaves no watch');
    } finally {
      await listener.close();
      await hub.close();
    }
  });
});

describe('executionCompleted of a call this process runs', () => {
  it('hears the end from the worker that ran it, as the commit left the row, without a read of the feed', async () => {
    // the engine itself, whose reads of the feed never answer (until released at the end)
    let release!: () => void;
    const released = new Promise<void>((resolve) => (release = resolve));
    let feedReads = 0;
    const deaf = Object.create(engine) as PostgresEngine;
    deaf.readChanges = (...args) => (feedReads++, released.then(() => engine.readChanges(...args)));
    const hub = new CompletionHub(deaf, silentLogger, { pollMs: 600_000 });
    await hub.start();
    const listener = await engine.startListener(hub);
    try {
      // due in a moment: the subscriptions begin before their calls run
      const runAt = new Date(Date.now() + 1500);
      const calls = await engine.submit([
        { procedure: 'demo.add', arguments: { a: 2, b: 3 }, runAt },
        // more digits than a double holds, in the arguments and in the result
        { procedure: 'demo.echo_money', arguments: { amount: '123456789012345.6789' }, runAt },
        { procedure: 'demo.fail', arguments: { message: 'refused' }, runAt, maxAttempts: 1 },
      ]);
      const subscriptions = await Promise.all(calls.map((call) => hub.completed(call.token)));
      const heard = await Promise.race([
        Promise.all(subscriptions.map(async (events) => (await events.next()).value as Execution)),
        new Promise<never>((_, reject) => setTimeout(() => reject(new Error('no end heard while the feed was unread')), 15_000)),
      ]);
      assert.ok(feedReads >= 1, 'the hub did try to read the feed');
      assert.deepEqual(heard.map((e) => e.status), ['SUCCEEDED', 'SUCCEEDED', 'FAILED']);
      assert.deepEqual(heard[1].result?.outputParameters, { same: '123456789012345.6789' });
      // every field as a read of the row gives it: ids, times, arguments, result, error
      for (const [i, execution] of heard.entries()) assert.deepEqual(execution, await engine.getExecution(calls[i].token));
      for (const events of subscriptions) assert.equal((await events.next()).done, true, 'one event, then the end');
    } finally {
      release();
      await listener.close();
      await hub.close();
    }
  });
});

describe('single calls of separate requests share statements', () => {
  // due in an hour: the file's worker pool serves every queue, and a call it ran would have a later writer
  const tagged = (tag: string): InvokeCall => ({ procedure: 'demo.record', arguments: { tag }, queue: 'coalesce_idle', runAt: new Date(Date.now() + 3_600_000) });
  const writers = async (tokens: string[]) =>
    (await sql.query<{ xid: string }>(`select xid::text as xid from asyncproc.executions where token = any($1::uuid[])`, [tokens])).rows.map((r) => r.xid);
  before(() => engine.configureQueue('coalesce_idle', 1));

  it('calls that come while one is on its way go together, in one transaction', async () => {
    const calls = Array.from({ length: 30 }, (_, i) => tagged(`together-${i}`));
    const executions = await Promise.all(calls.map((c) => engine.submit([c]).then(([e]) => e)));
    const tokens = executions.map((e) => e.token);
    assert.equal(new Set(tokens).size, 30);
    const xids = await writers(tokens);
    assert.equal(xids.length, 30, 'each call is in once');
    assert.ok(new Set(xids).size < 10, `30 calls in ${new Set(xids).size} transactions`);
  });

  it("one caller's bad call fails that caller only; every other call is in exactly once", async () => {
    const calls: InvokeCall[] = Array.from({ length: 20 }, (_, i) => tagged(`mixed-${i}`));
    calls.splice(7, 0, { procedure: 'demo.nope', arguments: {} });
    calls.splice(13, 0, { procedure: 'demo.record', arguments: { tag: 'mixed-bad', extra: 1 }, queue: 'coalesce_idle' });
    const outcomes = await Promise.allSettled(calls.map((c) => engine.submit([c]).then(([e]) => e)));
    const codes = outcomes.map((o) => (o.status === 'rejected' ? (o.reason as { code?: string }).code : 'ok'));
    assert.equal(codes[7], 'UNKNOWN_PROCEDURE');
    assert.equal(codes[13], 'INVALID_ARGUMENTS');
    assert.equal(codes.filter((c) => c === 'ok').length, 20);
    const tokens = outcomes.flatMap((o) => (o.status === 'fulfilled' ? [o.value.token] : []));
    assert.equal((await writers(tokens)).length, 20);
    const { rows } = await sql.query(`select count(*)::int as n from asyncproc.executions where arguments ->> 'tag' like 'mixed-%'`);
    assert.equal(rows[0].n, 20, 'no call twice, the bad ones never');
  });

  it('a statement whose connection is lost fails its own calls, sends none of them again, and the calls behind it go on', async () => {
    const locker = await cluster.connect(url);
    try {
      await locker.query('begin');
      await locker.query('lock table asyncproc.procedures in access exclusive mode');
      const first = engine.submit([tagged('lost-first')]);
      // its handler attached now: the rejection may come back before the terminate's answer
      const firstFails = assert.rejects(first, (e: { code?: string }) => e.code === '57P01');
      const behind = ['lost-2', 'lost-3', 'lost-4'].map((tag) => engine.submit([tagged(tag)]));
      const pid = await waitFor(async () => {
        const { rows } = await sql.query(
          `select pid from pg_stat_activity where wait_event_type = 'Lock' and query like '%asyncproc.submit(%' and pid <> pg_backend_pid()`,
        );
        return rows.length === 1 ? (rows[0].pid as number) : null;
      }, 10_000, 'the first statement to wait for the lock');
      await sql.query('select pg_terminate_backend($1)', [pid]);
      await firstFails;
      await locker.query('commit');
      const executions = (await Promise.all(behind)).map(([e]) => e);
      assert.equal(new Set(await writers(executions.map((e) => e.token))).size, 1, 'the three behind it went in one statement');
      await new Promise((resolve) => setTimeout(resolve, 300));
      const { rows } = await sql.query(`select arguments ->> 'tag' as tag from asyncproc.executions where arguments ->> 'tag' like 'lost-%' order by 1`);
      assert.deepEqual(rows.map((r) => r.tag), ['lost-2', 'lost-3', 'lost-4'], 'the lost one was not sent again');
    } finally {
      await locker.query('rollback').catch(() => undefined);
      await locker.end();
    }
  });
});

describe("a pool connection cut while it is handed out", () => {
  it("fails its caller's statement and stops nothing: an idle transaction's connection terminated between two statements", async () => {
    // pg-pool listens for a connection's errors only while it is idle: cut while handed out,
    // it raised an unhandled 'error' that ended the process (a start-up's migration met it)
    const uncaught: Error[] = [];
    const seen = (error: Error) => void uncaught.push(error);
    process.on('uncaughtException', seen);
    const outcome = engine.withTransaction(async (tx) => {
      const { rows } = await tx.query<{ pid: number }>('select pg_backend_pid() as pid');
      await sql.query('select pg_terminate_backend($1)', [rows[0].pid]);
      await sleep(500); // the termination reaches the idle connection meanwhile
      await tx.query('select 1');
    });
    try {
      await assert.rejects(outcome, (e: { code?: string; message?: string }) => e.code === '57P01' || /terminat|connection error/i.test(e.message ?? ''));
    } finally {
      process.off('uncaughtException', seen);
    }
    assert.deepEqual(uncaught.map((e) => e.message), [], 'nothing thrown past the caller (in a service: the process would have ended)');
    // the pool goes on with fresh connections
    assert.equal((await engine.pool.query('select 1 as one')).rows[0].one, 1);
  });
});

describe('a read of the change feed', () => {
  it('visits what the position does not see, never the history before it (with or without table statistics, planned for its values or generic)', async () => {
    const dbUrl = await cluster.createDatabase();
    const own = createPostgresEngine({ connectionString: dbUrl });
    const db = await cluster.connect(dbUrl);
    try {
      await own.migrate();
      await own.installDemo();
      for (let i = 0; i < 5; i++) await own.submit(Array.from({ length: 1000 }, () => ({ procedure: 'demo.noop', arguments: {} })));
      const since = await own.currentPosition();
      const fresh = await own.submit(Array.from({ length: 3 }, () => ({ procedure: 'demo.noop', arguments: {} })));
      for (const [statistics, plan] of [[false, 'custom'], [false, 'generic'], [true, 'custom'], [true, 'generic']] as const) {
        if (statistics) await db.query('analyze asyncproc.executions');
        // the statement the engine sends (a named one), run again under EXPLAIN ANALYZE: planned for its
        // values, and as the generic plan PostgreSQL may settle on for a prepared statement after five runs
        let sent: { name: string; text: string; values: unknown[] } | null = null;
        const recorder = { query: (statement: { name: string; text: string; values: unknown[] }) => ((sent = statement), own.pool.query(statement)) } as unknown as pg.Pool;
        const page = await readChanges(recorder, since, { limit: 1000 });
        assert.deepEqual(page.changes.map((c) => c.execution.token).sort(), fresh.map((e) => e.token).sort());
        assert.match(sent!.name, /^asyncproc-feed-/);
        let rows;
        if (plan === 'custom') ({ rows } = await db.query(`explain (analyze, format json) ${sent!.text}`, sent!.values));
        else {
          await db.query(`prepare feed_read as ${sent!.text}`);
          await db.query('set plan_cache_mode = force_generic_plan');
          ({ rows } = await db.query(`explain (analyze, format json) execute feed_read(${sent!.values.map((v) => db.escapeLiteral(String(v))).join(', ')})`));
          await db.query('deallocate feed_read; reset plan_cache_mode');
        }
        const label = `statistics ${statistics}, ${plan} plan`;
        const nodes: Record<string, unknown>[] = [];
        const walk = (node: Record<string, unknown>) => {
          nodes.push(node);
          for (const child of (node.Plans as Record<string, unknown>[] | undefined) ?? []) walk(child);
        };
        walk(rows[0]['QUERY PLAN'][0].Plan);
        const onExecutions = nodes.filter((n) => n['Relation Name'] === 'executions');
        assert.ok(onExecutions.length > 0 && onExecutions.every((n) => n['Node Type'] !== 'Seq Scan'), `${label}: ${onExecutions.map((n) => n['Node Type']).join(', ')}`);
        const visited = onExecutions.reduce((sum, n) => sum + Number(n['Actual Rows'] ?? 0) + Number(n['Rows Removed by Filter'] ?? 0) + Number(n['Rows Removed by Index Recheck'] ?? 0), 0);
        assert.ok(visited <= 10, `${label}: ${visited} rows visited for 3 changes past 5,000`);
      }
    } finally {
      await db.end();
      await own.close();
    }
  });
});

describe('a change heard as a read of the feed ends', () => {
  it('is read then, whatever moment of the read\'s ending it falls on, not at the next poll', async () => {
    let reads = 0;
    let hintAt: number | null = null;
    let armedDepth: number | null = null;
    const counted = Object.create(engine) as PostgresEngine;
    counted.readChanges = (...args) => {
      reads++;
      return engine.readChanges(...args).then((page) => {
        if (armedDepth !== null) {
          // a change heard `depth` continuations after this read's page came back
          let later = Promise.resolve();
          for (let i = 0; i < armedDepth; i++) later = later.then(() => undefined);
          void later.then(() => {
            hintAt = reads;
            hub.onChange();
          });
          armedDepth = null;
        }
        return page;
      });
    };
    counted.currentPosition = () => engine.currentPosition();
    const hub = new CompletionHub(counted, silentLogger, { pollMs: 600_000 });
    await hub.start();
    // a stream: every hint is read
    const stream = hub.events({ procedure: 'demo.nothing' }, null);
    await waitFor(async () => hub.size === 1 || null, 5000, 'the stream to join');
    try {
      for (let depth = 0; depth < 16; depth++) {
        hintAt = null;
        armedDepth = depth;
        hub.onChange();
        await waitFor(async () => hintAt !== null || null, 5000, 'the hint');
        await waitFor(async () => reads > hintAt! || null, 3000, `a read after a hint ${depth} continuations after a read`);
      }
    } finally {
      await stream.return?.();
      await hub.close();
    }
  });

  it("the same for a subscription's re-read of one row or report (untilQuiet)", async () => {
    let reads = 0;
    let hintAt: number | null = null;
    let armedDepth: number | null = null;
    const trigger = untilQuiet(
      async () => {
        reads++;
        await new Promise((resolve) => setImmediate(resolve));
        if (armedDepth !== null) {
          let later = Promise.resolve();
          for (let i = 0; i < armedDepth; i++) later = later.then(() => undefined);
          void later.then(() => {
            hintAt = reads;
            void trigger();
          });
          armedDepth = null;
        }
      },
      () => false,
      () => undefined,
    );
    for (let depth = 0; depth < 16; depth++) {
      hintAt = null;
      armedDepth = depth;
      void trigger();
      await waitFor(async () => hintAt !== null || null, 5000, 'the hint');
      await waitFor(async () => reads > hintAt! || null, 3000, `a read after a trigger ${depth} continuations into a read's end`);
    }
  });
});

describe('subscribers in step with a read of the feed', () => {
  it('an event stream that takes each read before the next is never stopped, whatever a read hands out at once', async () => {
    const hub = new CompletionHub(engine, silentLogger, { pollMs: 600_000, maxQueued: 50 });
    await hub.start();
    const listener = await engine.startListener(hub);
    try {
      const stream = hub.events({ procedure: 'demo.add' }, null);
      await waitFor(async () => hub.size === 1 || null, 5000, 'the stream to join');
      // 300 calls in one transaction: one read hands out 300 changes at once, six times the bound
      const tokens = (await engine.submit(Array.from({ length: 300 }, () => ({ procedure: 'demo.add', arguments: { a: 1, b: 2 } })))).map((e) => e.token);
      const ended = new Set<string>();
      for await (const event of stream) {
        if (event.status === 'SUCCEEDED') ended.add(event.execution.token);
        if (ended.size === tokens.length) break;
      }
      assert.equal(ended.size, 300);
    } finally {
      await listener.close();
      await hub.close();
    }
  });
});

/**
 * A demo database of its own and its engine; `reach(false)` refuses its connections and cuts
 * the open ones (a database out of reach), `reach(true)` lets them in again.
 */
async function outageDatabase() {
  const dbUrl = await cluster.createDatabase();
  const name = new URL(dbUrl).pathname.slice(1);
  const own = createPostgresEngine({ connectionString: dbUrl });
  await own.migrate();
  await own.installDemo();
  const reach = async (open: boolean) => {
    await sql.query(`alter database ${sql.escapeIdentifier(name)} allow_connections ${open}`);
    if (!open) await sql.query(`select pg_terminate_backend(pid) from pg_stat_activity where datname = $1`, [name]);
  };
  return { own, reach };
}

describe('executionCompleted begun while the database cannot be reached', () => {
  it('waits for the database rather than fail, then hears the end once', async () => {
    const { own, reach } = await outageDatabase();
    const workers = await own.startActivator({ workerId: 'outage' });
    const hub = new CompletionHub(own, silentLogger);
    await hub.start();
    const listener = await own.startListener(hub);
    try {
      const [{ token }] = await own.submit([{ procedure: 'demo.sleep', arguments: { seconds: 0.3 } }]);
      await reach(false);
      const values: string[] = [];
      const hearing = (async () => {
        for await (const execution of await hub.completed(token)) values.push(execution.status);
      })();
      let failed: unknown = null;
      hearing.catch((error) => (failed = error));
      await new Promise((resolve) => setTimeout(resolve, 1500));
      assert.equal(failed, null, 'the subscription did not fail while the database was out of reach');
      await reach(true);
      await hearing;
      assert.deepEqual(values, ['SUCCEEDED']);
    } finally {
      await reach(true);
      await listener.close();
      await hub.close();
      await workers.close();
      await own.close();
    }
  });
});

describe("the engine's word on which database errors pass by themselves", () => {
  it('a lost or refused connection, a restart, a timeout or a deadlock may; a missing table, a refused permission or a bad statement do not', async () => {
    const failure = (run: () => Promise<unknown>) => run().then(() => assert.fail('expected a failure'), (error: unknown) => error);
    const withClient = async <T,>(fn: (client: pg.Client) => Promise<T>) => {
      const client = await cluster.connect(url);
      client.on('error', () => undefined);
      try {
        return await fn(client);
      } finally {
        await client.end().catch(() => undefined);
      }
    };
    // each from the real server or driver
    const transient = {
      'connection refused': await failure(async () => {
        const client = new pg.Client({ connectionString: url.replace(/:\d+\//, ':1/') });
        await client.connect();
      }),
      'session terminated (57P01)': await withClient((c) => failure(() => c.query('select pg_terminate_backend(pg_backend_pid())'))),
      'statement timeout (57014)': await withClient(async (c) => {
        await c.query("set statement_timeout = '50ms'");
        return failure(() => c.query('select pg_sleep(1)'));
      }),
      'query on an ended client': await withClient(async (c) => {
        await c.end();
        return failure(() => c.query('select 1'));
      }),
    };
    const permanent = {
      'missing table (42P01)': await withClient((c) => failure(() => c.query('select * from asyncproc.no_such_table'))),
      'syntax (42601)': await withClient((c) => failure(() => c.query('selec 1'))),
      'permission denied (42501)': await withClient(async (c) => {
        await c.query('create role transient_probe nologin; set role transient_probe');
        try {
          return await failure(() => c.query('select * from asyncproc.executions'));
        } finally {
          await c.query('reset role; drop role transient_probe');
        }
      }),
      'division by zero (22012)': await withClient((c) => failure(() => c.query('select 1 / 0'))),
      'not an Error': 'oops',
    };
    for (const [name, error] of Object.entries(transient)) assert.equal(engine.isTransient(error), true, `${name}: ${String(error)}`);
    for (const [name, error] of Object.entries(permanent)) assert.equal(engine.isTransient(error), false, `${name}: ${String(error)}`);
    assert.equal((permanent['permission denied (42501)'] as { code?: string }).code, '42501');
    assert.equal((transient['statement timeout (57014)'] as { code?: string }).code, '57014');
  });
});

describe('a change cursor', () => {
  it('is accepted only when PostgreSQL takes it as a pg_snapshot (so a client\'s cursor never reaches the database malformed)', async () => {
    const max = ((1n << 64n) - 1n).toString();
    const candidates = ['0:0:', '0:1:', '1:0:', '1:1:', '1:2:1', '1:2:2', '2:1:', '3:9:', '3:9:3', '3:9:9', '3:9:4,5', '3:9:5,4', '3:9:4,4', `${max}:${max}:`, `1:${max}:2,3`, '01:2:', '1:2: ', '1:2:,', '-1:2:', '1::', ':1:'];
    for (const text of candidates) {
      const accepted = parseSnapshot(text) !== null;
      const takes = await sql.query('select $1::pg_snapshot as s', [text]).then(() => true, () => false);
      if (accepted) assert.ok(takes, `accepted ${JSON.stringify(text)}, which PostgreSQL refuses`);
    }
    assert.equal(parseSnapshot('0:0:'), null);
    assert.deepEqual(parseSnapshot('3:9:4,5'), { xmin: 3n, xmax: 9n, xip: [4n, 5n] });
  });
});

describe("a database with a DBA's strict defaults", () => {
  /** A database of its own with these defaults for every new session, the engine on it (migrated, demo installed), its lines kept. */
  async function strictDatabase(settings: Record<string, string>, prepare = '') {
    const dbUrl = await cluster.createDatabase();
    const name = new URL(dbUrl).pathname.slice(1);
    if (prepare) {
      const setup = await cluster.connect(dbUrl);
      await setup.query(prepare);
      await setup.end();
    }
    for (const [setting, value] of Object.entries(settings)) await sql.query(`alter database ${sql.escapeIdentifier(name)} set ${setting} = '${value}'`);
    const { logger, lines } = capturingLogger('info');
    const strict = createPostgresEngine({ connectionString: dbUrl, logger });
    await strict.migrate();
    await strict.installDemo();
    const worker = await strict.startActivator({ workerId: 'strict' });
    const db = await cluster.connect(dbUrl);
    const ended = (tokens: string[], timeoutMs = 30_000) =>
      waitFor(async () => {
        const rows = await strict.getExecutions(tokens);
        return rows.length === tokens.length && rows.every((r) => ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(r.status)) ? rows : null;
      }, timeoutMs, 'the calls to end');
    const close = async () => {
      await worker.close();
      await strict.close();
      await db.end();
    };
    return { strict, db, lines, ended, close };
  }

  it("lock_timeout: the service's own lock waits after a call (its batch's row) are not cut; every call succeeds once", async () => {
    const { strict, db, ended, close } = await strictDatabase({ lock_timeout: '100ms' });
    try {
      const batch = await strict.submitBatch([
        Array.from({ length: 4 }, (_, i) => ({ procedure: 'demo.sleep', arguments: { seconds: 0.3 + i * 0.05 } })),
        [{ procedure: 'demo.record', arguments: { tag: 'after-the-wait' } }],
      ]);
      const first = (await strict.getBatchExecutions(batch.id)).filter((e) => e.procedure === 'demo.sleep').map((e) => e.token);
      await waitFor(async () => ((await strict.getExecutions(first)).every((e) => e.status === 'RUNNING') ? true : null), 10_000, 'the first stage running');
      // someone holds the batch's row while the first stage ends: each end waits for it, far past 100 ms
      await db.query('begin');
      await db.query('select from asyncproc.batches where id = $1 for update', [batch.id]);
      await sleep(1200);
      await db.query('commit');
      const rows = await ended((await strict.getBatchExecutions(batch.id)).map((e) => e.token), 60_000);
      assert.deepEqual(rows.map((r) => [r.status, r.attempts, r.error?.number ?? null]), rows.map(() => ['SUCCEEDED', 1, null]), JSON.stringify(rows.map((r) => r.error)));
      // each ran once: no attempt was lost with a dropped session and run again
      const history = await strict.getHistory(rows.map((r) => r.id));
      assert.deepEqual([...history.values()].flat().map((a) => a.status), rows.map(() => 'SUCCEEDED'));
      assert.equal((await strict.getBatch(batch.id))?.status, 'SUCCEEDED');
      assert.equal(Number((await db.query(`select count(*) from demo.ledger where tag = 'after-the-wait'`)).rows[0].count), 1);
    } finally {
      await db.query('rollback').catch(() => undefined);
      await close();
    }
  });

  it('transaction_timeout and idle_session_timeout: a call longer than the first runs once; idle connections are not cut', async () => {
    const { strict, lines, ended, close } = await strictDatabase({ transaction_timeout: '1s', idle_session_timeout: '1s' });
    let heard = 0;
    const listener = await strict.startListener({ onChange: () => void heard++, onError: () => undefined });
    try {
      const [long] = await strict.submit!([{ procedure: 'demo.sleep', arguments: { seconds: 1.6 } }]);
      const [done] = await ended([long.token]);
      assert.deepEqual([done.status, done.attempts], ['SUCCEEDED', 1], JSON.stringify(done.error));
      // idle past the DBA's limit, then the same connections serve again
      await sleep(2500);
      const [later] = await strict.submit!([{ procedure: 'demo.noop', arguments: {} }]);
      assert.equal((await ended([later.token]))[0].status, 'SUCCEEDED');
      assert.ok(heard > 0);
      const cut = lines.filter((l) => /connection lost|idle pool connection failed|worker slot lost|recovered/.test(l.msg));
      assert.deepEqual(cut.map((l) => l.msg), [], 'no connection of the service was cut');
    } finally {
      await listener.close();
      await close();
    }
  });

  it('output formats: extra_float_digits, bytea_output and IntervalStyle do not change what an outcome says', async () => {
    const { strict, db, ended, close } = await strictDatabase({ extra_float_digits: '-15', bytea_output: 'escape', IntervalStyle: 'sql_standard' });
    try {
      await db.query(`create schema fmt;
        create procedure fmt.values(inout d double precision, inout b bytea, inout i interval) language plpgsql as $$
        begin d := d * 2; b := b || '\\xff'::bytea; i := i * 2; end $$;
        create function fmt.rows() returns table (d double precision, b bytea, i interval) language sql as $$
          select 1234.5678::float8, '\\x00ff'::bytea, interval '1 day 2 hours 3 minutes 4 seconds' $$;`);
      await strict.registerProcedure('fmt.values');
      await strict.registerProcedure('fmt.rows');
      const [proc, func] = await strict.submit!([
        { procedure: 'fmt.values', arguments: { d: 1234.5678, b: '\\x0001', i: '1 day 02:03:04' } },
        { procedure: 'fmt.rows', arguments: {} },
      ]);
      const rows = await ended([proc.token, func.token]);
      // by token: getExecutions keeps no order
      const [p, f] = [proc.token, func.token].map((token) => rows.find((r) => r.token === token)!);
      assert.equal(p.status, 'SUCCEEDED', JSON.stringify(p.error));
      assert.deepEqual(p.result?.outputParameters, { d: 2469.1356, b: '\\x0001ff', i: '2 days 04:06:08' });
      assert.deepEqual(f.result?.rows, [{ d: 1234.5678, b: '\\x00ff', i: '1 day 02:03:04' }]);
    } finally {
      await close();
    }
  });
  it('standard_conforming_strings off: calls, keyed calls and keyed batches are submitted, and keys are checked as ever, in the service and from SQL', async () => {
    const { strict, db, ended, close } = await strictDatabase({ standard_conforming_strings: 'off' });
    try {
      const [dated, keyed] = await strict.submit!([
        // a relative date: the quick test of the arguments for dates (a regular expression) runs
        { procedure: 'demo.date_parts', arguments: { at: 'today' } },
        { procedure: 'demo.noop', arguments: {}, idempotencyKey: 'scs-1' },
      ]);
      assert.equal((await strict.submit!([{ procedure: 'demo.noop', arguments: {}, idempotencyKey: 'scs-1' }]))[0].token, keyed.token);
      const stages = [[{ procedure: 'demo.noop', arguments: {} }], [{ procedure: 'demo.record', arguments: { tag: 'scs' } }]];
      const batch = await strict.submitBatch(stages, { idempotencyKey: 'scs-batch' });
      assert.equal((await strict.submitBatch(stages, { idempotencyKey: 'scs-batch' })).id, batch.id);
      const rows = await ended([dated.token, keyed.token]);
      assert.deepEqual(rows.map((r) => r.status), ['SUCCEEDED', 'SUCCEEDED'], JSON.stringify(rows.map((r) => r.error)));
      // an unknown name: the registry is searched with LIKE, its wildcards escaped
      await assert.rejects(strict.submit!([{ procedure: 'no_such', arguments: {} }]), (e: unknown) => e instanceof EngineError && e.code === 'UNKNOWN_PROCEDURE');
      // a SQL caller's own session, with the setting off, first to run the key's check in it
      await db.query(`select asyncproc.invoke_batch_once('sample-key', '[[{"procedure": "demo.noop"}]]')`);
      await assert.rejects(db.query(`select asyncproc.invoke_batch_once(' x', '[[{"procedure": "demo.noop"}]]')`), { code: 'AP004' });
    } finally {
      await close();
    }
  });

  it("DateStyle 'SQL, DMY' and a far time zone: times are read back, the housekeeping runs, and a date in the arguments is still read day first", async () => {
    const { strict, ended, close } = await strictDatabase({ DateStyle: 'SQL, DMY', TimeZone: 'Pacific/Chatham' });
    try {
      const before = Date.now();
      const [call] = await strict.submit!([{ procedure: 'demo.date_parts', arguments: { at: '01/02/2024' } }]);
      assert.ok(Math.abs(call.submittedAt.getTime() - before) < 60_000, String(call.submittedAt));
      const [row] = await ended([call.token]);
      assert.equal(row.status, 'SUCCEEDED', JSON.stringify(row.error));
      assert.deepEqual(row.result?.outputParameters, { month: 2, day: 1 }, 'the database order of fields: 1 February');
      assert.ok(row.finishedAt && row.finishedAt.getTime() >= row.submittedAt.getTime());
      // the housekeeping reads the database's clock: a call due in a second is released by it
      const [due] = await strict.submit!([{ procedure: 'demo.noop', arguments: {}, runAt: new Date(Date.now() + 1000) }]);
      assert.equal((await ended([due.token]))[0].status, 'SUCCEEDED');
      assert.ok((await strict.listExecutions({}, { first: 5 })).items.length >= 2);
    } finally {
      await close();
    }
  });

  it("look-alike built-ins in a schema first on the service's search_path: every queue slot is its own, and a keyed batch is told from another", async (t) => {
    const { strict, db, ended, close } = await strictDatabase(
      {},
      // (a list: quoted whole, as strictDatabase quotes a value, it would be one schema's name)
      `do $$ begin execute format('alter database %I set search_path = lookalike, public', current_database()); end $$;
       create schema lookalike;
       create function lookalike.hashtextextended(text, integer) returns bigint language sql immutable as 'select 42::bigint';
       create function lookalike.convert_to(text, text) returns bytea language sql immutable as 'select ''\\x00''::bytea';
       create function lookalike.jsonb_build_array(jsonb, text) returns jsonb language sql immutable as 'select ''[]''::jsonb';
       grant usage on schema lookalike to public;`,
    );
    try {
      await strict.configureQueue('wide', 4);
      const calls = await strict.submit!(Array.from({ length: 8 }, () => ({ procedure: 'demo.sleep', arguments: { seconds: 0.4 }, queue: 'wide' })));
      const rows = await ended(calls.map((c) => c.token));
      assert.equal(peakConcurrency(rows), 4, 'four slots, not one lock for all');
      const stages = (tag: string) => [[{ procedure: 'demo.record', arguments: { tag } }]];
      // as a client does: IDEMPOTENCY_KEY_IN_USE is sent again shortly. A refusal reaches the caller when the database
      // reports it, a moment before that transaction's abort lets go of the key's lock (node-pg rejects at the
      // ErrorResponse, not at ReadyForQuery), so a request sent at once after one can find the key still held; a key
      // held for good still fails the test, after 5 s
      const send = async (tag: string, options: { onFailure?: 'CANCEL' | 'CONTINUE' } = {}) => {
        for (let deadline = Date.now() + 5000; ; await sleep(50)) {
          try {
            return await strict.submitBatch(stages(tag), { idempotencyKey: 'look', ...options });
          } catch (error) {
            if (!(error instanceof EngineError && error.code === 'IDEMPOTENCY_KEY_IN_USE') || Date.now() > deadline) throw error;
            // who held it, for whoever reads a run where this happens
            const { rows } = await db.query(
              `select l.pid, l.classid, l.objid, l.objsubid, a.application_name, a.state, left(a.query, 160) as query
                 from pg_locks l join pg_stat_activity a using (pid) where l.locktype = 'advisory' and l.granted`,
            );
            t.diagnostic(`IDEMPOTENCY_KEY_IN_USE for ${tag}; advisory locks held: ${JSON.stringify(rows)}`);
          }
        }
      };
      const first = await send('look-1');
      await assert.rejects(send('look-2'), (e: unknown) => e instanceof EngineError && e.code === 'IDEMPOTENCY_KEY_REUSED');
      await assert.rejects(send('look-1', { onFailure: 'CONTINUE' }), (e: unknown) => e instanceof EngineError && e.code === 'IDEMPOTENCY_KEY_REUSED');
      assert.equal((await send('look-1')).id, first.id);
      const [one] = await strict.submit!([{ procedure: 'demo.add', arguments: { a: 1, b: 1 }, idempotencyKey: 'look-call' }]);
      await assert.rejects(strict.submit!([{ procedure: 'demo.add', arguments: { a: 1, b: 2 }, idempotencyKey: 'look-call' }]), (e: unknown) => e instanceof EngineError && e.code === 'IDEMPOTENCY_KEY_REUSED');
      assert.ok(one.token);
    } finally {
      await close();
    }
  });
});

describe('many subscriptions waiting for the database', () => {
  it('are told about in one log line, not one per subscription and try, and each hears its end once the database is back', async () => {
    const { own, reach } = await outageDatabase();
    const { logger, lines } = capturingLogger('info');
    const hub = new CompletionHub(own, logger);
    await hub.start();
    const listener = await own.startListener(hub);
    let workers: Closeable | null = null;
    try {
      const tokens = (await own.submit(Array.from({ length: 20 }, () => ({ procedure: 'demo.noop', arguments: {} })))).map((e) => e.token);
      await reach(false);
      const heard = tokens.map(async (token) => {
        const values: string[] = [];
        for await (const execution of await hub.completed(token)) values.push(execution.status);
        return values;
      });
      // 20 subscriptions, each trying again after 0.25, 0.5, 1 and 2 s: about 80 failed reads in 3 s
      await new Promise((resolve) => setTimeout(resolve, 3000));
      const waiting = lines.filter((l) => /subscriptions could not read the database/.test(l.msg));
      assert.equal(waiting.length, 1, JSON.stringify(waiting.map((l) => l.msg)));
      assert.equal(waiting[0].level, 40, 'a warning');
      await reach(true);
      workers = await own.startActivator({ workerId: 'after-outage' });
      assert.deepEqual(await Promise.all(heard), tokens.map(() => ['SUCCEEDED']));
      const back = lines.filter((l) => /subscriptions read the database again/.test(l.msg));
      assert.equal(back.length, 1, 'one line when the reads succeed again');
      assert.ok(back[0].failedReads >= 20, `the failed reads since the warning are counted (${back[0].failedReads})`);
    } finally {
      await reach(true);
      await listener.close();
      await hub.close();
      await workers?.close();
      await own.close();
    }
  });
});

describe('the SQL interface for backend services', () => {
  it('asyncproc.invoke enqueues inside the caller transaction and enforces the registry itself', async () => {
    await sql.query('begin');
    const { rows } = await sql.query(`select asyncproc.invoke('demo.add', '{"a": 2, "b": 3}') as token`);
    await sql.query('rollback');
    assert.equal(await engine.getExecution(rows[0].token), null, 'rolled back with the caller');

    for (const [procedure, code] of [
      ['pgtest.unregistered', 'AP001'],
      ['pg_catalog.pg_terminate_backend', 'AP001'],
      ['demo.add; select 1', 'AP001'],
    ]) {
      await assert.rejects(sql.query(`select asyncproc.invoke($1, '{}')`, [procedure]), (e: any) => e.code === code);
    }
    await assert.rejects(sql.query(`select asyncproc.invoke('demo.add', '{"a": "1; drop table demo.ledger", "b": 1}')`), (e: any) => e.code === 'AP002');
    await assert.rejects(sql.query(`select asyncproc.invoke('demo.add', '[1, 2]')`), (e: any) => e.code === 'AP002');
  });
});

describe("invoke(tx, call) on the caller's own transaction (the library)", () => {
  const ledger = async (tag: string) => Number((await sql.query('select count(*) from demo.ledger where tag = $1', [tag])).rows[0].count);

  it("a refused call throws its EngineError and leaves the caller's transaction going: the caller's other writes and calls commit", async () => {
    const { token, refusals } = await engine.withTransaction(async (tx) => {
      await tx.query(`insert into demo.ledger (tag) values ('library-own-write')`);
      const { token } = await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 2 } });
      const refusals: string[] = [];
      for (const call of [
        { procedure: 'demo.add', arguments: { a: 'not a number', b: 2 } },
        { procedure: 'pgtest.unregistered', arguments: {} },
        { procedure: 'demo.add', arguments: { a: 1, b: 2 }, queue: 'no_such_queue' },
        { procedure: 'demo.add', arguments: { a: 1, b: 2 }, maxAttempts: 0 },
      ]) {
        await engine.invoke(tx, call).then(
          () => assert.fail(`accepted: ${JSON.stringify(call)}`),
          (error: EngineError) => refusals.push(error instanceof EngineError ? error.code : `not an EngineError: ${error}`),
        );
      }
      return { token, refusals };
    });
    assert.deepEqual(refusals, ['INVALID_ARGUMENTS', 'UNKNOWN_PROCEDURE', 'UNKNOWN_QUEUE', 'INVALID_ARGUMENTS']);
    assert.equal(await ledger('library-own-write'), 1, "the caller's own write committed");
    assert.ok(await engine.getExecution(token), 'the accepted call committed');
  });

  it("arguments a domain's check refuses as a hard error (its function raises) are INVALID_ARGUMENTS on every path, and nothing is stored; the caller's transaction goes on", async () => {
    await sql.query(`
      create schema if not exists strictargs;
      create function strictargs.positive(n integer) returns boolean language plpgsql as $$
      begin
        if n <= 0 then raise exception 'not a positive amount: %', n; end if;
        return true;
      end $$;
      create domain strictargs.amount as integer check (strictargs.positive(value));
      create procedure strictargs.pay(amount strictargs.amount) language plpgsql as $$ begin end $$;`);
    await engine.registerProcedure('strictargs.pay');
    const count = async () => Number((await sql.query(`select count(*) from asyncproc.executions where procedure = 'strictargs.pay'`)).rows[0].count);
    const refused = (error: unknown) => error instanceof EngineError && error.code === 'INVALID_ARGUMENTS' && /not a positive amount: -5/.test(error.message);
    const bad = { procedure: 'strictargs.pay', arguments: { amount: -5 } };
    const good = { procedure: 'strictargs.pay', arguments: { amount: 5 } };
    await assert.rejects(engine.submit([bad]), refused, 'a single call (the shared statement)');
    await assert.rejects(engine.submit([good, bad]), refused, 'several at once');
    await assert.rejects(engine.submitBatch([[good], [bad]]), refused, 'a batch');
    // racing single calls share statements: the bad one fails alone, the good ones go in
    const racing = await Promise.allSettled([good, bad, good].map((call) => engine.submit([call])));
    assert.deepEqual(racing.map((r) => r.status), ['fulfilled', 'rejected', 'fulfilled']);
    assert.ok(refused((racing[1] as PromiseRejectedResult).reason));
    assert.equal(await count(), 2, 'only the two good racing calls');
    const outcome = await engine.withTransaction(async (tx) => {
      const error = await engine.invoke(tx, bad).then(() => null, (e: unknown) => e);
      const { token } = await engine.invoke(tx, good);
      return { error, token };
    });
    assert.ok(refused(outcome.error), String(outcome.error));
    assert.ok(await engine.getExecution(outcome.token), "the caller's transaction went on and committed its good call");
    assert.equal(await count(), 3);
    // and a schedule of it, checked by the same submit
    await assert.rejects(engine.createSchedule({ name: 'strict-pay', procedure: 'strictargs.pay', arguments: { amount: -5 }, cron: '0 0 1 1 *' }), refused);
    assert.equal(await engine.getSchedule('strict-pay'), null, 'no schedule stored');
  });

  it('what the database cannot take is refused before anything is sent (BAD_USER_INPUT or INVALID_ARGUMENTS), and the transaction goes on', async () => {
    const codes = await engine.withTransaction(async (tx) => {
      const codes: string[] = [];
      const base = { procedure: 'demo.add', arguments: { a: 1, b: 2 } };
      for (const call of [
        { ...base, runAt: 'not a date' },
        { ...base, runAt: new Date(NaN) },
        { ...base, maxAttempts: 1.5 },
        { ...base, procedure: 'demo.add\u0000' },
        { ...base, submittedBy: 'x'.repeat(1_000_001) },
        { ...base, submittedBy: '漢'.repeat(900) }, // 900 characters, 2,700 bytes
        { ...base, callerRoles: 'admin' },
        { ...base, arguments: { a: 1n, b: 2 } },
        { ...base, arguments: { a: 1, b: 2, note: 'half a pair \ud800' } },
        { ...base, arguments: { a: 1, b: 2, note: 'nul \u0000' } },
        // JSON.stringify writes these as null: the call ran with NULL arguments and succeeded
        { ...base, arguments: { a: NaN, b: 2 } },
        { ...base, arguments: { a: 1, b: Infinity } },
        { ...base, arguments: { a: 1, b: 2, list: [1, -Infinity] } },
        null,
      ]) {
        await engine.invoke(tx, call as never).then(
          () => codes.push('accepted'),
          (error: EngineError) => codes.push(error instanceof EngineError ? error.code : `not an EngineError: ${error}`),
        );
      }
      // still usable: a good call goes in
      await engine.invoke(tx, { ...base, runAt: new Date(Date.now() + 3_600_000).toISOString() as never });
      return codes;
    });
    assert.deepEqual(codes, [
      'BAD_USER_INPUT', 'BAD_USER_INPUT', 'BAD_USER_INPUT', 'BAD_USER_INPUT', 'BAD_USER_INPUT', 'BAD_USER_INPUT', 'BAD_USER_INPUT',
      'INVALID_ARGUMENTS', 'INVALID_ARGUMENTS', 'INVALID_ARGUMENTS', 'INVALID_ARGUMENTS', 'INVALID_ARGUMENTS', 'INVALID_ARGUMENTS', 'BAD_USER_INPUT',
    ]);
  });

  it('withTransaction throws when PostgreSQL rolled the transaction back instead of committing it (a failed statement whose error was caught)', async () => {
    let token = '';
    await assert.rejects(
      engine.withTransaction(async (tx) => {
        ({ token } = await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 2 } }));
        await tx.query('select 1 / 0').catch(() => undefined);
      }),
      /rolled back, not committed/,
    );
    assert.equal(await engine.getExecution(token), null, 'nothing committed');
  });
});

describe("pg's process-wide type parsers", () => {
  it('the engine leaves them as they are, and reads its own rows with its own whatever an application set', async () => {
    // importing the engine changed nothing: jsonb is read as pg reads it by default
    assert.equal(pg.types.getTypeParser(pg.types.builtins.JSONB)('{"n": 1}').n, 1);
    assert.equal(typeof pg.types.getTypeParser(pg.types.builtins.JSONB)('{"n": 12345678901234567890}').n, 'number', "pg's own JSON.parse, not the engine's exact reading");
    // an application's parsers of its own: timestamps and jsonb left as text
    const restore = [pg.types.builtins.TIMESTAMPTZ, pg.types.builtins.JSONB, pg.types.builtins.JSON].map((oid) => [oid, pg.types.getTypeParser(oid)] as const);
    for (const [oid] of restore) pg.types.setTypeParser(oid, (value: string) => value);
    try {
      const submitted = await engine.withTransaction((tx) => engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 2 } }));
      assert.ok(submitted.submittedAt instanceof Date, 'a Date, as the types say');
      assert.equal(typeof submitted.arguments, 'object');
      const read = (await engine.getExecution(submitted.token))!;
      assert.ok(read.submittedAt instanceof Date);
      assert.equal(typeof read.arguments, 'object');
    } finally {
      for (const [oid, parse] of restore) pg.types.setTypeParser(oid, parse);
    }
  });
});

describe("the service's named submit statements", () => {
  // prepared once per pooled connection: whatever they check must still be read on every call
  it('honour at once a registration withdrawn, restricted or pointing at a dropped routine, a replaced asyncproc.submit and a revoked EXECUTE', async () => {
    const fresh = await cluster.createDatabase();
    const admin = createPostgresEngine({ connectionString: fresh });
    await admin.migrate();
    await admin.installDemo();
    // one connection: every call below runs on the connection that prepared the statements
    const service = createPostgresEngine({ connectionString: fresh, poolSize: 1 });
    const db = await cluster.connect(fresh);
    const count = async () => Number((await db.query('select count(*) as n from asyncproc.executions')).rows[0].n);
    const call = (procedure: string, args: Record<string, unknown>, callerRoles: string[] | null = null) =>
      ({ procedure, arguments: args, callerRoles }) as InvokeCall;
    const one = (c: InvokeCall) => service.submit([c]);
    const two = (c: InvokeCall) => service.submit([c, c]);
    const refused = async (attempt: () => Promise<unknown>, code: string) => {
      const before = await count();
      await assert.rejects(attempt(), (e: any) => e.code === code);
      assert.equal(await count(), before, `${code}: nothing written`);
    };
    try {
      const add = call('demo.add', { a: 1, b: 2 });
      assert.equal((await one(add)).length, 1);
      assert.equal((await two(add)).length, 2);

      await admin.unregisterProcedure('demo.add');
      await refused(() => one(add), 'UNKNOWN_PROCEDURE');
      await refused(() => two(add), 'UNKNOWN_PROCEDURE');

      await admin.registerProcedure('demo.add', { roles: ['ledger'] });
      await refused(() => one(call('demo.add', { a: 1, b: 2 }, ['billing'])), 'FORBIDDEN');
      await refused(() => two(call('demo.add', { a: 1, b: 2 }, ['billing'])), 'FORBIDDEN');
      assert.equal((await one(call('demo.add', { a: 1, b: 2 }, ['ledger']))).length, 1);

      await db.query('create procedure demo.flip(x integer) language plpgsql as $$ begin end $$');
      await admin.registerProcedure('demo.flip');
      assert.equal((await one(call('demo.flip', { x: 1 }))).length, 1);
      await db.query('drop procedure demo.flip(integer); create procedure demo.flip(x text) language plpgsql as $$ begin end $$');
      await refused(() => one(call('demo.flip', { x: 'a' })), 'UNKNOWN_PROCEDURE');
      await db.query('drop procedure demo.flip(text); create procedure demo.flip(x integer) language plpgsql as $$ begin end $$');
      await refused(() => one(call('demo.flip', { x: 'not a number' })), 'INVALID_ARGUMENTS');
      assert.equal((await one(call('demo.flip', { x: 2 }))).length, 1);

      // another instance's migration replaces the routine: the statements find the new one, never the old
      await db.query(`alter function asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer, text[], text, boolean) rename to submit_old`);
      await assert.rejects(one(add), (e: any) => e.code === '42883');
      await assert.rejects(two(add), (e: any) => e.code === '42883');
      await db.query(await readFile(new URL('../sql/postgres/routines/submit.sql', import.meta.url), 'utf8'));
      await db.query(`drop function asyncproc.submit_old(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer, text[], text, boolean)`);
      await admin.registerProcedure('demo.add');
      assert.equal((await one(add)).length, 1);
      assert.equal((await two(add)).length, 2);
    } finally {
      await service.close();
      await admin.close();
      await db.end();
    }
  });

  it('a role whose EXECUTE on asyncproc.submit is revoked is refused on its next call', async () => {
    const fresh = await cluster.createDatabase();
    const admin = createPostgresEngine({ connectionString: fresh });
    await admin.migrate();
    await admin.installDemo();
    const db = await cluster.connect(fresh);
    const role = `invoker_${process.pid}`;
    await db.query(`create role ${role} login password 'invoker';
      grant usage on schema asyncproc, demo to ${role};
      grant select, insert on all tables in schema asyncproc to ${role};
      grant usage on all sequences in schema asyncproc to ${role};
      grant execute on all routines in schema asyncproc to ${role}`);
    const asRole = new URL(fresh);
    asRole.username = role;
    asRole.password = 'invoker';
    const service = createPostgresEngine({ connectionString: asRole.toString(), poolSize: 1 });
    const add = { procedure: 'demo.add', arguments: { a: 1, b: 2 } } as InvokeCall;
    try {
      assert.equal((await service.submit([add])).length, 1);
      assert.equal((await service.submit([add, add])).length, 2);
      await db.query(`revoke execute on function asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer, text[], text, boolean) from ${role}`);
      await assert.rejects(service.submit([add]), (e: any) => e.code === '42501');
      await assert.rejects(service.submit([add, add]), (e: any) => e.code === '42501');
      assert.equal(Number((await db.query('select count(*) as n from asyncproc.executions')).rows[0].n), 3);
    } finally {
      await service.close();
      await admin.close();
      await db.query(`drop owned by ${role}; drop role ${role}`).catch(() => undefined);
      await db.end();
    }
  });
});

describe('waking the workers', () => {
  // a database of its own, with function statistics, and an engine whose housekeeping tick
  // (which wakes every queue and releases due calls once a second) never comes in the test
  async function quietEngine(): Promise<{ engine: PostgresEngine; url: string; db: pg.Client }> {
    const dbUrl = await cluster.createDatabase();
    const db = await cluster.connect(dbUrl);
    await db.query(`alter database ${db.escapeIdentifier(new URL(dbUrl).pathname.slice(1))} set track_functions = 'pl'`);
    const quiet = createPostgresEngine({ connectionString: dbUrl, tickMs: 600_000 });
    await quiet.migrate();
    await quiet.installDemo();
    await quiet.configureQueue('default', 4);
    return { engine: quiet, url: dbUrl, db };
  }

  it('a call submitted to idle workers is claimed once: no sibling is woken for nothing, and the wake does not come back as a second one', async () => {
    const { engine: quiet, db } = await quietEngine();
    const workers = await quiet.startActivator({ workerId: 'wake' });
    const calls = 20;
    try {
      for (let i = 0; i < calls; i++) {
        const [{ token }] = await quiet.submit([{ procedure: 'demo.noop', arguments: {} }]);
        await waitFor(async () => (await quiet.getExecution(token))?.status === 'SUCCEEDED' || null);
        await new Promise((resolve) => setTimeout(resolve, 50)); // a second claim, if one comes, comes now
      }
    } finally {
      // a session's function statistics reach the view when it ends
      await workers.close();
      await quiet.close();
    }
    const claims = await waitFor(async () => {
      const { rows } = await db.query(`select coalesce(sum(calls), 0)::int as n from pg_stat_user_functions where schemaname = 'asyncproc' and funcname = 'claim'`);
      return rows[0].n >= 2 * calls ? (rows[0].n as number) : null;
    }, 5000, 'the claims to be counted');
    await db.end();
    // each call: the claim that takes it, and the one run() makes for the next call after it
    // (a sibling woken for nothing, or the process's own wake heard back, would add one each)
    // (+ a few: each slot's first look when the pool starts, before any call)
    assert.ok(claims <= 2 * calls + 8, `${claims} claims for ${calls} calls`);
  });

  it('a call due later is started when due by its own timer, not by the next housekeeping tick', async () => {
    const { engine: quiet, db } = await quietEngine();
    await db.end();
    const workers = await quiet.startActivator({ workerId: 'due' });
    try {
      const runAt = new Date(Date.now() + 500);
      const [{ token }] = await quiet.submit([{ procedure: 'demo.noop', arguments: {}, runAt }]);
      const done = await waitFor(async () => {
        const e = await quiet.getExecution(token);
        return e?.status === 'SUCCEEDED' ? e : null;
      }, 5000, 'the due call to run');
      assert.ok(done.startedAt!.getTime() >= runAt.getTime());
    } finally {
      await workers.close();
      await quiet.close();
    }
  });
});

describe("a queue's concurrency lowered while it drains", () => {
  it('applies from the running calls\' ends, not once the queue is empty', async () => {
    await engine.configureQueue('shrink', 4);
    const calls = await engine.submit!(Array.from({ length: 300 }, () => ({ procedure: 'demo.sleep', arguments: { seconds: 0.02 }, queue: 'shrink' })));
    const tokens = calls.map((c) => c.token);
    await waitFor(async () => ((await engine.getExecutions(tokens)).filter((e) => e.status === 'SUCCEEDED').length >= 40 ? true : null), 20_000, 'the drain under way');
    await engine.configureQueue('shrink', 1);
    const lowered = Date.now();
    const rows = await waitFor(async () => {
      const all = await engine.getExecutions(tokens);
      return all.every((e) => e.status === 'SUCCEEDED') ? all : null;
    }, 60_000, 'the drain to end');
    // the calls that started once the change reached the workers (the running ones end within ms)
    const after = rows.filter((r) => r.startedAt!.getTime() >= lowered + 500);
    assert.ok(after.length >= 50, `${after.length} calls started after the change`);
    assert.equal(peakConcurrency(after), 1, 'one call at a time after the limit fell to 1');
    assert.equal(peakConcurrency(rows.filter((r) => r.finishedAt!.getTime() < lowered)), 4, 'four at a time before');
  });
});

describe('a timeout shorter than a round trip', () => {
  it('ends each attempt FAILED with 57014 and retries by maxAttempts; the worker is never taken for lost', async () => {
    await sql.query(`create procedure pgtest.timed_nap() language plpgsql as $$ begin perform pg_sleep(0.3); end $$`);
    await engine.registerProcedure('pgtest.timed_nap', { timeoutMs: 1 });
    const { token, id } = await engine.withTransaction((tx) => engine.invoke(tx, { procedure: 'pgtest.timed_nap', arguments: {}, maxAttempts: 2 }));
    const done = await waitFor(async () => {
      const e = await engine.getExecution(token);
      return e && ['SUCCEEDED', 'FAILED'].includes(e.status) ? e : null;
    }, 30_000, 'the timed-out call to end');
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error?.number, '57014', JSON.stringify(done.error));
    assert.equal(done.attempts, 2);
    const attempts = (await engine.getHistory([id])).get(id) ?? [];
    assert.deepEqual(attempts.map((a) => [a.status, a.error?.number]), [['FAILED', '57014'], ['FAILED', '57014']], JSON.stringify(attempts));
  });

  it('the same for a call that runs outside a transaction: its end is recorded at the first try', async () => {
    await sql.query(`create procedure pgtest.timed_nap_ac() language plpgsql as $$ begin perform pg_sleep(0.3); end $$;
      select asyncproc.register('pgtest.timed_nap_ac', timeout_ms => 1, transactional => false);
      select asyncproc.configure_queue('nap_ac', 1)`);
    // the only worker meanwhile: one whose lines are read
    await activator.close();
    const { logger, lines } = capturingLogger('info');
    const own = createPostgresEngine({ connectionString: url, logger });
    const worker = await own.startActivator({ workerId: 'nap', queues: ['nap_ac'] });
    try {
      const { token } = await engine.withTransaction((tx) => engine.invoke(tx, { procedure: 'pgtest.timed_nap_ac', arguments: {}, queue: 'nap_ac', maxAttempts: 2 }));
      const done = await waitFor(async () => {
        const e = await engine.getExecution(token);
        return e && ['SUCCEEDED', 'FAILED'].includes(e.status) ? e : null;
      }, 30_000, 'the timed-out call to end');
      assert.deepEqual([done.status, done.error?.number, done.attempts], ['FAILED', '57014', 2], JSON.stringify(done.error));
      assert.deepEqual(lines.filter((l) => /recording a non-transactional call failed/.test(l.msg)), [], 'no record of an end was cut');
      assert.equal(lines.filter((l) => l.token === token && l.msg === 'execution started').length, 2, 'this worker ran both attempts');
    } finally {
      await worker.close();
      await own.close();
      activator = await engine.startActivator({ workerId: 'pgtest' });
    }
  });
});

describe('running calls', () => {
  it('a running call is found by its key, never by a walk of the index of every running call', async () => {
    // every call leaves its RUNNING version in executions_active until a vacuum: a lookup through
    // that index walks all of them, and the drain slows down as it goes
    const scans = async () => {
      await new Promise((resolve) => setTimeout(resolve, 1200)); // the workers' statistics reach the cumulative view at most once a second
      const { rows } = await sql.query(`select idx_scan::int as n from pg_stat_user_indexes where indexrelname = 'executions_active'`);
      return rows[0].n as number;
    };
    const calls = 300;
    const before = await scans();
    const tokens = (await engine.submit(Array.from({ length: calls }, () => ({ procedure: 'demo.noop', arguments: {} })))).map((e) => e.token);
    await waitFor(async () => (await engine.getExecutions(tokens)).every((e) => e.status === 'SUCCEEDED') || null, 60_000);
    const walked = (await scans()) - before;
    // the housekeeping tick (recover, queue figures) walks it a few times a second; run, finish and claim never do
    assert.ok(walked < calls / 2, `executions_active scanned ${walked} times for ${calls} calls`);
  });

  it("a failing call's own writes are rolled back (savepoint) and the error recorded", async () => {
    const done = await run('pgtest.write_then_fail', { tag: 'savepoint' });
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error?.number, '22012');
    assert.equal(done.error?.message, 'after writing savepoint');
    assert.equal((await sql.query(`select count(*)::int as n from pgtest.effects where tag = 'savepoint'`)).rows[0].n, 0);
  });

  it("an error's SQLSTATE, detail and line are recorded", async () => {
    const done = await run('pgtest.detailed', {});
    assert.equal(done.status, 'FAILED');
    const { context, ...error } = done.error!;
    assert.deepEqual(error, { number: '22023', message: 'bad thing: the detail', severity: null, state: null, line: 3, detail: 'the detail' });
    assert.match(context!, /^PL\/pgSQL function pgtest\.detailed\(\) line 3 at RAISE/);
  });

  it('arguments convert to every parameter type; defaults may be left out; null is NULL', async () => {
    const done = await run('pgtest.types', {
      n: '12.50',
      ts: '2026-01-02T03:04:05Z',
      flags: [true, false, null],
      doc: { nested: [1, { x: 'y' }] },
      ids: [3, 1, 2],
    });
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    assert.deepEqual(done.result?.outputParameters, {
      echo: {
        n: 12.5,
        ts: '2026-01-02T03:04:05+00:00',
        flags: [true, false, null],
        doc: { nested: [1, { x: 'y' }] },
        ids: [3, 1, 2],
        label: 'none',
      },
    });
    const withNull = await run('pgtest.types', { n: null, ts: null, flags: [], doc: null, ids: null, label: 'given' });
    assert.equal((withNull.result?.outputParameters as any).echo.label, 'given');
    assert.deepEqual((withNull.result?.outputParameters as any).echo.flags, []);
  });

  it('refuses values that do not convert, element by element', async () => {
    for (const args of [
      { n: 'twelve', ts: null, flags: null, doc: null, ids: null },
      { n: 1, ts: 'yesterday-ish', flags: null, doc: null, ids: null },
      { n: 1, ts: null, flags: [true, 'maybe'], doc: null, ids: null },
      { n: 1, ts: null, flags: null, doc: null, ids: [1, [2]] },
      { n: 1, ts: null, flags: null, doc: null, ids: { a: 1 } },
    ]) {
      await assert.rejects(
        engine.withTransaction((tx) => engine.invoke(tx, { procedure: 'pgtest.types', arguments: args })),
        (e: any) => e.code === 'INVALID_ARGUMENTS',
        JSON.stringify(args),
      );
    }
  });

  it('functions: a scalar is the return value; a set is the rows', async () => {
    const twice = await run('pgtest.twice', { x: 21 });
    assert.deepEqual(twice.result, { returnValue: 42, outputParameters: null, rows: null, rowCount: null, truncated: false });
    const series = await run('pgtest.series', { n: 3 });
    assert.deepEqual(series.result?.rows, [
      { i: 1, sq: 1 },
      { i: 2, sq: 4 },
      { i: 3, sq: 9 },
    ]);
    const capped = await run('pgtest.series', { n: 1000 });
    assert.equal((capped.result?.rows as unknown[]).length, 100, 'the first result set is capped');
    assert.equal(capped.result?.rowCount, 1000);
    assert.equal(capped.result?.truncated, true);
  });

  it('registering needs an existing routine; an overloaded name needs its signature', async () => {
    await assert.rejects(engine.registerProcedure('pgtest.nothing'), (e: any) => e.code === 'UNKNOWN_PROCEDURE');
    await sql.query(`create function pgtest.over(a int) returns int language sql as 'select a';
                     create function pgtest.over(a text) returns text language sql as 'select a';`);
    await assert.rejects(engine.registerProcedure('pgtest.over'), (e: any) => {
      assert.equal(e.code, 'BAD_USER_INPUT');
      assert.match(e.message, /overloaded: give one of its signatures: pgtest\.over\(integer\), pgtest\.over\(text\)/);
      return true;
    });
    const registered = await engine.registerProcedure('pgtest.over(text)');
    assert.equal(registered.parameters[0].type, 'text');
  });

  it('a registration with a name that is no routine name, or values out of range, is BAD_USER_INPUT and changes nothing', async () => {
    const before = await engine.listProcedures();
    const refused = async (name: string, options: Parameters<typeof engine.registerProcedure>[1] = {}, codes = ['BAD_USER_INPUT']) =>
      assert.rejects(engine.registerProcedure(name, options), (e: any) => {
        assert.ok(codes.includes(e.code), `${JSON.stringify(name)} ${JSON.stringify(options)}: ${e.code} ${e.message}`);
        return true;
      });
    for (const name of ['', '   ', "demo.add'); drop table demo.ledger; --", 'pg_catalog.count(*)']) await refused(name);
    // the service's own routines are not procedures to run (by name, by signature, in SQL)
    await assert.rejects(engine.registerProcedure('asyncproc.purge'), (e: any) => e.code === 'BAD_USER_INPUT' && /service's own routines/.test(e.message));
    await assert.rejects(sql.query(`select asyncproc.register('asyncproc.recover')`), (e: any) => e.code === 'AP004');
    // looked up, and nothing of that name or signature (each named in the message)
    for (const name of ['a.b.c.d', 'demo.add(no_such_type)', 'demo.add(integer']) await refused(name, {}, ['BAD_USER_INPUT', 'UNKNOWN_PROCEDURE']);
    for (const options of [{ maxAttempts: 0 }, { maxAttempts: 101 }, { maxAttempts: 1.5 }, { timeoutMs: 0 }, { timeoutMs: -1 }, { timeoutMs: 2 ** 31 }]) await refused('demo.add', options);
    assert.deepEqual(await engine.listProcedures(), before, 'nothing changed');
  });

  it('SQL registration by bare name; the signature rule and unqualified names are explained; unregister in SQL', async () => {
    await sql.query(`create procedure pgtest.nap(a int, out b int) language plpgsql as $$ begin b := a; end $$;
                     create procedure public.solo_public() language plpgsql as $$ begin end $$;`);
    const name = async (text: string) => (await sql.query(`select asyncproc.register($1) as name`, [text])).rows[0].name;
    assert.equal(await name('pgtest.nap'), 'pgtest.nap', 'a bare name with one routine is enough');
    await assert.rejects(sql.query(`select asyncproc.register('pgtest.nap(int, int)')`), (e: any) => {
      assert.equal(e.code, 'AP001');
      assert.match(e.hint, /pgtest\.nap\(integer\)/);
      assert.match(e.hint, /OUT parameters are not part of it/);
      return true;
    });
    assert.equal(await name('pgtest.nap(integer)'), 'pgtest.nap');
    assert.equal(await name('solo_public'), 'public.solo_public', 'an unqualified name is found along search_path');
    await assert.rejects(engine.registerProcedure('not_there_at_all'), (e: any) => e.code === 'UNKNOWN_PROCEDURE' && /qualify it with its schema/.test(e.message));
    await assert.rejects(run('solo_public', {}), (e: any) => {
      assert.equal(e.code, 'UNKNOWN_PROCEDURE');
      assert.match(e.message, /did you mean public\.solo_public\?/);
      return true;
    });
    assert.equal((await sql.query(`select asyncproc.unregister('public.solo_public') as name`)).rows[0].name, 'public.solo_public');
    await assert.rejects(run('public.solo_public', {}), (e: any) => e.code === 'UNKNOWN_PROCEDURE');
  });
});

describe('retention', () => {
  it('purges finished history older than the retention, and nothing else', async () => {
    const done = await run('demo.add', { a: 1, b: 1 });
    const { token: pending } = await engine.withTransaction((tx) =>
      engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 1 }, runAt: new Date(Date.now() + 3_600_000) }),
    );
    await sql.query(`update asyncproc.executions set finished_at = now() - interval '8 days' where token = $1`, [done.token]);
    const { rows } = await sql.query(`select asyncproc.purge(interval '7 days') as n`);
    assert.equal(rows[0].n, 1);
    assert.equal(await engine.getExecution(done.token), null);
    assert.equal((await engine.getExecution(pending))?.status, 'WAITING');
  });

  it('purges a batch with all its executions once the batch has ended, never a part of it', async () => {
    const batch = await engine.submitBatch([[{ procedure: 'demo.noop', arguments: {} }], [{ procedure: 'demo.noop', arguments: {} }]]);
    await waitFor(async () => (await engine.getBatch(batch.id))?.status === 'SUCCEEDED');
    const [first] = await engine.getBatchExecutions(batch.id);
    // its first execution is old enough, the batch is not: nothing of it goes
    await sql.query(`update asyncproc.executions set finished_at = now() - interval '8 days' where id = $1`, [first.id]);
    assert.equal((await sql.query(`select asyncproc.purge(interval '7 days') as n`)).rows[0].n, 0);
    assert.equal((await engine.getBatchExecutions(batch.id)).length, 2);
    await sql.query(`update asyncproc.executions set finished_at = now() - interval '8 days' where batch_id = $1`, [batch.id]);
    await sql.query(`update asyncproc.batches set finished_at = now() - interval '8 days' where id = $1`, [batch.id]);
    assert.equal((await sql.query(`select asyncproc.purge(interval '7 days') as n`)).rows[0].n, 2);
    assert.equal(await engine.getBatch(batch.id), null, 'the batch row goes with its executions');
  });
});

describe('retention in small transactions', () => {
  it('one purge call deletes at most max_rows executions, never touches unfinished work', async () => {
    const tag = `purge-${Date.now()}`;
    const calls = Array.from({ length: 25 }, () => ({ procedure: 'demo.record', arguments: { tag } }));
    const executions = await engine.withTransaction(async (tx) => {
      const out: Execution[] = [];
      for (const call of calls) out.push(await engine.invoke(tx, call));
      return out;
    });
    const batch = await engine.submitBatch([[{ procedure: 'demo.noop', arguments: {} }, { procedure: 'demo.noop', arguments: {} }], [{ procedure: 'demo.noop', arguments: {} }]]);
    await waitFor(async () => (await engine.getExecutions(executions.map((e) => e.token))).every((e) => e.status === 'SUCCEEDED'));
    await waitFor(async () => (await engine.getBatch(batch.id))?.status === 'SUCCEEDED');
    const waiting = await engine.withTransaction((tx) =>
      engine.invoke(tx, { procedure: 'demo.noop', arguments: {}, runAt: new Date(Date.now() + 3_600_000) }),
    );
    // everything old but the waiting call (which has not finished: it has no finished_at to age)
    await sql.query(`update asyncproc.executions set finished_at = now() - interval '8 days' where finished_at is not null`);
    await sql.query(`update asyncproc.batches set finished_at = now() - interval '8 days' where finished_at is not null`);
    const purge = async (maxRows: number) => (await sql.query(`select asyncproc.purge(interval '7 days', $1) as n`, [maxRows])).rows[0].n as number;
    const counts: number[] = [];
    for (let n = await purge(10); n > 0; n = await purge(10)) counts.push(n);
    assert.ok(counts.length >= 3, `several small calls: ${counts}`);
    assert.ok(counts.every((n) => n <= 10), `each call at most its budget: ${counts}`);
    assert.ok(counts.slice(0, -1).every((n) => n === 10), `each call but the last fills its budget: ${counts}`);
    assert.equal(await engine.getBatch(batch.id), null, 'the batch went, with its executions');
    assert.equal((await sql.query(`select count(*)::int as n from asyncproc.executions where batch_id = $1`, [batch.id])).rows[0].n, 0);
    assert.equal((await engine.getExecution(waiting.token))?.status, 'WAITING', 'unfinished work stays');
    assert.equal((await sql.query(`select count(*)::int as n from asyncproc.executions where finished_at is not null`)).rows[0].n, 0);
  });

  it('an ended batch larger than the budget goes over several short calls, its row with its last execution', async () => {
    // 100,000 members in one transaction held its locks for over a second while workers ran
    const batch = await engine.submitBatch([[{ procedure: 'demo.noop', arguments: {} }, { procedure: 'demo.noop', arguments: {} }, { procedure: 'demo.noop', arguments: {} }]]);
    await waitFor(async () => (await engine.getBatch(batch.id))?.status === 'SUCCEEDED');
    await sql.query(`update asyncproc.executions set finished_at = now() - interval '8 days' where batch_id = $1`, [batch.id]);
    await sql.query(`update asyncproc.batches set finished_at = now() - interval '8 days' where id = $1`, [batch.id]);
    const members = async () => (await sql.query(`select count(*)::int as n from asyncproc.executions where batch_id = $1`, [batch.id])).rows[0].n;
    for (const left of [2, 1]) {
      assert.equal((await sql.query(`select asyncproc.purge(interval '7 days', 1) as n`)).rows[0].n, 1);
      assert.equal(await members(), left);
      assert.ok(await engine.getBatch(batch.id), 'the batch stays while it has executions');
    }
    assert.equal((await sql.query(`select asyncproc.purge(interval '7 days', 1) as n`)).rows[0].n, 1);
    assert.equal(await engine.getBatch(batch.id), null, 'and goes with the last');
  });
});

describe('SQL interface for batches', () => {
  it('asyncproc.invoke_batch is part of the caller transaction and returns the batch id', async () => {
    const stages = JSON.stringify([[{ procedure: 'demo.record', arguments: { tag: 'sql-batch' } }], [{ procedure: 'demo.record', arguments: { tag: 'sql-batch' } }]]);
    await sql.query('begin');
    const rolledBack = (await sql.query('select asyncproc.invoke_batch($1::jsonb) as id', [stages])).rows[0].id;
    await sql.query('rollback');
    assert.equal(await engine.getBatch(rolledBack), null);
    await sql.query('begin');
    const id = (await sql.query(`select asyncproc.invoke_batch($1::jsonb, 'CONTINUE') as id`, [stages])).rows[0].id;
    await sql.query('commit');
    const done = await waitFor(async () => {
      const batch = await engine.getBatch(id);
      return batch?.status === 'SUCCEEDED' ? batch : null;
    });
    assert.equal(done.onFailure, 'CONTINUE');
    assert.equal((await sql.query(`select count(*)::int as n from demo.ledger where tag = 'sql-batch'`)).rows[0].n, 2);
    await assert.rejects(sql.query(`select asyncproc.invoke_batch('[[]]')`), (e: any) => e.code === 'AP004');
    await assert.rejects(sql.query(`select asyncproc.invoke_batch('[[{"procedure": "demo.noop"}]]', 'SOMETIMES')`), (e: any) => e.code === 'AP004');
  });

  it("a member ended from a caller's own trigger still settles its batch", async () => {
    await sql.query(`create table pgtest.stop_requests (token uuid not null);
      create function pgtest.stop() returns trigger language plpgsql as $$
        begin perform asyncproc.cancel(new.token); return new; end $$;
      create trigger stop after insert on pgtest.stop_requests for each row execute function pgtest.stop();`);
    const batch = await engine.submitBatch([[{ procedure: 'demo.noop', arguments: {}, runAt: new Date(Date.now() + 3_600_000) }]]);
    const [member] = await engine.getBatchExecutions(batch.id);
    await sql.query('insert into pgtest.stop_requests (token) values ($1)', [member.token]);
    assert.equal((await engine.getExecution(member.token))?.status, 'CANCELLED');
    assert.equal((await engine.getBatch(batch.id))?.status, 'CANCELLED', 'its last member ended: the batch ended');
  });
});
