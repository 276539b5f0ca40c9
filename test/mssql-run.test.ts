/**
 * The SQL Server run path (issue 11: strikes, money, dates, a callee that ends its transaction,
 * non-transactional calls, timeouts, error fields, invoke in a distributed transaction), read
 * from the T-SQL of the procedure files and the TypeScript that drives them. No server: the
 * behaviour is checked by the conformance suite when MSSQL_URL is set.
 */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { describe, it } from 'node:test';
import sql from 'mssql';
import { EngineError } from '../src/engine.js';
import { MSSQL_SQL_DIR, readProcedureFiles } from '../src/engines/mssql/migrator.js';
import { ConnectionPool } from '../src/engines/mssql/pool.js';
import { checkRegisterOptions, listProcedures, registerProcedure } from '../src/engines/mssql/procedures.js';

const file = (name: string) => readFile(path.join(MSSQL_SQL_DIR, name), 'utf8');
const procedure = (name: string) => file(`procedures/${name}.sql`);

/** Comments and string literals blanked (same length). */
function codeOnly(text: string): string {
  return text
    .replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' '))
    .replace(/--[^\n]*/g, (m) => ' '.repeat(m.length))
    .replace(/N?'(?:[^']|'')*'/g, (m) => `'${' '.repeat(Math.max(0, m.length - 2))}'`);
}
/** Comments blanked, strings kept. */
const withoutComments = (text: string) =>
  text.replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' ')).replace(/--[^\n]*/g, (m) => ' '.repeat(m.length));

/** A T-SQL LIKE pattern (only literals, % and [ranges]) as a RegExp. */
function likeToRegExp(pattern: string): RegExp {
  let out = '';
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i];
    if (c === '%') out += '[\\s\\S]*';
    else if (c === '[') {
      const end = pattern.indexOf(']', i);
      out += pattern.slice(i, end + 1);
      i = end;
    } else out += c.replace(/[.*+?^${}()|\\]/g, '\\$&');
  }
  return new RegExp(`^${out}$`);
}

describe('mssql run: strikes count consecutive failures that are not transient (item 1)', () => {
  it('logs transient errors as no strike, counts strikes only, and resets them when a message is handled', async () => {
    const text = withoutComments(await procedure('usp_AsyncExecActivated'));
    const transient = /SET @transient = CASE WHEN @errNumber IN \(([^)]*)\) THEN 1 ELSE 0 END;/.exec(text);
    assert.ok(transient, 'a transient list');
    const numbers = transient[1].split(',').map((n) => Number(n.trim()));
    for (const n of [1205, 1222, 9002, 1204]) assert.ok(numbers.includes(n), `${n} is transient`);
    assert.match(text, /INSERT asyncexec\.AsyncExecErrors \([^)]*strike\)\s+VALUES \([^;]*CASE WHEN @transient = 1 THEN 0 ELSE 1 END\);/);
    assert.match(text, /IF @h IS NOT NULL AND @transient = 0\s+AND \(SELECT COUNT\(\*\) FROM asyncexec\.AsyncExecErrors WHERE conversation_handle = @h AND strike = 1\) >= 5\s+EXEC asyncexec\.usp_AsyncExecAbandon/);
    assert.doesNotMatch(text, /message_type_name IS NOT NULL\) >= 5/, 'no longer every error ever logged');
    // the reset commits with the claim
    const reset = text.indexOf('UPDATE asyncexec.AsyncExecErrors SET strike = 0 WHERE conversation_handle = @h AND strike = 1;');
    assert.ok(reset > 0 && reset < text.indexOf('COMMIT TRANSACTION;', reset) && reset > text.indexOf('END CONVERSATION @h;'), 'the strike reset commits with the claim');
    const migration = codeOnly(await file('0011_run.sql'));
    assert.match(migration, /ALTER TABLE asyncexec\.AsyncExecErrors\s+ADD strike bit NULL;/);
  });

  it('never ends a dialog before the outcome commits: a failed abandon keeps the message as a dead letter', async () => {
    const text = withoutComments(await procedure('usp_AsyncExecAbandon'));
    assert.doesNotMatch(text, /END CONVERSATION @h WITH ERROR/, 'the fallback that dropped the messages is gone');
    const endings = [...codeOnly(text).matchAll(/END CONVERSATION/g)];
    assert.equal(endings.length, 1, 'one END CONVERSATION, inside the transaction that records FAILED');
    const catchAt = text.indexOf('BEGIN CATCH');
    assert.ok(endings[0].index! < catchAt && endings[0].index! < text.indexOf('COMMIT TRANSACTION;'), 'the one END CONVERSATION is in the recording transaction');
    const dead = text.slice(catchAt);
    const receive = dead.indexOf('EXEC sys.sp_executesql @deadReceive');
    const insert = dead.indexOf('INSERT asyncexec.AsyncExecDeadLetters');
    assert.ok(dead.indexOf('BEGIN TRANSACTION;') < receive && receive < insert && insert < dead.indexOf('COMMIT TRANSACTION;'), 'RECEIVE and INSERT in one transaction');
    assert.match(text, /@deadReceive = N'RECEIVE TOP \(1\) @x = conversation_handle, @type = message_type_name, @body = message_body FROM asyncexec\.'/);
    assert.match(codeOnly(await file('0011_run.sql')), /CREATE TABLE asyncexec\.AsyncExecDeadLetters \(/);
  });

  it('leaves a RUNNING call’s dialog to its live reader when the other side ends', async () => {
    const text = withoutComments(await procedure('usp_AsyncExecActivated'));
    const branch = text.slice(text.indexOf("IF @type IN (N'http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog'"), text.indexOf("ELSE IF @status IS NULL OR @status IN ('SUCCEEDED'"));
    assert.match(branch, /IF @locked = 1 OR @status IS NULL OR @status NOT IN \('PENDING', 'WAITING', 'RUNNING'\)\s+SET @end = 1;/);
    assert.doesNotMatch(branch.slice(branch.lastIndexOf('END;')), /^\s*END;\s+SET @end = 1;/);
    // a status to a dialog whose other side ended would fail the transaction that records the outcome
    for (const name of ['usp_AsyncExecActivated', 'usp_AsyncExecRun', 'usp_AsyncExecAbandon']) {
      const code = withoutComments(await procedure(name));
      for (const send of code.matchAll(/SEND ON CONVERSATION @h/g)) {
        const before = code.slice(Math.max(0, send.index! - 220), send.index!);
        assert.match(before, /sys\.conversation_endpoints WHERE conversation_handle = @h AND state NOT IN \('DI', 'DO', 'ER', 'CD'\)\)\s+BEGIN\s+$/, name);
      }
    }
  });
});

