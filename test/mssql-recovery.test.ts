/**
 * Issue 11, items 2, 3 and 10, and the SQL Server side of issue 13's purge, without a server:
 * the T-SQL text of the procedure files (the definitions that count) and the TypeScript that
 * schedules around them. conformance.ts holds the engine-level cases.
 */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { describe, it } from 'node:test';
import sql from 'mssql';
import { killGate, killPermits, killStep, mssqlCancelSteps, Semaphore, type KillConnections } from '../src/engines/mssql/cancel.js';
import { mssqlCancelBatchSteps } from '../src/engines/mssql/cancelBatch.js';
import { DEADLOCK_VICTIM, isDeadlockVictim, retryDeadlocks } from '../src/engines/mssql/deadlock.js';
import { errorNumber } from '../src/engines/mssql/errors.js';
import { MssqlEngine } from '../src/engines/mssql/index.js';
import { MSSQL_SQL_DIR, readProcedureFiles } from '../src/engines/mssql/migrator.js';
import { parseMssqlUrl } from '../src/engines/mssql/url.js';
import { purgeHistory, Sweeper, type RecoveryReport, type SweeperSteps } from '../src/engines/mssql/sweeper.js';
import { silentLogger } from '../src/logger.js';

const PROCEDURES = path.join(MSSQL_SQL_DIR, 'procedures');

/** A procedure file: `text` as written, `sql` without comments, `code` without comments and strings (same offsets). */
async function procedure(name: string): Promise<{ text: string; sql: string; code: string }> {
  const text = await readFile(path.join(PROCEDURES, `${name}.sql`), 'utf8');
  const sqlText = text.replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' ')).replace(/--[^\n]*/g, (m) => ' '.repeat(m.length));
  const code = sqlText.replace(/N?'(?:[^']|'')*'/g, (m) => `'${' '.repeat(Math.max(0, m.length - 2))}'`);
  return { text, sql: sqlText, code };
}

/** Every statement `UPDATE asyncexec.AsyncExecResults … ;` of a text without comments. */
const resultUpdates = (sqlText: string) => [...sqlText.matchAll(/UPDATE asyncexec\.AsyncExecResults\b[^;]*;/g)].map((m) => ({ at: m.index!, text: m[0] }));

const deadlock = () => {
  const error = new sql.RequestError('Transaction (Process ID 61) was deadlocked on lock resources with another process and has been chosen as the deadlock victim. Rerun the transaction.', 'EREQUEST');
  error.number = DEADLOCK_VICTIM;
  return error;
};

/** Replace sql.Request.prototype.execute while `fn` runs. */
async function withExecute<T>(execute: (this: sql.Request, procedure: string) => Promise<unknown>, fn: () => Promise<T>): Promise<T> {
  const original = sql.Request.prototype.execute;
  sql.Request.prototype.execute = execute as unknown as typeof original;
  try {
    return await fn();
  } finally {
    sql.Request.prototype.execute = original;
  }
}