describe('mssql run: money keeps four decimals (item 5)', () => {
  it('converts money and smallmoney outputs with style 2, other exact numerics without a style', async () => {
    const text = withoutComments(await procedure('usp_AsyncExecRun'));
    assert.match(text, /CASE WHEN base_type IN \(N'money', N'smallmoney'\)\s+THEN CONCAT\(N'CONVERT\(nvarchar\(64\), @p', position, N', 2\)'\)/);
    assert.match(text, /WHEN base_type IN \(N'bigint', N'decimal', N'numeric'\)\s+THEN CONCAT\(N'CONVERT\(nvarchar\(64\), @p', position, N'\)'\)/);
    // no other conversion of a money value to text anywhere in the procedure files
    for (const { file: name } of await readProcedureFiles(path.join(MSSQL_SQL_DIR, 'procedures'))) {
      const code = withoutComments(await file(`procedures/${name}`));
      for (const m of code.matchAll(/N?'money'|N'smallmoney'/g)) {
        const around = code.slice(m.index!, m.index! + 300);
        if (/CONVERT\(nvarchar/.test(around)) assert.match(around, /, 2\)'\)/, `${name}: money to text with style 2`);
      }
    }
  });
});

describe('mssql run: dates are read the same way in the caller’s and the activation’s session (item 6)', () => {
  /** The function's CASE, evaluated for one type (the file is the definition that counts). */
  async function conversion(base: string, typeText: string, value: string, tryIt: boolean): Promise<string> {
    const text = withoutComments(await procedure('ArgumentConversion'));
    const convert = tryIt ? 'TRY_CONVERT(' : 'CONVERT(';
    assert.match(text, /DECLARE @convert nvarchar\(20\) = CASE WHEN @try = 1 THEN N'TRY_CONVERT\(' ELSE N'CONVERT\(' END;/);
    const viaDatetime2 = /WHEN @base_type IN \(N'datetime', N'smalldatetime'\)\s+THEN CONCAT\(@convert, @type_text, N', ', @convert, N'datetime2\(7\), ', @value, N'\)\)'\)/;
    assert.match(text, viaDatetime2);
    assert.match(text, /ELSE CONCAT\(@convert, @type_text, N', ', @value, N'\)'\)/);
    return base === 'datetime' || base === 'smalldatetime' ? `${convert}${typeText}, ${convert}datetime2(7), ${value}))` : `${convert}${typeText}, ${value})`;
  }

  it('generates, for each date and time type, the same conversion on both sides (TRY_ in invoke)', async () => {
    const expected: Array<[string, string, string, string]> = [
      ['datetime', 'datetime', 'CONVERT(datetime, CONVERT(datetime2(7), a.[value]))', 'TRY_CONVERT(datetime, TRY_CONVERT(datetime2(7), @value))'],
      ['smalldatetime', 'smalldatetime', 'CONVERT(smalldatetime, CONVERT(datetime2(7), a.[value]))', 'TRY_CONVERT(smalldatetime, TRY_CONVERT(datetime2(7), @value))'],
      ['datetime2', 'datetime2(3)', 'CONVERT(datetime2(3), a.[value])', 'TRY_CONVERT(datetime2(3), @value)'],
      ['date', 'date', 'CONVERT(date, a.[value])', 'TRY_CONVERT(date, @value)'],
      ['datetimeoffset', 'datetimeoffset(7)', 'CONVERT(datetimeoffset(7), a.[value])', 'TRY_CONVERT(datetimeoffset(7), @value)'],
      ['time', 'time(7)', 'CONVERT(time(7), a.[value])', 'TRY_CONVERT(time(7), @value)'],
    ];
    for (const [base, typeText, run, invoke] of expected) {
      assert.equal(await conversion(base, typeText, 'a.[value]', false), run, base);
      assert.equal(await conversion(base, typeText, '@value', true), invoke, base);
    }
    const run = withoutComments(await procedure('usp_AsyncExecRun'));
    assert.match(run, /CONCAT\(N'SELECT @p', position, N' = ', asyncexec\.ArgumentConversion\(base_type, type_text, N'a\.\[value\]', 0\),/);
    assert.doesNotMatch(run, /N' = CONVERT\(', type_text/, 'no conversion of its own');
    const invoke = withoutComments(await procedure('usp_AsyncExecInvoke'));
    assert.match(invoke, /SET @check = N'SET @ok = CASE WHEN ' \+ asyncexec\.ArgumentConversion\(@base, @typeText, N'@value', 1\) \+ N' IS NULL THEN 0 ELSE 1 END;';/);
    assert.doesNotMatch(invoke, /TRY_CONVERT\(' \+ @typeText/);
    // the function is applied before the procedures that call it
    const order = (await readProcedureFiles(path.join(MSSQL_SQL_DIR, 'procedures'))).map((f) => f.file);
    assert.ok(order.indexOf('ArgumentConversion.sql') < order.indexOf('usp_AsyncExecInvoke.sql'), 'the function comes first in ORDER');
  });

  it('accepts only ISO 8601 forms that no language or DATEFORMAT reads differently', async () => {
    const invoke = withoutComments(await procedure('usp_AsyncExecInvoke'));
    const date = /ELSE IF @base IN \(N'date', N'datetime', N'datetime2', N'datetimeoffset', N'smalldatetime'\)\s+AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'([^']+)'\s+SET @ok = 0;/.exec(invoke);
    const time = /ELSE IF @base = N'time' AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'([^']+)'\s+SET @ok = 0;/.exec(invoke);
    assert.ok(date && time, 'the ISO checks for dates and times');
    const isoDate = likeToRegExp(date[1]);
    for (const ok of ['2024-03-01', '2024-03-01T10:00:00', '2024-03-01 10:00:00.123', '2024-03-01T10:00:00.1234567+01:00']) assert.match(ok, isoDate);
    for (const bad of ['01/03/2024', '03/01/2024', '1 March 2024', 'Mar 1 2024', '20240301', '2024/03/01', '']) assert.doesNotMatch(bad, isoDate);
    const isoTime = likeToRegExp(time[1]);
    assert.match('10:30', isoTime);
    assert.match('10:30:00.5', isoTime);
    assert.doesNotMatch('10.30', isoTime);
    assert.doesNotMatch('10:30 PM'.replace(/^/, 'at '), isoTime);
    // checked before the generic conversion check, so a refused form never reaches TRY_CONVERT
    assert.ok(invoke.indexOf("ELSE IF @base IN (N'date'") < invoke.indexOf('asyncexec.ArgumentConversion(@base'), 'the ISO check precedes the conversion check');
  });
});