describe('mssql recovery: a batch cancel and a claim take locks in one order (item 3)', () => {
  it('usp_AsyncExecBatchCancelUnstarted reads its candidates without update locks, then updates each by primary key, status checked again', async () => {
    const { sql: text, code } = await procedure('usp_AsyncExecBatchCancelUnstarted');
    const read = text.search(/INSERT @candidates \(id\)\s+SELECT id FROM asyncexec\.AsyncExecResults\s+WHERE batch_id = @batchId AND status IN \('WAITING', 'PENDING'\);/);
    assert.ok(read > 0, 'the candidates are read into @candidates');
    assert.doesNotMatch(text.slice(read, text.indexOf(';', read)), /UPDLOCK|XLOCK|HOLDLOCK/, 'with no update lock');
    const updates = resultUpdates(text);
    assert.equal(updates.length, 1);
    const [update] = updates;
    assert.ok(update.at > read, 'updated after the read');
    assert.match(update.text, /WHERE id = @id AND batch_id = @batchId AND status IN \('WAITING', 'PENDING'\);$/, 'by primary key, status checked again');
    assert.doesNotMatch(code, /UPDATE asyncexec\.AsyncExecResults[^;]*WHERE batch_id = /, 'never an UPDATE that seeks the batch index');
    // one UPDATE per candidate, in a loop over @candidates
    assert.match(text, /SELECT TOP \(1\) @id = id FROM @candidates WHERE id > @id ORDER BY id;\s+IF @@ROWCOUNT = 0\s+BREAK;\s+UPDATE asyncexec\.AsyncExecResults/);
  });

  it('corrects the comment of usp_AsyncExecCancelBatch, saying why 0008 keeps the old one', async () => {
    const { text } = await procedure('usp_AsyncExecCancelBatch');
    assert.match(text, /A claim \(PENDING or due WAITING to RUNNING\) never asks for the batch row, but it DOES take\s+-- locks step 2 needs/);
    assert.match(text, /Migrations never\s+-- change once landed, so 0008 keeps that text/);
    assert.doesNotMatch(text, /the only member-row locks we can wait for are a claim's\s+-- \(PENDING to RUNNING/, 'the wrong claim is gone');
  });
});

describe('mssql recovery: deadlock victims are run again, never reported (item 3)', () => {
  it('reruns a 1205 with growing, jittered pauses and then gives up with an error that is no 1205', async () => {
    const pauses: number[] = [];
    let runs = 0;
    const result = await retryDeadlocks(
      async () => {
        if (++runs < 3) throw deadlock();
        return 'done';
      },
      { sleep: async (ms) => void pauses.push(ms), random: () => 0.5, baseMs: 20 },
    );
    assert.equal(result, 'done');
    assert.deepEqual(pauses, [20, 40], 'base, then doubled (×(0.5 + random))');

    runs = 0;
    const error = await retryDeadlocks(
      async () => {
        runs++;
        throw deadlock();
      },
      { sleep: async () => undefined, attempts: 4 },
    ).catch((e: unknown) => e);
    assert.equal(runs, 4);
    assert.ok(error instanceof Error && !(error instanceof sql.RequestError));
    assert.equal(errorNumber(error), undefined, 'the client never sees 1205');
    assert.ok(isDeadlockVictim((error as Error).cause));

    // anything else at once, unchanged
    runs = 0;
    const other = new sql.RequestError('nope', 'EREQUEST');
    other.number = 50007;
    await assert.rejects(retryDeadlocks(async () => { runs++; throw other; }, { sleep: async () => undefined }), (e) => e === other);
    assert.equal(runs, 1);
  });

  it('cancelBatch and cancelExecution run their procedures again after a deadlock', async () => {
    const calls: string[] = [];
    let failures = 2;
    await withExecute(
      async function (procedure) {
        calls.push(procedure);
        if (failures-- > 0) throw deadlock();
        return procedure === 'asyncexec.usp_AsyncExecCancelBatch'
          ? { output: { outcome: 'CANCELLED' } }
          : { output: { id: '7', status: 'CANCELLED' }, recordset: [] };
      },
      async () => {
        const pool = new sql.ConnectionPool({ server: 'localhost' }); // never connected: execute is replaced
        assert.equal(await mssqlCancelBatchSteps(pool, 'abcdef01-2345-6789-abcd-ef0123456789').cancel(), 'CANCELLED');
        assert.deepEqual(calls, Array(3).fill('asyncexec.usp_AsyncExecCancelBatch'));
        calls.length = 0;
        failures = 1;
        assert.deepEqual(await mssqlCancelSteps(pool, 'abcdef01-2345-6789-abcd-ef0123456789', true).request(), { id: '7', status: 'CANCELLED' });
        assert.deepEqual(calls, Array(2).fill('asyncexec.usp_AsyncExecCancel'));
        calls.length = 0;
        failures = 1;
        await mssqlCancelSteps(pool, 'abcdef01-2345-6789-abcd-ef0123456789', true).settle('7');
        assert.deepEqual(calls, Array(2).fill('asyncexec.usp_AsyncExecSettleCancel'));
      },
    );
  });
});

describe("mssql: the engine's word on which errors pass by themselves", () => {
  const requestError = (number: number, message = `error ${number}`) => {
    const error = new sql.RequestError(message, 'EREQUEST');
    error.number = number;
    return error;
  };

  it('a connection refused, lost or timed out, a deadlock, a database not open yet may; a missing object, a permission, a refused login do not', async () => {
    // a real driver error: nothing listens on port 1
    const pool = new sql.ConnectionPool({ server: '127.0.0.1', port: 1, user: 'sa', password: 'x', options: { trustServerCertificate: true }, connectionTimeout: 5000 });
    const refused = await pool.connect().then(
      () => assert.fail('connected to port 1'),
      (error: unknown) => error,
    );
    await pool.close().catch(() => undefined);
    assert.ok(refused instanceof sql.ConnectionError, String(refused));
    const engine = new MssqlEngine({ url: 'mssql://sa:x@127.0.0.1:1/db' });
    try {
      assert.equal(engine.isTransient(refused), true, `${(refused as sql.ConnectionError).code}: ${String(refused)}`);
      for (const number of [1205, 1222, 4060, 40613, -2]) assert.equal(engine.isTransient(requestError(number)), true, `error ${number}`);
      assert.equal(engine.isTransient(new sql.RequestError('Timeout: Request failed to complete in 15000ms', 'ETIMEOUT')), true);
      assert.equal(engine.isTransient(new sql.ConnectionError('Connection is closed.', 'ECONNCLOSED')), true);
      // a deadlock victim that retryDeadlocks gave up on: its cause says so
      assert.equal(engine.isTransient(new Error('gave up', { cause: deadlock() })), true);

      for (const number of [208, 229, 2627, 50001, 8134]) assert.equal(engine.isTransient(requestError(number)), false, `error ${number}`);
      assert.equal(engine.isTransient(new sql.ConnectionError("Login failed for user 'sa'.", 'ELOGIN')), false);
      assert.equal(engine.isTransient(new TypeError('x is undefined')), false);
      assert.equal(engine.isTransient('oops'), false);
    } finally {
      await engine.close().catch(() => undefined);
    }
  });
});

describe('mssql recovery: concurrent cancels cannot exhaust the pool (item 10)', () => {
  /** A pool of `size` connections: acquire waits in line for a free one. */
  function fakePool(size: number) {
    let free = size;
    const waiting: Array<() => void> = [];
    const acquire = async () => {
      if (free > 0) free--;
      else await new Promise<void>((resolve) => waiting.push(resolve));
    };
    const release = () => {
      const next = waiting.shift();
      if (next) next();
      else free++;
    };
    const tick = () => new Promise((resolve) => setTimeout(resolve, 1));
    const connections: KillConnections = {
      async hold() {
        await acquire(); // BEGIN TRANSACTION on one connection, the row held
        await tick();
        return { row: { status: 'RUNNING', session_id: 60 }, release: async () => release() };
      },
      async kill() {
        await acquire(); // usp_AsyncExecKill on a second connection
        await tick();
        release();
        return true;
      },
    };
    return connections;
  }
  /** Whether `n` concurrent kill steps behind `gate` finish within `ms` against a pool of `size`. */
  async function finishes(n: number, size: number, gate: Semaphore, ms = 2000): Promise<boolean> {
    const connections = fakePool(size);
    const all = Promise.all(Array.from({ length: n }, (_, i) => killStep(connections, gate, String(i), new Set())));
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<false>((resolve) => (timer = setTimeout(() => resolve(false), ms)));
    const done = await Promise.race([all.then(() => true as const), timeout]);
    clearTimeout(timer);
    return done;
  }

  it('N concurrent kill steps finish with a pool of k behind the gate of k - 1 (and would wait for ever without it)', async () => {
    for (const k of [2, 3, 10]) {
      for (const n of [1, k - 1, k, 3 * k]) {
        assert.ok(await finishes(n, k, new Semaphore(killPermits(k))), `${n} cancels, pool of ${k}`);
      }
    }
    // the hazard is real: k steps, each holding one of k connections, all waiting for a second
    assert.equal(await finishes(10, 10, new Semaphore(10), 300), false, 'without the gate they wait for ever');
  });

  it('sizes the gate from the pool and shares it among all cancels of one pool', () => {
    assert.equal(killPermits(10), 9);
    assert.equal(killPermits(2), 1);
    assert.equal(killPermits(1), 1);
    const pool = new sql.ConnectionPool({ server: 'localhost', pool: { max: 4 } });
    assert.equal(killGate(pool).permits, 3);
    assert.equal(killGate(pool), killGate(pool), 'one gate per pool');
  });

  it('a kill step holds the row while it kills, releases it whatever happens, and kills a session once', async () => {
    const events: string[] = [];
    const killed = new Set<number>();
    const connections: KillConnections = {
      async hold(id) {
        events.push(`hold ${id}`);
        return { row: { status: 'RUNNING', session_id: 61 }, release: async () => void events.push('release') };
      },
      async kill(_id, session) {
        events.push(`kill ${session}`);
        return true;
      },
    };
    const gate = new Semaphore(1);
    await killStep(connections, gate, '5', killed);
    await killStep(connections, gate, '5', killed);
    assert.deepEqual(events, ['hold 5', 'kill 61', 'release', 'hold 5', 'release']);
    await assert.rejects(killStep({ ...connections, kill: async () => { throw new Error('refused'); } }, gate, '6', new Set()), /refused/);
    assert.equal(events.at(-1), 'release');
    assert.ok(await Promise.race([gate.use(async () => true), new Promise((r) => setTimeout(() => r(false), 100))]), 'the permit came back');
  });
});

describe('mssql recovery: usp_AsyncExecCreateQueue gives up before its caller does (item 10)', () => {
  it('waits for its lock less than the driver waits for the request', async () => {
    const { code } = await procedure('usp_AsyncExecCreateQueue');
    const timeout = Number(/sp_getapplock[^;]*@LockTimeout = (\d+);/.exec(code)?.[1]);
    // the service sets no requestTimeout of its own: mssql's default, 15000 ms, applies
    assert.equal(parseMssqlUrl('mssql://u:p@h/db').config.requestTimeout, undefined);
    const driverDefault = 15_000;
    assert.ok(timeout > 0 && timeout <= driverDefault - 5000, `@LockTimeout = ${timeout} leaves the request time to report 50020`);
    assert.match(code, /SET XACT_ABORT ON;/, 'an attention rolls the transaction back');
  });
});

describe('mssql recovery: retention purge in bounded batches (issue 13, SQL Server)', () => {
  it('deletes calls and batches in transactions of their own, @batchSize at a time, until @maxSeconds', async () => {
    const { sql: text, code } = await procedure('usp_AsyncExecPurge');
    assert.match(text, /@batchSize int = 1000,/);
    assert.match(text, /SET XACT_ABORT ON;/);
    const refuse = text.search(/IF @@TRANCOUNT > 0\s+BEGIN\s+(?:SET @message = [^;]+;\s+)+THROW 50041, @message, 1;/);
    assert.ok(refuse > 0 && refuse < code.indexOf('DELETE'), 'refused inside a transaction, before anything is deleted');
    const deletes = [...code.matchAll(/\bDELETE\b(?!\s+@)(?:\s+TOP \(@batchSize\))?\s+(FROM asyncexec\.\w+|\w+)/g)];
    assert.equal(deletes.length, 3, 'calls, batches, the error log');
    for (const [statement, target] of deletes) {
      const at = code.indexOf(statement);
      if (target === 'e' || target === 'b') {
        // chosen first (TOP (@batchSize)), then deleted by key, inside BEGIN … COMMIT of its own
        const begin = code.lastIndexOf('BEGIN TRANSACTION', at);
        assert.ok(begin > code.lastIndexOf('SELECT TOP (@batchSize)', at) && code.lastIndexOf('SELECT TOP (@batchSize)', at) > 0, `${target}: chosen then deleted`);
        assert.ok(code.indexOf('COMMIT TRANSACTION', at) < code.indexOf('END;', at), `${target}: committed within its round`);
        assert.match(code.slice(at, code.indexOf(';', at)), /JOIN @\w+ AS \w+ ON \w+\.id = \w+\.id/, `${target}: by key`);
        assert.match(code.slice(code.lastIndexOf('WHILE', at), at), /IF SYSUTCDATETIME\(\) >= @deadline\s+BEGIN\s+SET @more = 1;\s+BREAK;/, `${target}: time-bounded`);
      } else {
        assert.match(statement, /DELETE TOP \(@batchSize\) FROM asyncexec\.AsyncExecErrors/);
      }
    }
    assert.equal((code.match(/BEGIN TRANSACTION/g) ?? []).length, 2);
    assert.match(text, /SELECT @deleted AS deleted, @more AS more;/);
  });

  it('never takes an unfinished call nor any call of a batch that has not ended before the cutoff', async () => {
    const { sql: text } = await procedure('usp_AsyncExecPurge');
    const choose = text.slice(text.indexOf('INSERT @ids (id)'), text.indexOf('BEGIN TRANSACTION'));
    assert.match(choose, /e\.finished_at < @cutoff AND e\.status IN \('SUCCEEDED', 'FAILED', 'CANCELLED'\)/);
    assert.match(choose, /AND \(e\.batch_id IS NULL\s+OR EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecBatches AS b WHERE b\.id = e\.batch_id AND b\.finished_at < @cutoff\)\)/);
    assert.match(text, /DELETE e\s+OUTPUT deleted\.row_version INTO @gone \(row_version\)\s+FROM asyncexec\.AsyncExecResults AS e\s+JOIN @ids AS i ON i\.id = e\.id\s+WHERE e\.status IN \('SUCCEEDED', 'FAILED', 'CANCELLED'\);/);
    // the purge horizon rises in the transaction that deletes (a resume from before it: CURSOR_EXPIRED)
    const batch = text.slice(text.indexOf('DELETE e'), text.indexOf('COMMIT TRANSACTION', text.indexOf('DELETE e')));
    assert.match(batch, /UPDATE h SET row_version = g\.newest\s+FROM asyncexec\.AsyncExecPurgeHorizon AS h[\s\S]+WHERE h\.only_row = 1 AND h\.row_version < g\.newest;/);
    assert.match(text, /DELETE b\s+FROM asyncexec\.AsyncExecBatches AS b\s+JOIN @batches AS x ON x\.id = b\.id\s+WHERE b\.status IN \('SUCCEEDED', 'FAILED', 'CANCELLED'\)\s+AND NOT EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecResults AS e WHERE e\.batch_id = b\.id\);/);
  });

  it('engine.purge calls the procedure again while it reports more, and stops when asked', async () => {
    const answers = [{ deleted: 1000, more: true }, { deleted: 1000, more: true }, { deleted: 7, more: false }];
    const asked: number[] = [];
    assert.equal(await purgeHistory(async (s) => (asked.push(s), answers.shift()!), 90_500), 2007);
    assert.deepEqual(asked, [90, 90, 90]);
    let rounds = 0;
    assert.equal(await purgeHistory(async () => (rounds++, { deleted: 1, more: true }), 0, () => rounds >= 2), 2);
  });
});