describe('mssql run: a callee that ends the transaction it was called in (item 4)', () => {
  it('compares @@TRANCOUNT and the transaction id after the call, records 50014 and never retries', async () => {
    const run = withoutComments(await procedure('usp_AsyncExecRun'));
    const id = run.indexOf('SET @tranId = CURRENT_TRANSACTION_ID();');
    assert.ok(id > run.indexOf('BEGIN TRANSACTION;') && id < run.indexOf('SAVE TRANSACTION AsyncExecCall;'), 'the transaction id is read in the run transaction, before the savepoint');
    const check = run.indexOf('IF @transactional = 1 AND (@@TRANCOUNT = 0 OR CURRENT_TRANSACTION_ID() <> @tranId)');
    assert.ok(check > run.indexOf('EXEC sys.sp_executesql @sql'), 'checked after the call');
    assert.match(run.slice(check, check + 800), /SELECT @ended = 1, @failed = 1, @errNumber = 50014, @errSeverity = 16, @errState = 1,\s+@errLine = NULL, @errProcedure = NULL;/);
    assert.match(run, /SET @status = CASE WHEN @failed = 0 THEN 'SUCCEEDED' WHEN @ended = 1 THEN 'FAILED'/, 'no retry, no matter the attempts left');
    // the savepoint is rolled back to only while the transaction is still ours
    assert.match(run, /IF @transactional = 1 AND XACT_STATE\(\) = 1 AND CURRENT_TRANSACTION_ID\(\) = @tranId\s+ROLLBACK TRANSACTION AsyncExecCall;/);
    // a transaction the callee began after ending ours is rolled back before the outcome
    assert.match(run, /IF XACT_STATE\(\) = -1 OR \(@ended = 1 AND @@TRANCOUNT > 0\) OR \(@transactional = 0 AND @@TRANCOUNT > 0\)\s+ROLLBACK TRANSACTION;/);
  });
});