describe('mssql recovery: calls whose dialog is gone get a new one (item 2)', () => {
  it('defines a dialog as gone when its target side is missing or closed and nothing of it waits for delivery', async () => {
    const { sql: text } = await procedure('AsyncExecDialogGone');
    assert.match(text, /CREATE OR ALTER FUNCTION asyncexec\.AsyncExecDialogGone \(@initiator uniqueidentifier, @target uniqueidentifier\)\s+RETURNS TABLE/);
    assert.match(text, /WHERE NOT EXISTS \(SELECT 1\s+FROM sys\.conversation_endpoints AS t\s+WHERE t\.state <> 'CD'/);
    assert.match(text, /t\.conversation_handle = @target\s+OR \(@target IS NULL AND t\.is_initiator = 0\s+AND t\.conversation_id = \(SELECT i\.conversation_id FROM sys\.conversation_endpoints AS i\s+WHERE i\.conversation_handle = @initiator\)\)/);
    assert.match(text, /AND NOT EXISTS \(SELECT 1 FROM sys\.transmission_queue AS q WHERE q\.conversation_handle = @initiator\);/);
    const order = (await readProcedureFiles(PROCEDURES)).map((f) => f.file);
    assert.ok(order.indexOf('AsyncExecDialogGone.sql') < order.indexOf('usp_AsyncExecRecover.sql'));
  });

  it('picks unfinished, unheld calls whose dialog is gone, skipping rows others hold, as owner', async () => {
    const { sql: text } = await procedure('usp_AsyncExecRecover');
    assert.match(text, /CREATE OR ALTER PROCEDURE asyncexec\.usp_AsyncExecRecover\s+@limit\s+int = 500,[^\n]*\n\s+@minAgeSeconds int = 5[^\n]*\nWITH EXECUTE AS OWNER\nAS/);
    const candidates = text.slice(text.indexOf('INSERT @candidates (id)'), text.indexOf('ORDER BY e.id;'));
    assert.match(candidates, /FROM asyncexec\.AsyncExecResults AS e WITH \(READPAST\)/);
    assert.match(candidates, /e\.status IN \('PENDING', 'WAITING', 'RUNNING'\) AND e\.held = 0/);
    assert.match(candidates, /e\.submitted_at < DATEADD\(second, -@minAgeSeconds, SYSUTCDATETIME\(\)\)/);
    assert.match(candidates, /EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecDialogGone\(e\.initiator_handle, e\.target_handle\)\)/);
    assert.match(text, /IF @@TRANCOUNT > 0\s+BEGIN\s+(?:SET @message = [^;]+;\s+)+THROW 50042, @message, 1;/);
  });

  it('under the call’s application lock (never waited for) and its row, checks again, then begins a dialog and sends the request as invoke does', async () => {
    const { sql: text, code } = await procedure('usp_AsyncExecRecover');
    const loop = text.indexOf('BEGIN TRANSACTION');
    const lock = text.indexOf("EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;", loop);
    assert.ok(lock > loop, 'the application lock, zero timeout');
    assert.match(text.slice(lock), /^[^;]+;\s+IF @lock < 0\s+BEGIN\s+ROLLBACK TRANSACTION;\s+SET @skipped \+= 1;\s+CONTINUE;/, 'a live reader holds it: leave the call');
    const row = text.indexOf('FROM asyncexec.AsyncExecResults AS e WITH (UPDLOCK, ROWLOCK)', lock);
    assert.ok(row > lock, 'then the row, UPDLOCK');
    const recheck = text.slice(lock, row);
    assert.match(recheck, /@lost = CASE WHEN e\.status IN \('PENDING', 'WAITING', 'RUNNING'\) AND e\.held = 0\s+AND EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecDialogGone\(e\.initiator_handle, e\.target_handle\)\)/);
    assert.match(text.slice(row), /IF @lost = 0\s+BEGIN\s+ROLLBACK TRANSACTION;/);
    // the dialog and the request exactly as usp_AsyncExecInvoke's
    const invoke = (await procedure('usp_AsyncExecInvoke')).sql;
    const normal = (s: string) => s.replace(/\s+/g, ' ').trim();
    for (const statement of [/BEGIN DIALOG CONVERSATION @h[^;]*;/, /SET @body = [^;]*;/, /SEND ON CONVERSATION @h MESSAGE TYPE \[asyncexec\/Request\] \(@body\);/]) {
      const ours = statement.exec(text.slice(row))?.[0];
      assert.ok(ours, `${statement}`);
      assert.equal(normal(ours), normal(statement.exec(invoke)![0]));
    }
    const dialog = text.indexOf('BEGIN DIALOG CONVERSATION @h', row);
    const updates = resultUpdates(text);
    assert.equal(updates.length, 1);
    assert.ok(updates[0].at > dialog && updates[0].at < text.indexOf('SEND ON CONVERSATION @h', dialog));
    assert.match(updates[0].text, /SET initiator_handle = @h, target_handle = NULL\s+WHERE id = @id;/, 'no status change: the reader decides');
    assert.ok(text.indexOf('COMMIT TRANSACTION', dialog) > text.indexOf('SEND ON CONVERSATION @h', dialog));
    assert.doesNotMatch(code, /WITH\s+CLEANUP/i, 'never WITH CLEANUP in application code');
    assert.doesNotMatch(code, /usp_AsyncExecBatchSettle|AsyncExecBatches/, 'no status change, no batch lock');
  });

  it('logs what it cannot recover without a message type (never counted as a reader’s strike on a dialog)', async () => {
    const { sql: text } = await procedure('usp_AsyncExecRecover');
    for (const m of text.matchAll(/INSERT asyncexec\.AsyncExecErrors \(([^)]*)\)/g)) assert.doesNotMatch(m[1], /message_type_name/);
    assert.match(text, /SELECT @examined AS examined, @recovered AS recovered, @skipped AS skipped, @failed AS failed;/);
  });
});