describe('mssql run: calls that run outside a transaction (item 8)', () => {
  it('adds the column to the registry and the calls, and registers, lists and refuses it in TypeScript', async () => {
    const migration = codeOnly(await file('0011_run.sql'));
    assert.match(migration, /ALTER TABLE asyncexec\.AsyncExecProcedures\s+ADD transactional bit NOT NULL CONSTRAINT DF_AsyncExecProcedures_transactional DEFAULT \(1\);/);
    assert.match(migration, /ALTER TABLE asyncexec\.AsyncExecResults\s+ADD transactional bit NULL;/);
    const register = withoutComments(await procedure('usp_AsyncExecRegister'));
    assert.match(register, /@transactional\s+bit = 1\s+AS/);
    assert.match(register, /transactional = @transactional/);
    assert.match(register, /INSERT asyncexec\.AsyncExecProcedures \([^)]*transactional\)\s+VALUES \([^)]*@transactional\);/);
    assert.throws(() => checkRegisterOptions({ transactional: 'no' as unknown as boolean }), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT');

    const seen: Array<Record<string, unknown>> = [];
    const execute = sql.Request.prototype.execute;
    const query = sql.Request.prototype.query;
    sql.Request.prototype.execute = async function (this: sql.Request) {
      seen.push(Object.fromEntries(Object.entries(this.parameters as Record<string, { value: unknown }>).map(([k, v]) => [k, v.value])));
      return { recordset: [{ name: 'etl.usp_Load' }], output: {} };
    } as unknown as typeof execute;
    sql.Request.prototype.query = async function () {
      return { recordset: [{ name: 'etl.usp_Load', queue: 'default', max_attempts: 1, timeout_ms: null, roles: '[]', transactional: false, position: null, parameter: null, type_text: null, is_output: null, has_default: null }] };
    } as unknown as typeof query;
    const pool = { request: () => new sql.Request() } as unknown as sql.ConnectionPool;
    try {
      const registered = await registerProcedure(pool, 'etl.usp_Load', { transactional: false });
      assert.equal(seen[0].transactional, false);
      assert.equal(registered.transactional, false, 'read back from the registry, not a placeholder');
      await registerProcedure(pool, 'etl.usp_Load');
      assert.equal(seen[1].transactional, true, 'transactional unless asked otherwise');
      assert.equal((await listProcedures(pool))[0].transactional, false);
    } finally {
      sql.Request.prototype.execute = execute;
      sql.Request.prototype.query = query;
    }
  });

  it('runs a non-transactional call with no transaction open, records the outcome after, and fails a lost one (50015)', async () => {
    const run = withoutComments(await procedure('usp_AsyncExecRun'));
    assert.match(run, /@transactional = COALESCE\(e\.transactional, 1\)/);
    // the only BEGIN TRANSACTION before the call is the transactional one
    const call = run.indexOf('EXEC sys.sp_executesql @sql');
    const before = run.slice(run.indexOf('BEGIN TRY'), call);
    assert.match(before, /IF @transactional = 1\s+BEGIN\s+BEGIN TRANSACTION;/);
    assert.equal([...before.matchAll(/BEGIN TRANSACTION;/g)].length, 1);
    assert.match(before, /IF @transactional = 1\s+SAVE TRANSACTION AsyncExecCall;/);
    // after the call: a fresh transaction for the outcome, which locks the dialog first
    assert.match(run.slice(call), /END;\s+IF @@TRANCOUNT = 0\s+BEGIN\s+BEGIN TRANSACTION;\s+BEGIN CONVERSATION TIMER \(@h\) TIMEOUT = @lease;\s+SET @fresh = 1;\s+END;/);
    // the outcome is written only by the run that holds the call
    assert.match(run, /WHERE id = @id AND status = 'RUNNING' AND session_id = @@SPID;/);

    const claim = withoutComments(await procedure('usp_AsyncExecActivated'));
    assert.match(claim, /WHEN @status = 'RUNNING' AND @transactional = 0 THEN 'FAILED'/);
    assert.ok(claim.indexOf("WHEN @status = 'RUNNING' AND @transactional = 0 THEN 'FAILED'") < claim.indexOf("ELSE 'RUNNING' END;"), 'a lost non-transactional run is failed, not run again');
    assert.match(claim, /error_number = CASE WHEN @newStatus = 'FAILED' AND @transactional = 0 THEN 50015/);
    assert.match(claim, /transactional = CASE WHEN @newStatus = 'RUNNING' THEN @registeredTransactional ELSE transactional END,/);
    // the lock that gives exclusion outlives the claim's transaction
    assert.match(claim, /sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0;/);
  });
});