describe('mssql recovery: the sweeper (item 2)', () => {
  const report = (recovered = 0): RecoveryReport => ({ examined: recovered, recovered, skipped: 0, failed: 0 });

  it('recovers at start, then on its period, one sweep at a time; failures are logged, never thrown; close stops it', async () => {
    let recovers = 0;
    let purges = 0;
    let concurrent = 0;
    let most = 0;
    const steps: SweeperSteps = {
      async recover() {
        recovers++;
        most = Math.max(most, ++concurrent);
        await new Promise((resolve) => setTimeout(resolve, 5));
        concurrent--;
        if (recovers === 2) throw new Error('server gone');
        return report(1);
      },
      async purge() {
        purges++;
        return 0;
      },
    };
    const sweeper = new Sweeper(steps, { logger: silentLogger, periodMs: 20, purgePeriodMs: 60_000 });
    await sweeper.start();
    assert.equal(recovers, 1, 'swept before start() resolves');
    await Promise.all([sweeper.sweep(), sweeper.sweep()]);
    await new Promise((resolve) => setTimeout(resolve, 120));
    await sweeper.close();
    const after = recovers;
    assert.ok(after >= 4, `kept sweeping on its period, past a failure (${after})`);
    assert.equal(most, 1, 'never two sweeps at once');
    assert.equal(purges, 1, 'the purge on its own, longer period');
    await new Promise((resolve) => setTimeout(resolve, 60));
    assert.equal(recovers, after, 'nothing after close');
  });

  it('is started once per engine by the activator and the listener together, and stopped with the last', async () => {
    const asked: string[] = [];
    await withExecute(
      async function (procedure) {
        asked.push(procedure);
        return { recordset: [{ examined: 0, recovered: 0, skipped: 0, failed: 0, deleted: 0, more: false }], output: {} };
      },
      async () => {
        const engine = new MssqlEngine({ url: 'mssql://u:p@localhost/db', sweepPeriodMs: 60_000 });
        const first = await engine.startActivator({ workerId: 'a' });
        const second = await engine.startActivator({ workerId: 'b' });
        assert.equal(asked.filter((p) => p === 'asyncexec.usp_AsyncExecRecover').length, 1, 'one sweeper, swept at start');
        assert.ok(asked.includes('asyncexec.usp_AsyncExecPurge'), 'the first sweep purges too');
        await first.close();
        await second.close();
        // a new user starts a new sweeper (the old one stopped)
        const third = await engine.startActivator({ workerId: 'c' });
        assert.equal(asked.filter((p) => p === 'asyncexec.usp_AsyncExecRecover').length, 2);
        await third.close();
        await engine.pool.close();
      },
    );
  });
});