describe('mssql run: timeoutMs (item 6 of the brief, 10 of the issue)', () => {
  it('is refused on SQL Server, in TypeScript and in usp_AsyncExecRegister, and cleared from old registrations', async () => {
    for (const timeoutMs of [500, 0, -1]) {
      assert.throws(() => checkRegisterOptions({ timeoutMs }), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT' && /KILL/.test(e.message));
    }
    checkRegisterOptions({ timeoutMs: null });
    checkRegisterOptions({});
    // registerProcedure refuses before anything reaches the server
    const pool = { request: () => assert.fail('no request for a refused registration') } as unknown as sql.ConnectionPool;
    await assert.rejects(registerProcedure(pool, 'demo.sleep', { timeoutMs: 500 }), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT');
    const register = withoutComments(await procedure('usp_AsyncExecRegister'));
    assert.match(register, /IF @timeoutMs IS NOT NULL\s+BEGIN\s+SET @message = N'timeoutMs is not supported on SQL Server[^;]*;\s+SET @message = REPLACE\(@message, N'%', N'%%'\);\s+THROW 50005, @message, 1;/);
    assert.match(codeOnly(await file('0011_run.sql')), /UPDATE asyncexec\.AsyncExecProcedures SET timeout_ms = NULL WHERE timeout_ms IS NOT NULL;/);
  });
});

describe('mssql register: the service’s own procedures', () => {
  it('are refused (50005, BAD_USER_INPUT) once the name is resolved, before anything is written', async () => {
    const register = withoutComments(await procedure('usp_AsyncExecRegister'));
    const guard = /SELECT @refused = asyncexec\.AsyncExecRefusedProcedure\(@object\);\s+IF @refused IS NOT NULL\s+BEGIN\s+(?:SET @message = [^;]*;\s+)+THROW 50005, @message, 1;\s+END;/.exec(register);
    assert.ok(guard, 'the guard on the resolved procedure');
    // the function it asks refuses the service's schema first
    const refusal = withoutComments(await readFile(new URL('../sql/mssql/procedures/AsyncExecRefusedProcedure.sql', import.meta.url), 'utf8'));
    assert.match(refusal, /IF @schema = N'asyncexec'\s+RETURN N'one of the service''s own procedures \(schema asyncexec\)';/);
    assert.ok(guard.index > register.indexOf('SELECT @schema = OBJECT_SCHEMA_NAME(@object)'), 'after the name is resolved to its schema');
    assert.ok(guard.index < register.search(/\b(INSERT|MERGE|UPDATE)\b/), 'before any write');
  });

  it('a procedure whose schema or name holds a "." is refused (50005) before anything is written: [a.b].[c] and [a].[b.c] were both a.b.c', async () => {
    const register = withoutComments(await procedure('usp_AsyncExecRegister'));
    const guard = /IF CHARINDEX\(N'\.', @schema\) > 0 OR CHARINDEX\(N'\.', @name\) > 0\s+BEGIN\s+(?:SET @message = [^;]*;\s+)+THROW 50005, @message, 1;\s+END;/.exec(register);
    assert.ok(guard, 'the guard on the resolved names');
    assert.ok(guard.index > register.indexOf('SELECT @schema = OBJECT_SCHEMA_NAME(@object)'), 'after the name is resolved to its schema');
    assert.ok(guard.index < register.search(/\b(INSERT|MERGE|UPDATE)\b/), 'before any write');
  });
});

describe('mssql run: error fields of the machinery’s failures (item 7)', () => {
  it('clears error_line and error_procedure with 50010, 50011 and 50015', async () => {
    const claim = withoutComments(await procedure('usp_AsyncExecActivated'));
    assert.match(claim, /error_number = 50011, error_severity = 16, error_state = 1,\s+error_line = NULL, error_procedure = NULL,/);
    assert.match(claim, /error_line = CASE WHEN @newStatus = 'FAILED' THEN NULL ELSE error_line END,/);
    assert.match(claim, /error_procedure = CASE WHEN @newStatus = 'FAILED' THEN NULL ELSE error_procedure END,/);
    // every UPDATE that sets a machinery error number also sets both fields
    for (const name of ['usp_AsyncExecActivated', 'usp_AsyncExecAbandon']) {
      const code = withoutComments(await procedure(name));
      for (const update of code.matchAll(/UPDATE asyncexec\.AsyncExecResults\s+SET([\s\S]*?)(?:OUTPUT|WHERE)/g)) {
        if (!/error_number/.test(update[1])) continue;
        assert.match(update[1], /error_line =/, `${name}: error_line`);
        assert.match(update[1], /error_procedure =/, `${name}: error_procedure`);
      }
    }
  });
});

describe('mssql run: invoke inside a distributed transaction (item 10 of the issue)', () => {
  it('takes no savepoint under XACT_ABORT ON, and goes on without one after 627 in a distributed transaction', async () => {
    const invoke = withoutComments(await procedure('usp_AsyncExecInvoke'));
    assert.match(
      invoke,
      /IF @trancount = 0\s+BEGIN TRANSACTION;\s+ELSE IF @@OPTIONS & 16384 = 0\s+BEGIN\s+BEGIN TRY\s+SAVE TRANSACTION usp_AsyncExecInvoke;\s+SET @saved = 1;\s+END TRY\s+BEGIN CATCH\s+IF ERROR_NUMBER\(\) <> 627 OR XACT_STATE\(\) <> 1\s+BEGIN\s+THROW;\s+END;\s+END CATCH;\s+END;/,
    );
    assert.match(invoke, /ELSE IF XACT_STATE\(\) = 1 AND @trancount > 0 AND @saved = 1\s+ROLLBACK TRANSACTION usp_AsyncExecInvoke;/);
  });
});

describe('mssql invoke: idempotency keys (0017_idempotency_keys.sql; the conformance suite runs them with MSSQL_URL)', () => {
  it("takes the key's application lock without waiting (-1: 50017; other faults: 50025), reads without waiting (LOCK_TIMEOUT 0: 1222 is 50017), at READ COMMITTED, from the key row alone, and refuses another call with 50016", async () => {
    const replay = codeOnly(await procedure('usp_AsyncExecReplay'));
    assert.match(replay, /SET TRANSACTION ISOLATION LEVEL READ COMMITTED;\s+SET LOCK_TIMEOUT 0;/);
    assert.match(withoutComments(await procedure('usp_AsyncExecReplay')), /IF @lock = 1\s+BEGIN\s+EXEC @lockResult = sys\.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;\s+IF @lockResult < -1\s+BEGIN[\s\S]*?THROW 50025, @message, 1;\s+END;\s+IF @lockResult = -1\s+SET @inUse = 1;/);
    assert.match(replay, /@resource nvarchar\(32\) =/, 'within the 32 characters sys.dm_tran_locks shows');
    assert.match(replay, /SELECT @id = k\.execution_id, @token = k\.execution_token, @madeDigest = k\.request_digest\s+FROM asyncexec\.AsyncExecIdempotencyKeys AS k\s+WHERE k\.scope = @scope AND k\.idempotency_key = @key;/);
    assert.match(replay, /IF ERROR_NUMBER\(\) <> 1222\s+BEGIN\s+THROW;\s+END;\s+SET @inUse = 1;/);
    assert.match(replay, /IF @inUse = 1\s+BEGIN[\s\S]*?THROW 50017, @message, 1;/);
    assert.doesNotMatch(replay, /AsyncExecResults|HOLDLOCK|UPDLOCK/, 'the key row alone, and no range held');
    assert.match(replay, /IF @madeDigest <> @digest\s+BEGIN[\s\S]*THROW 50016, @message, 1;/);
  });

  it('answers a replay before any check of the call, checks again under the key\'s lock inside the transaction, and records the key with the call', async () => {
    const invoke = codeOnly(await procedure('usp_AsyncExecInvoke'));
    const early = invoke.indexOf('EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @id = @madeId OUTPUT, @token = @madeToken OUTPUT;');
    const locked = invoke.indexOf('EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @lock = 1, @id = @madeId OUTPUT, @token = @madeToken OUTPUT;');
    assert.ok(early > 0 && early < invoke.indexOf('FROM asyncexec.AsyncExecProcedures AS r'), 'the first, before the registration is read');
    const tryAt = invoke.indexOf('BEGIN TRY\n        IF @idempotencyKey IS NOT NULL\n');
    assert.ok(tryAt > 0 && locked > tryAt && locked < invoke.indexOf('SET @token = NEWID();'), 'the second, first in the TRY, under the lock');
    const results = invoke.indexOf('INSERT asyncexec.AsyncExecResults');
    const key = invoke.indexOf('INSERT asyncexec.AsyncExecIdempotencyKeys (scope, idempotency_key, execution_id, execution_token, request_digest)');
    assert.ok(results > 0 && key > results && key < invoke.indexOf('BEGIN CATCH', key), 'the key is written after the call, in the same TRY');
    // a replay is told apart (@replayed): 0 unless one of the two replay answers returns
    assert.match(invoke, /@replayed\s+bit = NULL OUTPUT\s+WITH EXECUTE AS OWNER/);
    assert.ok(invoke.indexOf('SET @replayed = 0;') > 0 && invoke.indexOf('SET @replayed = 0;') < early, 'cleared before the first answer');
    assert.equal(invoke.split('SELECT @id = @madeId, @token = @madeToken, @replayed = 1;').length - 1, 2, 'both replay answers say so');
    // a parameter one longer than a key, passed on to one as long: a longer value is cut to 129 and
    // refused, never cut to a valid key on the way
    assert.match(invoke, /@idempotencyKey nvarchar\(129\) = NULL/);
    const replay = codeOnly(await procedure('usp_AsyncExecReplay'));
    assert.match(replay, /@key\s+nvarchar\(129\),/);
    assert.match(replay, /IF @key IS NULL OR DATALENGTH\(@key\) NOT BETWEEN 2 AND 256 OR DATALENGTH\(@key\) <> DATALENGTH\(RTRIM\(@key\)\)\s+OR UNICODE\(@key\) = 32\s+BEGIN[\s\S]*?THROW 50005, @message, 1;/);
    assert.ok(replay.indexOf('THROW 50005') < replay.indexOf('sp_getapplock'), 'the rules before anything else');
  });

  it("a batch's key (0018): checked and read under its lock inside the caller's transaction, apart from calls' keys; a replay writes nothing", async () => {
    const create = codeOnly(await procedure('usp_AsyncExecBatchCreate'));
    // the key and the digest one longer than they may be: a longer one is refused, not cut to a valid one
    assert.match(create, /@idempotencyKey nvarchar\(129\) = NULL,\s+@requestDigest\s+varbinary\(33\) = NULL,\s+@replayedBatchId uniqueidentifier = NULL OUTPUT/);
    const transaction = create.indexOf('IF @@TRANCOUNT = 0');
    const replay = create.indexOf('EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @lock = 1, @batch = 1, @batchId = @replayedBatchId OUTPUT;');
    const batch = create.indexOf('INSERT asyncexec.AsyncExecBatches');
    const key = create.indexOf('INSERT asyncexec.AsyncExecBatchIdempotencyKeys (scope, idempotency_key, batch_id, request_digest)');
    assert.ok(transaction > 0 && replay > transaction && batch > replay && key > batch, 'a transaction, then the key under its lock, then the batch and its key');
    // a replay leaves @batchId NULL: a caller that invokes its calls anyway is refused, never adds them to the first batch
    assert.match(create.slice(replay, batch), /IF @replayedBatchId IS NOT NULL\s+RETURN;/);
    assert.match(create, /SELECT @batchId = NULL, @replayedBatchId = NULL;/);
    assert.doesNotMatch(create, /(SET|SELECT) @batchId = @replayedBatchId/);
    // the stored digest covers the stage count and the policy as well as the caller's digest
    assert.match(withoutComments(await procedure('usp_AsyncExecBatchCreate')), /SET @digest = HASHBYTES\('SHA2_256', CONCAT\(CONVERT\(nvarchar\(68\), @requestDigest, 1\), NCHAR\(31\), @stageCount, NCHAR\(31\), @onFailure\)\);/);
    assert.match(create, /IF @requestDigest IS NULL OR DATALENGTH\(@requestDigest\) <> 32\s+BEGIN[\s\S]*?THROW 50005/);
    const replayProc = codeOnly(await procedure('usp_AsyncExecReplay'));
    assert.match(replayProc, /IF @batch = 1\s+SELECT @batchId = k\.batch_id, @madeDigest = k\.request_digest\s+FROM asyncexec\.AsyncExecBatchIdempotencyKeys AS k\s+WHERE k\.scope = @scope AND k\.idempotency_key = @key;/);
    // a batch's key never names a call's lock: its hashed text begins with a letter, a call's with its scope's length
    assert.match(withoutComments(await procedure('usp_AsyncExecReplay')), /CONCAT\(CASE WHEN @batch = 1 THEN N'b' END, LEN\(@scope\), N':', RTRIM\(@scope\), NCHAR\(1\), @key\)/);
    const table = codeOnly(await file('0018_batch_idempotency_keys.sql'));
    assert.match(table, /scope\s+nvarchar\(256\)\s+COLLATE Latin1_General_100_BIN2 NOT NULL/);
    assert.match(table, /idempotency_key\s+nvarchar\(128\)\s+COLLATE Latin1_General_100_BIN2 NOT NULL/);
    assert.match(table, /REFERENCES asyncexec\.AsyncExecBatches \(id\) ON DELETE CASCADE/);
  });

  it('keeps keys in a table of their own, compared under a binary collation, purged with their call', async () => {
    const table = codeOnly(await file('0017_idempotency_keys.sql'));
    assert.match(table, /scope\s+nvarchar\(256\)\s+COLLATE Latin1_General_100_BIN2 NOT NULL/);
    assert.match(table, /idempotency_key\s+nvarchar\(128\)\s+COLLATE Latin1_General_100_BIN2 NOT NULL/);
    assert.match(table, /REFERENCES asyncexec\.AsyncExecResults \(id\) ON DELETE CASCADE/);
    assert.doesNotMatch(table, /\bWHERE\b/, 'no filtered index');
  });
});

describe('mssql pools: no connection is handed out again with a transaction left open', () => {
  it("mssql checks each connection it hands out through the pool's _poolValidate, which the engine's pools replace with a check of @@TRANCOUNT", async () => {
    // a request cut by its requestTimeout inside a procedure run with XACT_ABORT OFF leaves its
    // transaction open (src/engines/mssql/pool.ts); the conformance suite runs it (MSSQL_URL)
    const base = await readFile(createRequire(import.meta.url).resolve('mssql').replace(/index\.js$/, 'lib/base/connection-pool.js'), 'utf8');
    assert.match(base, /validate: this\._poolValidate\.bind\(this\)/, "mssql's pool of connections validates through _poolValidate");
    assert.equal(Object.getPrototypeOf(ConnectionPool.prototype), sql.ConnectionPool.prototype);
    assert.ok(Object.hasOwn(ConnectionPool.prototype, '_poolValidate'));
    assert.match(await readFile(new URL('../src/engines/mssql/pool.ts', import.meta.url), 'utf8'), /new tedious\.Request\('SELECT @@TRANCOUNT AS open_transactions;'/);
    // and at once when a request gives back a connection whose transaction tedious heard begin and never end
    assert.ok(Object.hasOwn(ConnectionPool.prototype, 'release'));
    assert.match(base, /^  release \(connection\) \{/m, "mssql's pool has the release its requests call");
    const requests = await readFile(createRequire(import.meta.url).resolve('mssql').replace(/index\.js$/, 'lib/tedious/request.js'), 'utf8');
    assert.match(requests, /this\.parent\.release\(connection\)/, 'a request gives its connection back through its parent, the pool');
    // every pool of the engine but the migrator's (no requestTimeout: nothing is cut) is one
    for (const name of ['index.ts', 'listener.ts']) {
      const source = await readFile(new URL(`../src/engines/mssql/${name}`, import.meta.url), 'utf8');
      assert.doesNotMatch(source, /new sql\.ConnectionPool\(/, name);
      assert.match(source, /new ConnectionPool\(/, name);
    }
    assert.match(await readFile(new URL('../src/engines/mssql/migrator.ts', import.meta.url), 'utf8'), /new sql\.ConnectionPool\(\{ \.\.\.config, requestTimeout: 0,/);
  });
});

describe('mssql queues: configureQueue', () => {
  it('a queue registered already keeps the names it was made with (its service is named case-sensitively), read after the lock and before any is used', async () => {
    const text = codeOnly(await procedure('usp_AsyncExecCreateQueue'));
    const lookup = text.search(/SELECT @name = q\.name, @queueObject = q\.queue_object, @service = q\.service_name, @reader = q\.activation_procedure\s+FROM asyncexec\.AsyncExecQueues AS q\s+WHERE q\.name = @name;/);
    assert.ok(lookup > 0, 'the registered names are read');
    assert.ok(lookup > text.indexOf('IF @lock < 0'), 'under the configuration lock');
    assert.ok(lookup < text.indexOf('OBJECT_ID('), 'before the reader, the queue and the service are looked for');
  });
});

describe('mssql queues: pausing (0019_queue_pause.sql; the conformance suite runs it with MSSQL_URL)', () => {
  it("the reader starts no call of a paused queue: it reads the flag under the call's lock, arms the timer and writes nothing; a lost run, a cancel and the rules before them still apply", async () => {
    const reader = codeOnly(await procedure('usp_AsyncExecActivated'));
    const read = reader.indexOf('SELECT @paused = paused FROM asyncexec.AsyncExecQueues WHERE name = @queue;');
    assert.ok(read > reader.indexOf('FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)'), 'read after the call, under its lock');
    const plain = withoutComments(await procedure('usp_AsyncExecActivated'));
    const cases = plain.slice(plain.indexOf('SET @newStatus = CASE', read), plain.indexOf("ELSE 'RUNNING' END;", read));
    assert.match(cases, /WHEN @status IN \('PENDING', 'WAITING'\) AND @paused = 1 THEN 'PAUSED'\s*$/, 'the last rule before RUNNING');
    for (const rule of ['WHEN @cancel = 1', 'THEN \'FAILED\'', 'AND @transactional = 0']) {
      assert.ok(cases.indexOf(rule) >= 0 && cases.indexOf(rule) < cases.indexOf('AND @paused = 1'), `${rule} comes first`);
    }
    assert.match(plain, /ELSE IF @newStatus = 'PAUSED'\s+SET @timer = 300;\s+ELSE\s+BEGIN\s+SET @now = SYSUTCDATETIME\(\);\s+UPDATE asyncexec\.AsyncExecResults/, 'a timer, and no UPDATE');
    assert.match(plain, /@transient = 0, @paused = NULL;/, 'cleared for each message');
  });

  it('pause and resume take the configuration lock and commit the flag first; a resume of a paused queue then wakes its waiting calls with an open dialog, each SEND alone under a savepoint, within a budget', async () => {
    const text = withoutComments(await procedure('usp_AsyncExecPauseQueue'));
    assert.match(text, /WITH EXECUTE AS OWNER/, 'the dialogs are visible to it whoever calls');
    assert.match(text, /SET XACT_ABORT ON;/);
    const lock = text.indexOf("EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/configure-queue', @LockMode = 'Exclusive',");
    const update = text.indexOf('UPDATE asyncexec.AsyncExecQueues SET paused = @paused OUTPUT deleted.paused INTO @was (paused) WHERE name = @name;');
    const notFound = text.indexOf('THROW 50006, @message, 1;');
    const commit = text.indexOf('COMMIT TRANSACTION;');
    const onlyResume = text.indexOf('IF @paused = 1 OR NOT EXISTS (SELECT 1 FROM @was WHERE paused = 1)');
    const abortOff = text.indexOf('SET XACT_ABORT OFF;');
    const deadline = text.indexOf('SET @deadline = DATEADD(millisecond, @budgetMs, SYSUTCDATETIME());');
    const send = text.indexOf('SEND ON CONVERSATION @initiator MESSAGE TYPE [asyncexec/Request] (@body);');
    assert.ok(lock > 0 && update > lock && notFound > update && commit > notFound, 'lock, flag, refusal, commit');
    assert.ok(onlyResume > commit && abortOff > onlyResume && deadline > abortOff && send > deadline, 'then, only for a real resume, the wake-ups, timed from the commit');
    assert.match(text, /WHERE e\.queue = @name AND e\.id > @after AND e\.held = 0 AND e\.initiator_handle IS NOT NULL\s+AND \(e\.status = 'PENDING' OR \(e\.status = 'WAITING' AND e\.run_at <= SYSUTCDATETIME\(\)\)\)/);
    // the dialog's state read again just before its SEND, which is made alone under a savepoint
    assert.match(text, /SELECT @state = state FROM sys\.conversation_endpoints WHERE conversation_handle = @initiator;\s+IF @state NOT IN \('SO', 'CO'\) OR @state IS NULL\s+CONTINUE;/);
    assert.match(text, /SAVE TRANSACTION usp_AsyncExecPauseQueue;\s+BEGIN TRY\s+SEND ON CONVERSATION/);
    assert.match(text, /ELSE IF XACT_STATE\(\) = 1\s+ROLLBACK TRANSACTION usp_AsyncExecPauseQueue;\s+INSERT asyncexec\.AsyncExecErrors/, 'to the savepoint only while the transaction is open');
    assert.match(text, /IF @@TRANCOUNT = 0\s+RETURN;\s+END CATCH;/, 'no transaction left: the wake-ups stop');
    assert.match(text, /IF @paused IS NULL OR @chunk IS NULL OR @chunk < 1 OR @budgetMs IS NULL OR @budgetMs < 1/);
    // the same resource as usp_AsyncExecCreateQueue's: one change of a queue's settings at a time
    assert.match(withoutComments(await procedure('usp_AsyncExecCreateQueue')), /@Resource = N'asyncexec\/configure-queue'/);
    assert.match(await file('procedures/ORDER'), /^usp_AsyncExecPauseQueue\.sql$/m);
    assert.match(codeOnly(await file('0019_queue_pause.sql')), /ALTER TABLE asyncexec\.AsyncExecQueues ADD paused bit NOT NULL CONSTRAINT DF_AsyncExecQueues_paused DEFAULT \(0\);/);
  });
});

describe('mssql procedures: a CATCH returns to its savepoint only while the transaction is open', () => {
  it('every ROLLBACK TRANSACTION to a savepoint inside a CATCH is reached only with XACT_STATE() = 1 (doomed or ended, it would raise 3903 or 3931 from inside the CATCH)', async () => {
    const files = await readProcedureFiles(path.join(MSSQL_SQL_DIR, 'procedures'));
    let checked = 0;
    for (const { file: name, text: source } of files) {
      const text = codeOnly(source);
      for (const rollback of text.matchAll(/ROLLBACK TRANSACTION (\w+);/g)) {
        const before = text.slice(0, rollback.index);
        const inCatch = before.lastIndexOf('BEGIN CATCH') > before.lastIndexOf('END CATCH');
        if (!inCatch) continue;
        const catchSoFar = before.slice(before.lastIndexOf('BEGIN CATCH'));
        const guarded = /IF XACT_STATE\(\) <> 1\s+BEGIN\s+THROW;\s+END;\s*$/.test(catchSoFar) || /XACT_STATE\(\) = 1[^\n;]*\n\s*$/.test(catchSoFar);
        assert.ok(guarded, `${name}: ROLLBACK TRANSACTION ${rollback[1]} in a CATCH not guarded by XACT_STATE() = 1`);
        checked += 1;
      }
    }
    assert.ok(checked >= 7, `${checked} savepoint rollbacks checked`);
  });
});
