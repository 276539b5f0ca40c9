/**
 * The SQL Server engine's pure TypeScript: GO splitting, DATABASE_URL parsing,
 * JSON ⇄ SQL value mapping, cursors and error mapping. No server is involved; the
 * engine itself is tested against a real SQL Server by conformance.mssql.ts.
 */
import assert from 'node:assert/strict';
import { mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { describe, it } from 'node:test';
import sql from 'mssql';
import { EngineError, type Batch, type BatchStatus, type Execution, type ExecutionStatus, type InvokeCall } from '../src/engine.js';
import { splitBatches } from '../src/engines/mssql/batches.js';
import { runCancel, type CancelRequestStatus, type CancelSteps } from '../src/engines/mssql/cancel.js';
import { cancelBatch, runCancelBatch, type CancelBatchOutcome, type CancelBatchSteps } from '../src/engines/mssql/cancelBatch.js';
import { mapDatabaseError } from '../src/engines/mssql/errors.js';
import { enqueue } from '../src/engines/mssql/invoke.js';
import { batchDigest, checkBatch, submitBatch, toBatch, type BatchRow } from '../src/engines/mssql/executionBatches.js';
import { countExecutions, listExecutions, listRunning, readChanges, toExecution, type ExecutionRow } from '../src/engines/mssql/executions.js';
import { canonicalExecutionId, getHistory, toAttempt, type AttemptRow } from '../src/engines/mssql/history.js';
import { changedProcedures, MSSQL_SQL_DIR, readProcedureFiles, type ProcedureFile } from '../src/engines/mssql/migrator.js';
import { checkQueueSettings, checkRecentSeconds, configureQueue, toQueueInfo } from '../src/engines/mssql/procedures.js';
import {
  cursorFromRowversion,
  decodeResult,
  encodeArguments,
  fromSqlOutput,
  parameterMode,
  rowversionFromCursor,
  rowversionOf,
  rowversionValue,
  toSqlJson,
} from '../src/engines/mssql/types.js';
import { parseMssqlUrl } from '../src/engines/mssql/url.js';

describe('mssql: GO batch splitting', () => {
  const texts = (script: string) => splitBatches(script).map((b) => b.text.trim());

  it('splits on GO lines, in any case, with blanks around', () => {
    assert.deepEqual(texts('SELECT 1\nGO\nSELECT 2\n  go  \nSELECT 3\nGo\n'), ['SELECT 1', 'SELECT 2', 'SELECT 3']);
  });

  it('counts GO n as n runs and GO 0 as none', () => {
    const batches = splitBatches('INSERT t VALUES (1)\nGO 3\nSELECT 2\nGO 0\nSELECT 3');
    assert.deepEqual(
      batches.map((b) => [b.text.trim(), b.repeat]),
      [
        ['INSERT t VALUES (1)', 3],
        ['SELECT 3', 1],
      ],
    );
  });

  it('accepts a trailing line comment after GO', () => {
    assert.deepEqual(texts('SELECT 1\nGO -- end of the first batch\nSELECT 2'), ['SELECT 1', 'SELECT 2']);
  });

  it('is not fooled by GO inside strings, comments or identifiers', () => {
    const script = [
      "SELECT 'it''s a line",
      'GO',
      "not a separator'",
      '/* a comment',
      'GO',
      '/* nested',
      'GO',
      '*/ still comment',
      'GO',
      '*/',
      'SELECT [odd',
      'GO',
      ']]name]',
      'SELECT "quoted',
      'GO',
      'ident"',
      'GO',
      'SELECT 2',
    ].join('\n');
    const batches = texts(script);
    assert.equal(batches.length, 2);
    assert.match(batches[0], /^SELECT 'it''s a line\nGO\nnot a separator'/);
    assert.match(batches[0], /ident"$/);
    assert.equal(batches[1], 'SELECT 2');
  });

  it('ignores GO in a line comment and words that only start with GO', () => {
    assert.deepEqual(texts('SELECT 1 -- GO\nGOTO done\ndone:\nGO'), ['SELECT 1 -- GO\nGOTO done\ndone:']);
  });

  it('drops empty batches, handles CRLF and a BOM, and reports start lines', () => {
    const batches = splitBatches('\uFEFFSELECT 1\r\nGO\r\n\r\nGO\r\nSELECT 2\r\nSELECT 3\r\n');
    assert.deepEqual(
      batches.map((b) => [b.text.trim(), b.line]),
      [
        ['SELECT 1', 1],
        ['SELECT 2\nSELECT 3', 5],
      ],
    );
  });

  it('keeps every CREATE PROCEDURE, FUNCTION and VIEW of sql/mssql first in its batch', async () => {
    const files = (await readdir(MSSQL_SQL_DIR)).filter((f) => f.endsWith('.sql'));
    assert.ok(files.includes('demo.sql') && files.some((f) => f.startsWith('0001_')), 'the scripts are where the migrator looks');
    const procedures = (await readdir(path.join(MSSQL_SQL_DIR, 'procedures'))).filter((f) => f.endsWith('.sql'));
    assert.ok(procedures.length > 0);
    for (const file of [...files, ...procedures.map((f) => `procedures/${f}`)]) {
      const batches = splitBatches(await readFile(path.join(MSSQL_SQL_DIR, file), 'utf8'));
      assert.ok(batches.length > 0, file);
      for (const batch of batches) {
        const code = batch.text.replace(/\/\*[\s\S]*?\*\//g, '').replace(/--.*$/gm, '').trim();
        if (/\bCREATE\s+(OR\s+ALTER\s+)?(PROCEDURE|FUNCTION|VIEW|TRIGGER)\b/i.test(code.replace(/N?'(?:[^']|'')*'/g, "''"))) {
          assert.match(code, /^CREATE\s+(OR\s+ALTER\s+)?(PROCEDURE|FUNCTION|VIEW|TRIGGER)\b/i, `${file}:${batch.line} must start its batch`);
        }
      }
    }
  });
});

/** A script with comments and string literals blanked out (same length, so offsets hold). */
function codeOnly(text: string): string {
  return text
    .replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' '))
    .replace(/--[^\n]*/g, (m) => ' '.repeat(m.length))
    .replace(/N?'(?:[^']|'')*'/g, (m) => `'${' '.repeat(Math.max(0, m.length - 2))}'`);
}

/** The numbered migrations and demo.sql, then the procedure files (as `procedures/<name>.sql`). */
async function scripts(): Promise<Array<{ file: string; text: string }>> {
  const files = (await readdir(MSSQL_SQL_DIR)).filter((f) => f.endsWith('.sql')).sort();
  const procedures = (await readdir(path.join(MSSQL_SQL_DIR, 'procedures'))).filter((f) => f.endsWith('.sql')).sort();
  return Promise.all(
    [...files, ...procedures.map((f) => `procedures/${f}`)].map(async (file) => ({ file, text: await readFile(path.join(MSSQL_SQL_DIR, file), 'utf8') })),
  );
}

/** The numbered migrations only (sql/mssql/NNNN_*.sql), in order. */
async function migrations(): Promise<Array<{ file: string; text: string }>> {
  return (await scripts()).filter((s) => /^\d{4}_.+\.sql$/.test(s.file));
}

/** The object a batch creates (CREATE [OR ALTER] PROCEDURE | FUNCTION | VIEW asyncexec.name), if any. */
function createdObject(batchText: string): { kind: string; name: string } | null {
  const m = /^\s*CREATE\s+(?:OR\s+ALTER\s+)?(PROCEDURE|FUNCTION|VIEW)\s+asyncexec\.(\w+)/i.exec(codeOnly(batchText));
  return m ? { kind: m[1].toUpperCase(), name: m[2] } : null;
}

/**
 * The procedures as a migrated database has them: the files of sql/mssql/procedures/, which
 * the migrator applies after the numbered migrations (the definition that counts).
 */
async function currentProcedures(): Promise<Map<string, { file: string; text: string }>> {
  const found = new Map<string, { file: string; text: string }>();
  for (const { file, text } of await scripts()) {
    if (!file.startsWith('procedures/')) continue;
    for (const batch of splitBatches(text)) {
      const created = createdObject(batch.text);
      if (created?.kind === 'PROCEDURE') found.set(created.name, { file, text: batch.text });
    }
  }
  return found;
}

/** Offsets of the UPDATEs of AsyncExecResults whose SET list assigns status (in code without comments and strings). */
const statusUpdates = (code: string) =>
  [...code.matchAll(/UPDATE asyncexec\.AsyncExecResults\s+SET\b([\s\S]*?)(?:\bOUTPUT\b|\bWHERE\b)/g)]
    .filter((m) => /(^|[\s,])status\s*=/.test(m[1]))
    .map((m) => m.index!);

describe('mssql: T-SQL rules checked without a server', () => {
  it('ends the statement before every THROW, SEND, RECEIVE and WAITFOR (RECEIVE) with a semicolon', async () => {
    // THROW, SEND and RECEIVE docs: "the preceding statement must be terminated with a semicolon"
    for (const { file, text } of await scripts()) {
      for (const batch of splitBatches(text)) {
        const code = codeOnly(batch.text);
        for (const match of code.matchAll(/(?<![@\w])(THROW|SEND\s+ON|WAITFOR\s*\(\s*RECEIVE|RECEIVE)\b/gi)) {
          if (/^RECEIVE/i.test(match[0]) && /WAITFOR\s*\(\s*$/i.test(code.slice(0, match.index))) continue;
          const before = code.slice(0, match.index).trimEnd();
          const line = batch.line + code.slice(0, match.index).split('\n').length - 1;
          assert.ok(
            before === '' || before.endsWith(';') || /\b(BEGIN|BEGIN\s+TRY|BEGIN\s+CATCH|AS)$/i.test(before),
            `${file}:${line}: the statement before ${match[0]} must end with a semicolon`,
          );
        }
      }
    }
  });

  it('sets the SET options xml methods need in every procedure that activation runs', async () => {
    // Internal Activation Context: the session has "the default options for the database"
    const current = await currentProcedures();
    const { text: activatedScript } = (await migrations()).find((s) => s.file.startsWith('0005_'))!;
    const names = splitBatches(activatedScript)
      .map((b) => /^\s*CREATE\s+PROCEDURE\s+asyncexec\.(\w+)/im.exec(codeOnly(b.text))?.[1])
      .filter((name): name is string => Boolean(name));
    // as they are now (a later script may alter them), the settle they all call, and the cancel it calls
    const procedures = [...names, 'usp_AsyncExecBatchSettle', 'usp_AsyncExecBatchCancelUnstarted'].map((name) => current.get(name)!);
    assert.ok(procedures.every(Boolean) && procedures.length >= 5);
    for (const batch of procedures) {
      for (const option of ['ANSI_WARNINGS ON', 'ANSI_PADDING ON', 'ARITHABORT ON', 'CONCAT_NULL_YIELDS_NULL ON', 'NUMERIC_ROUNDABORT OFF']) {
        assert.match(batch.text, new RegExp(`SET ${option};`), `${batch.text.match(/CREATE (?:OR ALTER )?PROCEDURE (\S+)/)?.[1]}: SET ${option}`);
      }
    }
  });

  it('turns IMPLICIT_TRANSACTIONS off before the no-transaction guard of every procedure that has one', async () => {
    // a caller with IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false) passes the guard at
    // @@TRANCOUNT 0, and its first SELECT then opens a transaction our COMMIT only nests in
    let guarded = 0;
    for (const [name, { text }] of await currentProcedures()) {
      const code = codeOnly(text);
      const guard = code.search(/IF @@TRANCOUNT > 0\s+BEGIN/);
      if (guard < 0) continue;
      guarded++;
      const off = code.search(/SET IMPLICIT_TRANSACTIONS OFF;/);
      assert.ok(off >= 0 && off < guard, `${name}: SET IMPLICIT_TRANSACTIONS OFF; before its @@TRANCOUNT guard`);
      assert.ok(!/BEGIN TRAN/i.test(code.slice(0, off)), `${name}: and before any BEGIN TRANSACTION`);
    }
    assert.ok(guarded >= 6, `${guarded} guarded procedures`);
  });

  it('says NULL or NOT NULL for every column of a table variable in the procedures', async () => {
    // without it a column's nullability follows the session's ANSI_NULL_DFLT_ON, or the database's
    // ANSI_NULL_DEFAULT (OFF unless changed) where the session sets neither, as in an activation:
    // a NULL inserted there fails with 515
    let columns = 0;
    for (const { file, text } of await scripts()) {
      if (!file.startsWith('procedures/')) continue;
      const code = codeOnly(text);
      for (const declared of code.matchAll(/DECLARE @\w+ TABLE \(/g)) {
        let depth = 1;
        let end = declared.index! + declared[0].length;
        for (; depth > 0; end++) depth += code[end] === '(' ? 1 : code[end] === ')' ? -1 : 0;
        const body = code.slice(declared.index! + declared[0].length, end - 1);
        const parts: string[] = [];
        let part = '';
        let nesting = 0;
        for (const ch of body) {
          nesting += ch === '(' ? 1 : ch === ')' ? -1 : 0;
          if (ch === ',' && nesting === 0) (parts.push(part), (part = ''));
          else part += ch;
        }
        parts.push(part);
        for (const column of parts.map((p) => p.trim())) {
          if (/^(PRIMARY KEY|UNIQUE|INDEX|CONSTRAINT|CHECK)\b/i.test(column)) continue;
          columns++;
          assert.match(column, /\bNULL\b|\bPRIMARY KEY\b/i, `${file}: ${column}`);
        }
      }
    }
    assert.ok(columns >= 30, `${columns} columns`);
  });

  it('names a collation wherever a Service Broker or catalog name meets a column of ours', async () => {
    const current = await currentProcedures();
    // sys.services.name is the case-sensitive Broker name, with a collation of its own (Msg 468 otherwise)
    assert.match(codeOnly(current.get('usp_AsyncExecListenerWake')!.text), /JOIN sys\.services AS s ON s\.name = l\.service_name COLLATE Latin1_General_BIN2/);
    const running = codeOnly(await readFile(path.join(MSSQL_SQL_DIR, 'procedures', 'AsyncExecRunning.sql'), 'utf8'));
    assert.match(running, /q\.queue_object = t\.queue_object COLLATE DATABASE_DEFAULT/);
    // no other comparison of a sys.services / sys.service_queues name with a column
    for (const { file, text } of await scripts()) {
      if (!file.startsWith('procedures/')) continue;
      for (const m of codeOnly(text).matchAll(/\b\w+\.name\s*=\s*\w+\.\w+(?!\s+COLLATE)\b/g)) {
        assert.ok(!/^(s|sq)\./.test(m[0]), `${file}: ${m[0]} needs a COLLATE`);
      }
    }
  });

  it('doubles % in every message it THROWs (a name a caller gave may hold one)', async () => {
    // "THROW": "% is a reserved character in the message text of a THROW statement and must be
    // escaped. Double the % character to return % as part of the message text"
    let throws = 0;
    for (const { file, text } of await scripts()) {
      if (!file.startsWith('procedures/')) continue;
      for (const m of codeOnly(text).matchAll(/THROW \d+, @message, 1;/g)) {
        throws++;
        const before = codeOnly(text).slice(0, m.index).trimEnd();
        assert.match(before, /SET @message = REPLACE\(@message, '\s*', '\s*'\);$/, `${file}: the THROW at offset ${m.index} doubles % first`);
      }
    }
    assert.ok(throws > 40, `${throws} THROWs of a message read`);
    // a message that holds what the caller sent (the argument problems, the names an unqualified
    // name may have meant) may reach 2048 characters: cut to 1024 before doubling when it would not fit
    const guarded = /IF DATALENGTH\(REPLACE\(@message, '\s*', '\s*'\)\) > 4096\s+SET @message = LEFT\(@message, 1024\);\s+SET @message = REPLACE\(@message, '\s*', '\s*'\);\s+THROW (\d+), @message, 1;/g;
    for (const [name, numbers] of [['usp_AsyncExecInvoke', ['50001', '50002']], ['usp_AsyncExecRegister', ['50002']]] as const) {
      const code = codeOnly((await currentProcedures()).get(name)!.text);
      assert.deepEqual([...code.matchAll(guarded)].map((m) => m[1]), numbers, `${name}: the long messages are cut before they are doubled`);
    }
  });

  it("refuses, at registration and again at every call before its first write, a procedure not to run as a call (SQL Server's own, or named like it)", async () => {
    const current = await currentProcedures();
    const refusal = codeOnly(await readFile(path.join(MSSQL_SQL_DIR, 'procedures', 'AsyncExecRefusedProcedure.sql'), 'utf8'));
    // as owner: what a caller's metadata visibility hides would otherwise pass
    assert.match(refusal, /RETURNS nvarchar\(400\)\s+WITH EXECUTE AS OWNER/);
    // the catalog is read only for sp_ names, and the names compare under the database's collation
    assert.match(refusal, /IF @name LIKE '\s*'\s+BEGIN\s+SELECT TOP \(1\) @system = s\.name FROM sys\.system_objects AS s\s+WHERE s\.name = @name COLLATE DATABASE_DEFAULT/);
    const register = codeOnly(current.get('usp_AsyncExecRegister')!.text);
    const invoke = codeOnly(current.get('usp_AsyncExecInvoke')!.text);
    for (const [name, code, error] of [['usp_AsyncExecRegister', register, 50005], ['usp_AsyncExecInvoke', invoke, 50001]] as const) {
      const read = code.search(/SELECT @refused = asyncexec\.AsyncExecRefusedProcedure\(@object\);\s+IF @refused IS NOT NULL/);
      assert.ok(read > 0, `${name} asks AsyncExecRefusedProcedure`);
      assert.equal(code.slice(read).match(/THROW (\d+)/)![1], String(error), `${name}: the THROW after the refusal's read is ${error}`);
      const firstWrite = code.search(/\b(INSERT|UPDATE|MERGE|DELETE|SEND|BEGIN DIALOG)\b/);
      assert.ok(read < firstWrite, `${name} refuses before its first write`);
    }
  });

  it('keeps poison-message handling off and activation procedures running as owner', async () => {
    const all = (await scripts()).map((s) => codeOnly(s.text)).join('\n');
    const text = (await scripts()).map((s) => s.text).join('\n');
    assert.match(text, /CREATE QUEUE asyncexec\.AsyncExecNotifyQueue[\s\S]*?POISON_MESSAGE_HANDLING \(STATUS = OFF\);/);
    assert.match(text, /MAX_QUEUE_READERS = [\s\S]*?EXECUTE AS OWNER\), POISON_MESSAGE_HANDLING \(STATUS = OFF\);/);
    assert.doesNotMatch(all, /WITH\s+CLEANUP/i, 'END CONVERSATION docs: do not use WITH CLEANUP in application code');
  });
});

describe('mssql: one file per procedure, function and view (sql/mssql/procedures/)', () => {
  const PROCEDURES_DIR = path.join(MSSQL_SQL_DIR, 'procedures');

  it('has a file for every procedure, function and view that a migration defines', async () => {
    const defined = new Set<string>();
    for (const { file, text } of await migrations()) {
      for (const batch of splitBatches(text)) {
        const created = createdObject(batch.text);
        if (created) defined.add(created.name);
        // and nothing else of that kind hides in a batch that starts otherwise
        assert.ok(created || !/\bCREATE\s+(OR\s+ALTER\s+)?(PROCEDURE|FUNCTION|VIEW)\s+asyncexec\./i.test(codeOnly(batch.text)), `${file}:${batch.line}`);
      }
    }
    assert.ok(defined.size >= 18, `${defined.size} objects`);
    const files = new Set((await readdir(PROCEDURES_DIR)).filter((f) => f.endsWith('.sql')));
    for (const name of defined) assert.ok(files.has(`${name}.sql`), `sql/mssql/procedures/${name}.sql is missing`);
  });

  it('defines in each file exactly the object its name says, with CREATE OR ALTER, in one batch', async () => {
    const files = (await readdir(PROCEDURES_DIR)).filter((f) => f.endsWith('.sql'));
    for (const file of files) {
      const text = await readFile(path.join(PROCEDURES_DIR, file), 'utf8');
      const batches = splitBatches(text);
      assert.equal(batches.length, 1, `${file}: one batch (no GO)`);
      const code = codeOnly(batches[0].text).trim();
      const name = file.replace(/\.sql$/, '');
      assert.match(code, new RegExp(`^CREATE OR ALTER (PROCEDURE|FUNCTION|VIEW) asyncexec\\.${name}\\b`), `${file} starts with CREATE OR ALTER … asyncexec.${name}`);
      assert.equal([...code.matchAll(/\b(CREATE|ALTER)\s+(OR\s+ALTER\s+)?(PROCEDURE|FUNCTION|VIEW|TRIGGER)\b/gi)].length, 1, `${file}: one definition`);
    }
  });

  it('lists in ORDER exactly the files of the folder, each once, views after what they read', async () => {
    const order = (await readProcedureFiles(PROCEDURES_DIR)).map((f) => f.file);
    const files = (await readdir(PROCEDURES_DIR)).filter((f) => f.endsWith('.sql')).sort();
    assert.deepEqual([...order].sort(), files);
    // views get no deferred name resolution: what a view or function names must come first
    for (const [i, file] of order.entries()) {
      const code = codeOnly(await readFile(path.join(PROCEDURES_DIR, file), 'utf8'));
      if (!/^\s*CREATE OR ALTER (VIEW|FUNCTION)\b/.test(code)) continue;
      for (const other of order) {
        const name = other.replace(/\.sql$/, '');
        if (other !== file && new RegExp(`asyncexec\\.${name}\\b`).test(code)) assert.ok(order.indexOf(other) < i, `${file} reads ${name}: list it first`);
      }
    }
  });

  it('refuses a folder whose ORDER and files disagree, and a file of two batches', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-procedures-'));
    try {
      await writeFile(path.join(dir, 'a.sql'), 'CREATE OR ALTER PROCEDURE asyncexec.a AS SELECT 1;\n');
      await writeFile(path.join(dir, 'b.sql'), 'CREATE OR ALTER PROCEDURE asyncexec.b AS SELECT 2;\n');
      await writeFile(path.join(dir, 'ORDER'), '# comment\nb.sql\n\na.sql\n');
      assert.deepEqual((await readProcedureFiles(dir)).map((f) => f.file), ['b.sql', 'a.sql'], 'the declared order, not the name order');
      await writeFile(path.join(dir, 'ORDER'), 'b.sql\n');
      await assert.rejects(readProcedureFiles(dir), /not listed: a\.sql/);
      await writeFile(path.join(dir, 'ORDER'), 'b.sql\na.sql\nc.sql\n');
      await assert.rejects(readProcedureFiles(dir), /listed but absent or repeated: c\.sql/);
      await writeFile(path.join(dir, 'ORDER'), 'b.sql\na.sql\na.sql\n');
      await assert.rejects(readProcedureFiles(dir), /must list every \.sql file/);
      await writeFile(path.join(dir, 'ORDER'), 'b.sql\na.sql\n');
      await writeFile(path.join(dir, 'a.sql'), 'CREATE OR ALTER PROCEDURE asyncexec.a AS SELECT 1;\nGO\nSELECT 3;\n');
      await assert.rejects(readProcedureFiles(dir), /a\.sql must hold exactly one batch/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('applies a file when its SHA-256 differs from the one recorded, in the declared order', async () => {
    const files = await readProcedureFiles(PROCEDURES_DIR);
    const run = files.find((f) => f.file === 'usp_AsyncExecRun.sql')!;
    const raw = await readFile(path.join(PROCEDURES_DIR, run.file));
    assert.equal(run.sha256, (await import('node:crypto')).createHash('sha256').update(raw).digest('hex'), 'the hash of the whole file');
    assert.deepEqual(changedProcedures(files, new Map()), files, 'a database that recorded none gets all, in ORDER');
    const recorded = new Map(files.map((f) => [f.file, f.sha256]));
    assert.deepEqual(changedProcedures(files, recorded), [], 'nothing changed, nothing applied');
    recorded.set('usp_AsyncExecRun.sql', '0'.repeat(64));
    recorded.delete('TypeText.sql');
    assert.deepEqual(
      changedProcedures(files, recorded).map((f: ProcedureFile) => f.file),
      files.map((f) => f.file).filter((f) => f === 'TypeText.sql' || f === 'usp_AsyncExecRun.sql'),
    );
  });
});

describe('mssql: DATABASE_URL', () => {
  it('parses user, password, host, port, database and options', () => {
    const { config, database } = parseMssqlUrl(
      'mssql://sa:p%40ss%3Aw%2Frd@db.example.com:14330/asyncproc?encrypt=false&trustServerCertificate=true&requestTimeout=30000&poolMax=20',
    );
    assert.equal(database, 'asyncproc');
    assert.equal(config.server, 'db.example.com');
    assert.equal(config.port, 14330);
    assert.equal(config.user, 'sa');
    assert.equal(config.password, 'p@ss:w/rd');
    assert.equal(config.database, 'asyncproc');
    assert.equal(config.requestTimeout, 30000);
    assert.equal(config.options?.encrypt, false);
    assert.equal(config.options?.trustServerCertificate, true);
    assert.equal(config.pool?.max, 20);
  });

  it('accepts sqlserver://, defaults to encryption with a verified certificate', () => {
    const { config } = parseMssqlUrl('sqlserver://app@localhost/orders');
    assert.equal(config.server, 'localhost');
    assert.equal(config.port, undefined);
    assert.equal(config.user, 'app');
    assert.equal(config.password, undefined);
    assert.equal(config.options?.encrypt, true);
    assert.equal(config.options?.trustServerCertificate, false);
  });

  it('takes a named instance instead of a port', () => {
    assert.equal(parseMssqlUrl('mssql://u:p@host/db?instanceName=SQLEXPRESS').config.options?.instanceName, 'SQLEXPRESS');
    assert.throws(() => parseMssqlUrl('mssql://u:p@host:1433/db?instanceName=X'), /port or instanceName/);
  });

  it('turns CURSOR_CLOSE_ON_COMMIT off on its connections (the listener ends dialogs one commit each inside a cursor loop)', () => {
    assert.equal(parseMssqlUrl('mssql://u:p@host/db').config.options?.enableCursorCloseOnCommit, false);
  });

  it('parses allowKill, off unless asked for', () => {
    assert.equal(parseMssqlUrl('mssql://u:p@host/db').allowKill, false);
    assert.equal(parseMssqlUrl('mssql://u:p@host/db?allowKill=true').allowKill, true);
    assert.equal(parseMssqlUrl('mssql://u:p@host/db?allowKill=1&encrypt=false').allowKill, true);
    assert.equal(parseMssqlUrl('mssql://u:p@host/db?allowKill=false').allowKill, false);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host/db?allowKill=please'), /allowKill must be true or false/);
    // not a driver option: it never reaches the mssql config
    assert.equal((parseMssqlUrl('mssql://u:p@host/db?allowKill=true').config.options as Record<string, unknown>).allowKill, undefined);
  });

  it('refuses other schemes, a missing database, unknown options and bad values', () => {
    assert.throws(() => parseMssqlUrl('postgres://u:p@host/db'), /mssql:\/\//);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host'), /database/);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host/a/b'), /database/);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host/db?colour=blue'), /unknown option "colour"/);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host/db?encrypt=maybe'), /encrypt must be true or false/);
    assert.throws(() => parseMssqlUrl('mssql://u:p@host/db?requestTimeout=soon'), /requestTimeout/);
    assert.throws(() => parseMssqlUrl('not a url'), /not a valid URL/);
  });
});

describe('mssql: JSON ⇄ SQL values', () => {
  it('encodes arguments as the JSON SQL Server converts from', () => {
    const json = encodeArguments({
      when: new Date('2024-03-01T12:34:56.789Z'),
      big: 9007199254740993n,
      bytes: Buffer.from([0, 1, 2, 254, 255]),
      view: new Uint8Array([104, 105]),
      flag: true,
      name: 'x',
      nothing: null,
      skipped: undefined,
      nested: { list: [1, 'two', null] },
    });
    assert.deepEqual(JSON.parse(json), {
      when: '2024-03-01T12:34:56.789', // UTC, no zone designator: datetime2 and datetime both parse it
      big: '9007199254740993', // exact, as text
      bytes: 'AAEC/v8=', // base64, what OPENJSON ... WITH decodes into varbinary
      view: 'aGk=',
      flag: true,
      name: 'x',
      nothing: null,
      nested: { list: [1, 'two', null] },
    });
  });

  it('refuses what has no SQL value, with INVALID_ARGUMENTS', () => {
    const refused = (value: unknown, pattern: RegExp) =>
      assert.throws(
        () => encodeArguments(value),
        (error: unknown) => error instanceof EngineError && error.code === 'INVALID_ARGUMENTS' && pattern.test(error.message),
      );
    refused({ a: Number.NaN }, /arguments\.a/);
    refused({ a: { b: [1, Infinity] } }, /arguments\.a\.b\[1\]/);
    refused({ f: () => 1 }, /function/);
    refused({ d: new Date('nope') }, /invalid date/);
    refused([1, 2], /JSON object/);
    refused('{"a":1}', /JSON object/);
    assert.equal(encodeArguments(null), '{}');
  });

  it('keeps plain JSON values as they are', () => {
    assert.deepEqual(toSqlJson({ a: 1.5, b: -2, c: 'é', d: false }), { a: 1.5, b: -2, c: 'é', d: false });
  });

  it('turns exact numerics back into numbers only when a double holds them exactly', () => {
    assert.equal(fromSqlOutput('42', 'bigint'), 42);
    assert.equal(fromSqlOutput('9007199254740993', 'bigint'), '9007199254740993');
    assert.equal(fromSqlOutput('3.50', 'decimal(10,2)'), 3.5);
    assert.equal(fromSqlOutput('-0.10', 'numeric(5,2)'), -0.1);
    assert.equal(fromSqlOutput('100.00', 'money'), 100);
    assert.equal(fromSqlOutput('12345678901234567890.12', 'decimal(38,2)'), '12345678901234567890.12');
    assert.equal(fromSqlOutput('7', 'int'), '7', 'only exact numerics travel as text');
    assert.equal(fromSqlOutput(7, 'int'), 7);
    assert.equal(fromSqlOutput('abc', 'decimal(5,2)'), 'abc');
    assert.equal(fromSqlOutput(null, 'bigint'), null);
  });

  it('decodes a stored result: return value, typed output parameters, rows', () => {
    const stored = JSON.stringify({
      returnValue: 0,
      outputParameters: { total: 42, big: '12345678901234567890', price: '9.90', at: '2024-03-01T12:00:00', blob: 'AAE=' },
      outputTypes: { total: 'int', big: 'bigint', price: 'decimal(10,2)', at: 'datetime2(7)', blob: 'varbinary(max)' },
      rows: null,
    });
    assert.deepEqual(decodeResult(stored), {
      returnValue: 0,
      outputParameters: { total: 42, big: '12345678901234567890', price: 9.9, at: '2024-03-01T12:00:00', blob: 'AAE=' },
      rows: null,
      rowCount: null,
      truncated: false,
    });
    assert.deepEqual(decodeResult('{"returnValue":5,"outputParameters":null,"outputTypes":null,"rows":null}'), {
      returnValue: 5,
      outputParameters: null,
      rows: null,
      rowCount: null,
      truncated: false,
    });
    // the T-SQL does not count rows yet: whether they were cut is unknown; FOR JSON's bigint stays exact
    assert.deepEqual(decodeResult('{"returnValue":0,"outputParameters":null,"rows":[{"id":9007199254740993,"n":1}]}'), {
      returnValue: 0,
      outputParameters: null,
      rows: [{ id: '9007199254740993', n: 1 }],
      rowCount: null,
      truncated: null,
    });
    assert.equal(decodeResult(null), null);
  });

  it('reports OUTPUT parameters as OUT and the rest as IN', () => {
    assert.equal(parameterMode(true), 'OUT');
    assert.equal(parameterMode(false), 'IN');
  });
});

describe('mssql: cursors and errors', () => {
  it('round-trips a rowversion through its cursor text, which orders like the rowversion', () => {
    const low = Buffer.from('00000000000007D0', 'hex');
    const high = Buffer.from('0000000000010000', 'hex');
    assert.equal(cursorFromRowversion(low), '0x00000000000007D0');
    assert.deepEqual(rowversionFromCursor('0x00000000000007d0'), low);
    assert.ok(cursorFromRowversion(low) < cursorFromRowversion(high));
    assert.throws(() => cursorFromRowversion(Buffer.alloc(4)), /8 bytes/);
  });

  it('a rowversion is the unsigned number the change feed orders by, and back', () => {
    const top = Buffer.from('FFFFFFFFFFFFFFFE', 'hex');
    assert.equal(rowversionValue(Buffer.from('00000000000007D0', 'hex')), 2000n);
    assert.equal(rowversionValue(top), (1n << 64n) - 2n);
    assert.deepEqual(rowversionOf((1n << 64n) - 2n), top);
    assert.deepEqual(rowversionOf(2000n), Buffer.from('00000000000007D0', 'hex'));
  });

  it('refuses malformed cursors with BAD_USER_INPUT', () => {
    for (const bad of ['', '0x123', '00000000000007D0', '0x00000000000007DG', '0x00000000000007D00']) {
      assert.throws(
        () => rowversionFromCursor(bad),
        (error: unknown) => error instanceof EngineError && error.code === 'BAD_USER_INPUT',
        bad,
      );
    }
  });

  it('maps the THROW numbers of usp_AsyncExecInvoke onto engine error codes', () => {
    const thrown = (number: number, message: string) => {
      const error = new sql.RequestError(message, 'EREQUEST');
      error.number = number;
      return error;
    };
    const expect = (number: number, code: string | undefined) => {
      const mapped = mapDatabaseError(thrown(number, `error ${number}`));
      if (code === undefined) assert.ok(!(mapped instanceof EngineError), `${number} is unexpected`);
      else {
        assert.ok(mapped instanceof EngineError);
        assert.equal(mapped.code, code);
        assert.equal(mapped.message, `error ${number}`);
        assert.ok(mapped.cause instanceof sql.RequestError);
      }
    };
    expect(50001, 'UNKNOWN_PROCEDURE');
    expect(50002, 'INVALID_ARGUMENTS');
    expect(50003, 'UNKNOWN_QUEUE');
    expect(50005, 'BAD_USER_INPUT');
    expect(50006, 'NOT_FOUND');
    expect(50007, 'ALREADY_FINISHED');
    expect(50008, 'FORBIDDEN');
    // faults of the machinery or of a caller, not user input: unmapped
    for (const fault of [50020, 50021, 50022, 50023, 50024]) expect(fault, undefined);
    expect(50000, undefined);
    expect(1205, undefined);
    assert.ok(mapDatabaseError('plain text') instanceof Error);
  });
});

describe('mssql: queues', () => {
  const badInput = (error: unknown) => error instanceof EngineError && error.code === 'BAD_USER_INPUT';

  it('accepts the names and limits usp_AsyncExecCreateQueue accepts', () => {
    for (const name of ['default', 'reports', 'a', 'A-Z_0.9:x', 'q'.repeat(100)]) checkQueueSettings(name, 1);
    for (const concurrency of [1, 10, 1000]) checkQueueSettings('reports', concurrency);
  });

  it('refuses a bad name or limit with BAD_USER_INPUT before anything reaches the server', async () => {
    // a pool that fails any request: the refusal must come first
    const pool = { request: () => assert.fail('no request expected') } as unknown as sql.ConnectionPool;
    for (const name of ['', 'q'.repeat(101), 'has space', 'semi;colon', "quote'", 'brack]et', 'é']) {
      await assert.rejects(configureQueue(pool, name, 2), badInput, JSON.stringify(name));
    }
    for (const concurrency of [0, -1, 1001, 2.5, Number.NaN, Number.POSITIVE_INFINITY]) {
      await assert.rejects(configureQueue(pool, 'reports', concurrency), badInput, String(concurrency));
    }
  });

  it('refuses grouped commits (NOT_SUPPORTED) and bad groupings (BAD_USER_INPUT) before any request; size 1 is accepted', async () => {
    const pool = { request: () => assert.fail('no request expected') } as unknown as sql.ConnectionPool;
    const notSupported = (e: unknown) => e instanceof EngineError && e.code === 'NOT_SUPPORTED';
    for (const size of [2, 20, 1000]) {
      await assert.rejects(configureQueue(pool, 'reports', 2, { size }), notSupported, String(size));
      await assert.rejects(configureQueue(pool, 'reports', 2, { size, maxMs: 10 }), notSupported, String(size));
    }
    for (const grouping of [{ size: 0 }, { size: 1.5 }, { size: 1001 }, { maxMs: 0 }, { maxMs: 10_001 }]) {
      await assert.rejects(configureQueue(pool, 'reports', 2, grouping), badInput, JSON.stringify(grouping));
    }
    // size 1 (off) goes on to the server: here, to the pool that refuses every request
    await assert.rejects(configureQueue(pool, 'reports', 2, { size: 1, maxMs: 10 }), /no request expected/);
  });

  it('changes an existing queue with ALTER QUEUE … MAX_QUEUE_READERS and the registry row in one transaction', async () => {
    const batch = (await currentProcedures()).get('usp_AsyncExecCreateQueue')!;
    const code = codeOnly(batch.text);
    const begin = code.indexOf('BEGIN TRANSACTION');
    const commit = code.lastIndexOf('COMMIT TRANSACTION');
    assert.ok(begin > 0 && commit > begin);
    for (const needle of ['sp_getapplock', 'UPDATE asyncexec.AsyncExecQueues SET concurrency = @concurrency']) {
      const at = code.indexOf(needle);
      assert.ok(at > begin && at < commit, `${needle} inside the transaction`);
    }
    assert.match(batch.text, /N'ALTER QUEUE asyncexec\.' \+ QUOTENAME\(@queueObject\) \+ N' WITH '/);
    assert.match(batch.text, /MAX_QUEUE_READERS = ' \+ CAST\(@concurrency AS nvarchar\(10\)\)/);
  });

  it('makes readers above a lowered limit return (ALTER QUEUE does not stop running readers)', async () => {
    const reader = (await currentProcedures()).get('usp_AsyncExecActivated')!;
    const code = codeOnly(reader.text);
    const loop = code.indexOf('WHILE 1 = 1');
    const check = code.indexOf('SELECT concurrency FROM asyncexec.AsyncExecQueues WHERE name = @queue) < @concurrency');
    assert.ok(loop > 0 && check > loop && check < code.indexOf('BEGIN TRANSACTION', loop), 'checked at the top of the loop, outside a transaction');
  });
});

describe('mssql: execution log', () => {
  const row = (over: Partial<AttemptRow>): AttemptRow => ({
    execution_id: '42',
    number: 1,
    status: 'SUCCEEDED',
    started_at: new Date('2024-03-01T12:00:00Z'),
    finished_at: new Date('2024-03-01T12:00:01Z'),
    session_id: 57,
    worker: 'session 57',
    error_number: null,
    error_severity: null,
    error_state: null,
    error_line: null,
    error_message: null,
    ...over,
  });

  it('maps a row to an Attempt, with the error when there is one', () => {
    assert.deepEqual(toAttempt(row({})), {
      number: 1,
      status: 'SUCCEEDED',
      startedAt: new Date('2024-03-01T12:00:00Z'),
      finishedAt: new Date('2024-03-01T12:00:01Z'),
      worker: 'session 57',
      sessionId: 57,
      error: null,
    });
    const failed = toAttempt(
      row({ status: 'FAILED', error_number: 50000, error_severity: 16, error_state: 1, error_line: 3, error_procedure: 'usp_Charge', error_message: 'boom' }),
    );
    assert.deepEqual(failed.error, { number: '50000', message: 'boom', severity: 16, state: 1, line: 3, detail: null, context: 'usp_Charge' });
    assert.equal(toAttempt(row({ status: 'LOST' })).error, null);
    assert.equal(toAttempt(row({ status: 'RUNNING', finished_at: null })).finishedAt, null);
  });

  it('reads execution ids as bigint identities', () => {
    assert.equal(canonicalExecutionId('42'), '42');
    assert.equal(canonicalExecutionId('0042'), '42');
    assert.equal(canonicalExecutionId('9223372036854775807'), '9223372036854775807');
    assert.equal(canonicalExecutionId('9223372036854775808'), null);
    assert.equal(canonicalExecutionId('0'), null);
    for (const bad of ['', '-1', '1.5', 'abc', '0x10', ' 1']) {
      assert.throws(() => canonicalExecutionId(bad), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT', bad);
    }
  });

  it('keys every requested id, oldest attempt first, [] for none, without asking for impossible ids', async () => {
    const seen: string[] = [];
    const original = sql.Request.prototype.query;
    sql.Request.prototype.query = async function (this: sql.Request, text: string) {
      seen.push(String((this.parameters as Record<string, { value: unknown }>).ids.value));
      assert.match(String(text), /ORDER BY a\.execution_id, a\.number/);
      return {
        recordset: [
          row({ execution_id: '7', number: 1, status: 'LOST', finished_at: new Date('2024-03-01T12:00:00.5Z') }),
          row({ execution_id: '7', number: 2, status: 'FAILED', error_number: 50000, error_message: 'no' }),
          row({ execution_id: '7', number: 3, status: 'RUNNING', finished_at: null }),
          row({ execution_id: '9', number: 1 }),
        ],
      };
    } as typeof original;
    try {
      const history = await getHistory({} as sql.ConnectionPool, ['7', '8', '9', '007', '99999999999999999999']);
      assert.deepEqual(JSON.parse(seen[0]), ['7', '8', '9']);
      assert.deepEqual([...history.keys()], ['7', '8', '9', '007', '99999999999999999999']);
      assert.deepEqual(history.get('7')!.map((a) => [a.number, a.status]), [
        [1, 'LOST'],
        [2, 'FAILED'],
        [3, 'RUNNING'],
      ]);
      assert.deepEqual(history.get('8'), []);
      assert.deepEqual(history.get('007'), history.get('7'));
      assert.notEqual(history.get('007'), history.get('7'), 'separate arrays');
      assert.deepEqual(history.get('99999999999999999999'), []);
      assert.equal(history.get('9')!.length, 1);
      seen.length = 0;
      assert.equal((await getHistory({} as sql.ConnectionPool, [])).size, 0);
      assert.deepEqual([...(await getHistory({} as sql.ConnectionPool, ['0']))], [['0', []]]);
      assert.equal(seen.length, 0, 'no query when no execution can match');
    } finally {
      sql.Request.prototype.query = original;
    }
  });

  it('writes the log in the transactions that change the results row', async () => {
    const all = await scripts();
    const tables = codeOnly(all.find((s) => s.file.startsWith('0001_'))!.text);
    assert.match(tables, /CREATE TABLE asyncexec\.AsyncExecAttempts[\s\S]*?PRIMARY KEY CLUSTERED \(execution_id, number\)/);
    assert.match(tables, /REFERENCES asyncexec\.AsyncExecResults \(id\) ON DELETE CASCADE/, 'purged with its call');
    const current = await currentProcedures();
    const source = (name: string) => current.get(name)!.text;
    const proc = (name: string) => codeOnly(source(name));
    // every procedure that moves a call's status writes the log too
    for (const name of ['usp_AsyncExecRun', 'usp_AsyncExecAbandon', 'usp_AsyncExecActivated']) {
      const code = proc(name);
      const updates = [...code.matchAll(/UPDATE asyncexec\.AsyncExecResults\s+SET status/g)].length;
      const logs = [...code.matchAll(/(UPDATE|INSERT) asyncexec\.AsyncExecAttempts/g)].length;
      assert.ok(updates > 0 && logs >= updates, `${name}: ${updates} status updates, ${logs} log writes`);
    }
    // the claim closes a lost run and starts the next number
    const claim = source('usp_AsyncExecActivated');
    assert.match(claim, /SET status = 'LOST', finished_at = @now\s+WHERE execution_id = @id AND status = 'RUNNING';\s+IF @newStatus = 'RUNNING'\s+INSERT asyncexec\.AsyncExecAttempts/);
    assert.match(claim, /COALESCE\(MAX\(a\.number\), 0\) \+ 1/);
    // the run closes the attempt only when it recorded the outcome, after a doomed transaction too
    const run = proc('usp_AsyncExecRun');
    const fresh = run.indexOf('IF @@TRANCOUNT = 0');
    const log = run.indexOf('UPDATE asyncexec.AsyncExecAttempts');
    assert.ok(fresh > 0 && log > fresh && log > run.indexOf('IF EXISTS (SELECT 1 FROM @changed)'));
    assert.ok(log < run.indexOf('COMMIT TRANSACTION', log));
  });
});

describe('mssql: cancelExecution', () => {
  const execution = (status: ExecutionStatus): Execution => ({
    id: '7',
    token: '00000000-0000-0000-0000-000000000007',
    procedure: 'demo.sleep',
    arguments: {},
    queue: 'default',
    status,
    submittedAt: new Date(0),
    runAt: null,
    startedAt: null,
    finishedAt: null,
    attempts: 1,
    maxAttempts: 1,
    submittedBy: null,
    schedule: null,
    error: null,
    result: null,
    worker: null,
    sessionId: 60,
    cursor: '0x0000000000000001',
    batchId: null,
    stage: null,
  });

  /** Fake steps: `requests` answers usp_AsyncExecCancel in turn, `statuses` the reads in turn (the last repeats). */
  function fake(requests: Array<CancelRequestStatus | Error>, statuses: ExecutionStatus[]) {
    const log: string[] = [];
    let clock = 0;
    const steps: CancelSteps = {
      async request() {
        const next = requests.shift() ?? assert.fail('unexpected request');
        log.push(`request:${next instanceof Error ? (next as EngineError).code : next}`);
        if (next instanceof Error) throw next;
        return { id: '7', status: next };
      },
      async read() {
        const status = statuses.length > 1 ? statuses.shift()! : statuses[0];
        log.push(`read:${status}`);
        return execution(status);
      },
      async kill(_id, killed) {
        log.push('kill');
        killed.add(60);
      },
      async settle() {
        log.push('settle');
      },
      async sleep(ms) {
        clock += ms;
      },
      now: () => clock,
    };
    return { steps, log };
  }

  it('cancels a WAITING or PENDING call in one request and returns it', async () => {
    const { steps, log } = fake(['CANCELLED'], ['CANCELLED']);
    assert.equal((await runCancel(steps)).status, 'CANCELLED');
    assert.deepEqual(log, ['request:CANCELLED', 'read:CANCELLED']);
  });

  it('passes the refusals of the first request on, changing nothing', async () => {
    for (const code of ['NOT_FOUND', 'ALREADY_FINISHED', 'FORBIDDEN'] as const) {
      const { steps, log } = fake([new EngineError(code, code)], ['RUNNING']);
      await assert.rejects(runCancel(steps), (e: unknown) => e instanceof EngineError && e.code === code);
      assert.deepEqual(log, [`request:${code}`]);
    }
  });

  it('kills a RUNNING call, settles it and waits until it is no longer RUNNING', async () => {
    const { steps, log } = fake(['RUNNING'], ['RUNNING', 'RUNNING', 'CANCELLED']);
    assert.equal((await runCancel(steps)).status, 'CANCELLED');
    assert.deepEqual(log, ['request:RUNNING', 'kill', 'settle', 'read:RUNNING', 'kill', 'settle', 'read:RUNNING', 'kill', 'settle', 'read:CANCELLED']);
  });

  it('returns the outcome a run reached before the kill landed', async () => {
    const { steps } = fake(['RUNNING'], ['SUCCEEDED']);
    assert.equal((await runCancel(steps)).status, 'SUCCEEDED');
  });

  it('gives up waiting after waitMs and returns the call as it is', async () => {
    const { steps } = fake(['RUNNING'], ['RUNNING']);
    assert.equal((await runCancel(steps, { waitMs: 1000, pollMs: 100 })).status, 'RUNNING');
  });

  it('asks again when a reader held the call (BUSY), and when it was claimed meanwhile', async () => {
    const busy = fake(['BUSY', 'CANCELLED'], ['PENDING', 'CANCELLED']);
    assert.equal((await runCancel(busy.steps)).status, 'CANCELLED');
    assert.deepEqual(busy.log, ['request:BUSY', 'read:PENDING', 'request:CANCELLED', 'read:CANCELLED']);
    // claimed between the two requests, and no allowKill: FORBIDDEN, nothing killed
    const claimed = fake(['BUSY', new EngineError('FORBIDDEN', 'allowKill=true')], ['RUNNING']);
    await assert.rejects(runCancel(claimed.steps), (e: unknown) => e instanceof EngineError && e.code === 'FORBIDDEN');
    assert.ok(!claimed.log.includes('kill'));
    // finished between the two requests: returned as it is
    const finished = fake(['BUSY', new EngineError('ALREADY_FINISHED', 'done')], ['PENDING', 'SUCCEEDED']);
    assert.equal((await runCancel(finished.steps)).status, 'SUCCEEDED');
  });

  it('keeps the lock order and the KILL rules in the T-SQL', async () => {
    const { text } = (await scripts()).find((s) => s.file.startsWith('0005_'))!;
    const current = await currentProcedures();
    const proc = (name: string) => codeOnly(current.get(name)!.text);
    // the application lock names stay within the 32 characters sys.dm_tran_locks shows
    assert.ok(`asyncexec/${'9'.repeat(19)}`.length <= 32);
    assert.doesNotMatch(codeOnly(text), /asyncexec\/execution\//);
    // the claim reads the call again after taking its lock
    const claim = proc('usp_AsyncExecActivated');
    const lock = claim.indexOf('EXEC @lock = sys.sp_getapplock', claim.indexOf('PENDING, WAITING and due'));
    assert.ok(lock > 0);
    assert.ok(claim.indexOf('WITH (UPDLOCK, ROWLOCK)', lock) > lock, 'the claim reads the call again under its lock');
    // KILL runs only outside a transaction, in dynamic SQL, never on our own session
    const kill = proc('usp_AsyncExecKill');
    assert.doesNotMatch(kill, /BEGIN\s+TRAN/i);
    assert.match(kill, /@@TRANCOUNT > 0/);
    assert.match(kill, /@sessionId = @@SPID/);
    assert.match(kill, /sys\.dm_tran_locks/);
    // the cancel takes the call's lock before its row, and records a RUNNING cancel before anything is killed
    const cancel = proc('usp_AsyncExecCancel');
    assert.ok(cancel.indexOf('sp_getapplock') < cancel.indexOf('WITH (UPDLOCK, ROWLOCK)'));
    assert.match(cancel, /SET cancel_requested = 1 WHERE id = @id AND cancel_requested = 0;\s+COMMIT TRANSACTION;/);
    assert.doesNotMatch(cancel, /\bKILL\b\s+\d|EXEC\s+sys\.sp_executesql/);
    // the settle takes the conversation group first, as a reader's RECEIVE does
    const settle = proc('usp_AsyncExecSettleCancel');
    const begin = settle.indexOf('BEGIN TRANSACTION');
    assert.ok(begin > 0 && settle.indexOf('BEGIN CONVERSATION TIMER', begin) < settle.indexOf('sp_getapplock', begin));
    assert.ok(settle.indexOf('UPDATE asyncexec.AsyncExecAttempts') > settle.indexOf("SET status = 'CANCELLED'"), 'the killed attempt is logged LOST');
  });
});

describe('mssql: batches (T-SQL)', () => {
  /** A script with only its comments blanked (same length as the text: offsets hold). */
  const withoutComments = (text: string) =>
    text.replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' ')).replace(/--[^\n]*/g, (m) => ' '.repeat(m.length));
  /** Each CREATE PROCEDURE of every script by name: `code` has comments and strings blanked, `sql` comments only. */
  async function procedures(): Promise<Map<string, { file: string; code: string; sql: string; text: string }>> {
    const found = new Map<string, { file: string; code: string; sql: string; text: string }>();
    for (const [name, { file, text }] of await currentProcedures()) {
      found.set(name, { file, code: codeOnly(text), sql: withoutComments(text), text });
    }
    return found;
  }
  const BATCH_LOCK = 'FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)';
  const SETTLE = 'EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;';
  const CANCEL_UNSTARTED = 'EXEC asyncexec.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId,';

  it('numbers the migrations 0001, 0002, … without gaps, as the migrator records them', async () => {
    const numbers = (await readdir(MSSQL_SQL_DIR)).filter((f) => /^\d{4}_.+\.sql$/.test(f)).map((f) => Number(f.slice(0, 4))).sort((a, b) => a - b);
    assert.deepEqual(numbers, numbers.map((_, i) => i + 1));
    assert.ok(numbers.includes(7), '0007_batches.sql');
  });

  it('executes only procedures that some script creates', async () => {
    const all = await procedures();
    for (const [name, { code }] of all) {
      for (const match of code.matchAll(/\bEXEC\s+(?:@\w+\s*=\s*)?asyncexec\.(\w+)/gi)) {
        assert.ok(all.has(match[1]), `${name} executes asyncexec.${match[1]}, which no script creates`);
      }
    }
  });

  it('settles the batch in every transaction that ends a member, locking the batch before the member', async () => {
    const all = await procedures();
    const changing = [...all].filter(([, { code }]) => statusUpdates(code).length > 0).map(([name]) => name).sort();
    // a new path that changes a call's status must be added here, and settle its batch
    assert.deepEqual(changing, [
      'usp_AsyncExecAbandon',
      'usp_AsyncExecActivated',
      'usp_AsyncExecBatchCancelUnstarted',
      'usp_AsyncExecBatchSettle',
      'usp_AsyncExecCancel',
      'usp_AsyncExecRun',
      'usp_AsyncExecSettleCancel',
    ]);
    // usp_AsyncExecBatchCancelUnstarted runs under its caller's batch lock: every caller holds
    // the batch row before the call, and settles after it before the commit (or is the settle)
    const callers = [...all].filter(([, { code }]) => code.includes('EXEC asyncexec.usp_AsyncExecBatchCancelUnstarted')).map(([name]) => name).sort();
    assert.deepEqual(callers, ['usp_AsyncExecBatchSettle', 'usp_AsyncExecCancelBatch']);
    for (const name of callers) {
      const { code } = all.get(name)!;
      const calls = [...code.matchAll(/EXEC asyncexec\.usp_AsyncExecBatchCancelUnstarted\b/g)].map((m) => m.index!);
      assert.equal(calls.length, 1, `${name} calls it once`);
      assert.ok(code.indexOf(CANCEL_UNSTARTED) === calls[0], `${name} passes its own @batchId`);
      const lock = code.lastIndexOf(BATCH_LOCK, calls[0]);
      assert.ok(lock > 0 && lock > code.lastIndexOf('BEGIN TRANSACTION', calls[0]), `${name}: the batch is locked (in this transaction) before the cancel`);
      if (name !== 'usp_AsyncExecBatchSettle') {
        const settle = code.indexOf(SETTLE, calls[0]);
        assert.ok(settle > calls[0], `${name}: the cancel is followed by the settle`);
        assert.ok(settle < code.indexOf('COMMIT TRANSACTION', calls[0]), `${name}: settled before the commit`);
      }
    }
    for (const name of changing.filter((n) => n !== 'usp_AsyncExecBatchSettle' && n !== 'usp_AsyncExecBatchCancelUnstarted')) {
      const { code } = all.get(name)!;
      assert.match(code, /@batchId = e?\.?batch_id|@batchId = batch_id/, `${name} reads the call's batch`);
      const updates = statusUpdates(code);
      updates.forEach((at, i) => {
        const previous = i === 0 ? 0 : updates[i - 1];
        const next = updates[i + 1] ?? code.length;
        const lock = code.lastIndexOf(BATCH_LOCK, at);
        assert.ok(lock > previous, `${name}: the batch is locked before status update ${i + 1}`);
        const settle = code.indexOf(SETTLE, at);
        assert.ok(settle > at && settle < next, `${name}: status update ${i + 1} is followed by the settle`);
        assert.ok(settle < code.indexOf('COMMIT TRANSACTION', at), `${name}: settled before the commit`);
      });
    }
    // the run settles only an outcome (not a retry's WAITING), after a doomed call too
    const run = all.get('usp_AsyncExecRun')!.sql;
    assert.match(run, /IF @batchId IS NOT NULL AND @status <> 'WAITING'\s+EXEC asyncexec\.usp_AsyncExecBatchSettle/);
    assert.ok(run.indexOf(BATCH_LOCK) > run.indexOf('IF @@TRANCOUNT = 0'), 'the batch lock is taken in the fresh transaction too');
    assert.ok(run.indexOf(BATCH_LOCK) < run.indexOf('WITH (UPDLOCK, ROWLOCK) WHERE id = @id'), 'before the member row');
    // the reader settles what it ends: lost five times, cancelled after a kill, dialog ended
    const claim = all.get('usp_AsyncExecActivated')!.sql;
    assert.match(claim, /IF @batchId IS NOT NULL AND @newStatus IN \('FAILED', 'CANCELLED'\)\s+EXEC asyncexec\.usp_AsyncExecBatchSettle/);
    assert.match(claim, /@batchId = NULL;/, 'reset for every message');
  });

  it('runs the settle and the cancel it calls with the SET options of the activated procedures, inside their caller’s transaction', async () => {
    const all = await procedures();
    for (const [name, number] of [['usp_AsyncExecBatchSettle', 50022], ['usp_AsyncExecBatchCancelUnstarted', 50024]] as const) {
      const { file, text, code } = all.get(name)!;
      assert.equal(file, `procedures/${name}.sql`, name);
      for (const option of ['XACT_ABORT OFF', 'ANSI_WARNINGS ON', 'ANSI_PADDING ON', 'ARITHABORT ON', 'CONCAT_NULL_YIELDS_NULL ON', 'NUMERIC_ROUNDABORT OFF']) {
        assert.match(text, new RegExp(`SET ${option};`), `${name}: SET ${option}`);
      }
      assert.doesNotMatch(code, /\b(BEGIN|COMMIT)\s+TRAN/i, `${name}: never a transaction of its own`);
      assert.match(code, new RegExp(`IF @@TRANCOUNT = 0\\s+BEGIN\\s+(?:SET @message = [^;]+;\\s+)+THROW ${number}, @message, 1;`), name);
      assert.ok(code.indexOf('IF @@TRANCOUNT = 0') < code.indexOf('asyncexec.AsyncExecResults'), `${name}: checked before any member is touched`);
    }
    // applied before the settle that calls it
    const order = (await readProcedureFiles(path.join(MSSQL_SQL_DIR, 'procedures'))).map((f) => f.file);
    const created = order.indexOf('usp_AsyncExecBatchCancelUnstarted.sql');
    assert.ok(created >= 0 && created < order.indexOf('usp_AsyncExecBatchSettle.sql'));
  });

  it('serialises settles on the batch row and counts committed members only', async () => {
    const { sql: code } = (await procedures()).get('usp_AsyncExecBatchSettle')!;
    const lock = code.indexOf(BATCH_LOCK);
    assert.ok(lock > 0, 'UPDLOCK, HOLDLOCK on the batch row');
    assert.ok(lock < code.indexOf('asyncexec.AsyncExecResults'), 'before any member is read');
    assert.match(code.slice(lock, code.indexOf('WHILE 1 = 1')), /IF @status IS NULL OR @status <> 'RUNNING'\s+RETURN;/);
    // every read of the members (not the UPDATEs, which take update locks anyway) is a locking read
    const reads = [...code.matchAll(/FROM asyncexec\.AsyncExecResults(?: AS e)?( WITH \(\w+\))?/g)];
    assert.ok(reads.length >= 5);
    for (const read of reads) assert.equal(read[1], ' WITH (READCOMMITTEDLOCK)', `locking read at ${read.index}`);
  });

  it('cancels what has not started under CANCEL, as usp_AsyncExecCancel does, and ends the batch', async () => {
    const all = await procedures();
    const { sql: code } = all.get('usp_AsyncExecBatchSettle')!;
    assert.match(
      code,
      /IF @onFailure = 'CANCEL'\s+AND EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecResults WITH \(READCOMMITTEDLOCK\)\s+WHERE batch_id = @batchId AND status IN \('FAILED', 'CANCELLED'\)\)\s+BEGIN\s+EXEC asyncexec\.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId,\s+@reason = N'cancelled: an execution of its batch did not succeed';/,
    );
    // the cancel itself, shared with usp_AsyncExecCancelBatch
    const { sql: cancel } = all.get('usp_AsyncExecBatchCancelUnstarted')!;
    assert.match(cancel, /^\s*CREATE OR ALTER PROCEDURE asyncexec\.usp_AsyncExecBatchCancelUnstarted\s+@batchId uniqueidentifier,\s+@reason\s+nvarchar\(4000\)\s+AS\b/);
    assert.match(cancel, /SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1,/);
    assert.match(cancel, /error_message = @reason\s+OUTPUT inserted\.id, inserted\.initiator_handle INTO @cancelled/);
    assert.match(cancel, /WHERE batch_id = @batchId AND status IN \('WAITING', 'PENDING'\);/, 'RUNNING members run to their end');
    assert.equal(statusUpdates(codeOnly(cancel)).length, 1, 'the one status update');
    // the wake-up request, only on an open initiator side, and a failed SEND does not undo the cancel
    const savepoint = /IF @state IN \('SO', 'CO'\)[\s\S]*?SAVE TRANSACTION (\w+);\s+BEGIN TRY\s+SEND ON CONVERSATION @h MESSAGE TYPE \[asyncexec\/Request\]/.exec(cancel)?.[1];
    assert.ok(savepoint, 'SEND under a savepoint');
    assert.ok(savepoint.length <= 32, 'savepoint names are at most 32 characters');
    assert.notEqual(savepoint, 'usp_AsyncExecBatchSettle', 'its own savepoint name, not its caller’s');
    assert.match(
      cancel,
      new RegExp(`BEGIN CATCH[^]*?IF XACT_STATE\\(\\) <> 1\\s+BEGIN\\s+THROW;\\s+END;\\s+ROLLBACK TRANSACTION ${savepoint};\\s+INSERT asyncexec\\.AsyncExecErrors`),
      'a doomed or ended transaction is thrown on; otherwise back to the savepoint, and the failed SEND logged',
    );
    // final status: FAILED before CANCELLED before SUCCEEDED
    assert.match(code, /status = 'FAILED'\) THEN 'FAILED'[\s\S]*?status = 'CANCELLED'\) THEN 'CANCELLED'\s+ELSE 'SUCCEEDED' END;/);
    assert.match(code, /SET status = @final, finished_at = SYSUTCDATETIME\(\)\s+WHERE id = @batchId AND status = 'RUNNING';/);
  });

  it('releases the next stage only when every released member has ended, enqueuing held calls as invoke does', async () => {
    const { sql: code } = (await procedures()).get('usp_AsyncExecBatchSettle')!;
    const open = code.indexOf("stage <= @currentStage AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))");
    const last = code.indexOf('IF @currentStage >= @stageCount');
    const next = code.indexOf('SET @currentStage += 1;');
    assert.ok(open > 0 && last > open && next > last, 'stage complete, then the last stage, then the next one');
    assert.match(code.slice(next), /^SET @currentStage \+= 1;\s+UPDATE asyncexec\.AsyncExecBatches SET current_stage = @currentStage WHERE id = @batchId;/);
    const release = code.slice(next);
    assert.match(release, /e\.stage = @currentStage AND e\.held = 1 AND e\.status = 'WAITING'/);
    const dialog = release.indexOf('BEGIN DIALOG CONVERSATION @h');
    assert.ok(dialog > 0 && release.indexOf('SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request]', dialog) > dialog);
    assert.match(release, /SET held = 0, initiator_handle = @h,\s+status = CASE WHEN run_at > @now THEN 'WAITING' ELSE 'PENDING' END/);
    // one call that cannot be enqueued fails alone (50013) instead of undoing the outcome that released it
    assert.match(release, /ROLLBACK TRANSACTION usp_AsyncExecBatchSettle;\s+UPDATE asyncexec\.AsyncExecResults\s+SET held = 0, status = 'FAILED'/);
    assert.match(release, /error_number = 50013/);
  });

  it('holds the calls of later stages in usp_AsyncExecInvoke: no dialog, no message', async () => {
    const { sql: code } = (await procedures()).get('usp_AsyncExecInvoke')!;
    const check = code.indexOf(BATCH_LOCK);
    assert.ok(check > 0 && check < code.indexOf('BEGIN TRY'), 'the batch is checked (and locked) before any write');
    assert.ok(code.lastIndexOf('IF @@TRANCOUNT = 0', check) > code.indexOf('IF @batchId IS NOT NULL OR @stage IS NOT NULL'), 'only inside a transaction, which keeps the lock');
    assert.match(code, /THROW 50005, @message, 1;\s+END;\s+SET @held = CASE WHEN @stage > @currentStage THEN 1 ELSE 0 END;/);
    assert.match(code, /IF @held = 0\s+BEGIN\s+BEGIN DIALOG CONVERSATION @h/);
    assert.match(code, /IF @held = 0\s+BEGIN\s+SET @body = [^;]+;\s+SEND ON CONVERSATION @h/);
    assert.match(code, /@batchId, @stage, @held\);/);
  });

  it('purges the members of a batch only with it, once it ended before the cutoff, then the batches left empty', async () => {
    const { sql: code } = (await procedures()).get('usp_AsyncExecPurge')!;
    // as asyncproc.purge on PostgreSQL: not merely "the batch is not RUNNING", which would take
    // old members of a batch that ended a minute ago and leave it reporting part of its calls
    assert.match(
      code,
      /AND \(e\.batch_id IS NULL\s+OR EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecBatches AS b WHERE b\.id = e\.batch_id AND b\.finished_at < @cutoff\)\)/,
    );
    assert.doesNotMatch(code, /b\.status = 'RUNNING'/);
    // (in bounded batches since issue 11: test/mssql-recovery.test.ts)
    const executions = code.indexOf('DELETE e\n');
    const batches = code.indexOf('DELETE b\n');
    assert.ok(executions > 0 && batches > executions);
    assert.match(code.slice(batches), /b\.status IN \('SUCCEEDED', 'FAILED', 'CANCELLED'\)\s+AND NOT EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecResults AS e WHERE e\.batch_id = b\.id\)/);
  });
  it('clears held on a member that is cancelled, by usp_AsyncExecCancel or by the settle (as PostgreSQL does)', async () => {
    const all = await procedures();
    assert.match(all.get('usp_AsyncExecCancel')!.sql, /SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0\s+WHERE id = @id AND status IN \('WAITING', 'PENDING'\);/);
    assert.match(all.get('usp_AsyncExecBatchCancelUnstarted')!.sql, /SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0,/);
  });

  it('stores the failure policy as the service reads it (upper case, no trailing blanks) before checking it', async () => {
    const { sql: code } = (await procedures()).get('usp_AsyncExecBatchCreate')!;
    const normalised = code.indexOf("SET @onFailure = UPPER(RTRIM(COALESCE(@onFailure, 'CANCEL')));");
    assert.ok(normalised > 0, 'normalised');
    assert.ok(normalised < code.indexOf("IF @onFailure NOT IN ("), 'before the check');
  });
});

describe('mssql: batches (TypeScript)', () => {
  const badInput = (pattern: RegExp) => (error: unknown) => error instanceof EngineError && error.code === 'BAD_USER_INPUT' && pattern.test(error.message);
  const call = (tag: string) => ({ procedure: 'demo.record', arguments: { tag } });

  it('refuses no stages, an empty stage and a bad policy before anything is written', async () => {
    assert.throws(() => checkBatch([]), badInput(/at least one stage/));
    assert.throws(() => checkBatch([[call('a')], []]), badInput(/stage 2/));
    assert.throws(() => checkBatch([[call('a')]], { onFailure: 'STOP' as never }), badInput(/CANCEL or CONTINUE/));
    assert.throws(() => checkBatch([[call('a')]], { submittedBy: 'x'.repeat(257) }), badInput(/submittedBy/));
    assert.throws(() => checkBatch([[call('a')]], { idempotencyKey: ' nightly' }), badInput(/white space/));
    assert.deepEqual(checkBatch([[call('a')]]), { onFailure: 'CANCEL', submittedBy: null, idempotencyKey: null });
    assert.deepEqual(checkBatch([[call('a')]], { onFailure: 'CONTINUE', submittedBy: 'me', idempotencyKey: 'nightly-1' }), {
      onFailure: 'CONTINUE',
      submittedBy: 'me',
      idempotencyKey: 'nightly-1',
    });
    // the digest a batch's key is compared by: the calls in order and the policy, not the caller
    const digest = (stages: InvokeCall[][], onFailure: 'CANCEL' | 'CONTINUE' = 'CANCEL') => batchDigest(stages, onFailure).toString('hex');
    assert.equal(digest([[call('a')], [call('b')]]), digest([[call('a')], [{ ...call('b'), submittedBy: 'someone' }]]));
    assert.equal(batchDigest([[call('a')]], 'CANCEL').length, 32);
    // arguments as usp_AsyncExecInvoke receives them: a bigint is its exact digits, not a TypeError
    const big = (n: bigint): InvokeCall => ({ procedure: 'demo.big', arguments: { n } });
    assert.notEqual(batchDigest([[big(12345678901234567890n)]], 'CANCEL').toString('hex'), batchDigest([[big(12345678901234567891n)]], 'CANCEL').toString('hex'));
    for (const other of [digest([[call('b')], [call('a')]]), digest([[call('a'), call('b')]]), digest([[call('a')], [call('b')]], 'CONTINUE'), digest([[call('a')], [{ ...call('b'), maxAttempts: 2 }]])]) {
      assert.notEqual(other, digest([[call('a')], [call('b')]]));
    }
    // the transaction is never asked for anything
    const tx = new Proxy({}, { get: () => assert.fail('no request expected') }) as unknown as sql.Transaction;
    await assert.rejects(submitBatch(tx, [[]]), badInput(/stage 1/));
  });

  it('creates the batch, then invokes every call with its batch and 1-based stage, in order', async () => {
    const calls: Array<{ procedure: string; params: Record<string, unknown> }> = [];
    const original = sql.Request.prototype.execute;
    sql.Request.prototype.execute = async function (this: sql.Request, procedure: string) {
      const params = Object.fromEntries(
        Object.entries(this.parameters as Record<string, { value: unknown }>).map(([name, p]) => [name, p.value]),
      );
      calls.push({ procedure, params });
      return procedure === 'asyncexec.usp_AsyncExecBatchCreate'
        ? { output: { batchId: 'ABCDEF01-2345-6789-ABCD-EF0123456789' } }
        : { output: { id: String(calls.length), token: null } };
    } as unknown as typeof original;
    try {
      const { id, replayed } = await submitBatch({} as sql.Transaction, [[call('a'), call('b')], [{ ...call('c'), submittedBy: 'own' }]], {
        onFailure: 'CONTINUE',
        submittedBy: 'batcher',
      });
      assert.equal(id, 'abcdef01-2345-6789-abcd-ef0123456789');
      assert.equal(replayed, false);
      assert.deepEqual(
        calls.map((c) => [c.procedure, c.params.stageCount ?? c.params.stage, c.params.onFailure ?? c.params.batchId, c.params.submittedBy]),
        [
          ['asyncexec.usp_AsyncExecBatchCreate', 2, 'CONTINUE', 'batcher'],
          ['asyncexec.usp_AsyncExecInvoke', 1, id, 'batcher'],
          ['asyncexec.usp_AsyncExecInvoke', 1, id, 'batcher'],
          ['asyncexec.usp_AsyncExecInvoke', 2, id, 'own'],
        ],
      );
    } finally {
      sql.Request.prototype.execute = original;
    }
  });

  const row = (over: Partial<BatchRow>): BatchRow => ({
    id: 'ABCDEF01-2345-6789-ABCD-EF0123456789',
    status: 'RUNNING',
    on_failure: 'CANCEL',
    current_stage: 2,
    stage_count: 3,
    submitted_at: new Date('2024-03-01T12:00:00Z'),
    finished_at: null,
    submitted_by: 'me',
    stage: null,
    total: null,
    waiting: null,
    pending: null,
    running: null,
    succeeded: null,
    failed: null,
    cancelled: null,
    ...over,
  });

  it('maps a batch with a count for every stage, zero where no member is left', () => {
    const batch = toBatch([
      row({ stage: 1, total: 2, succeeded: 2, waiting: 0, pending: 0, running: 0, failed: 0, cancelled: 0 }),
      row({ stage: 2, total: 3, running: 1, pending: 1, waiting: 1, succeeded: 0, failed: 0, cancelled: 0 }),
    ])!;
    assert.equal(batch.id, 'abcdef01-2345-6789-abcd-ef0123456789');
    assert.equal(batch.onFailure, 'CANCEL');
    assert.equal(batch.currentStage, 2);
    assert.equal(batch.stageCount, 3);
    assert.deepEqual(batch.stages, [
      { stage: 1, total: 2, waiting: 0, pending: 0, running: 0, succeeded: 2, failed: 0, cancelled: 0 },
      { stage: 2, total: 3, waiting: 1, pending: 1, running: 1, succeeded: 0, failed: 0, cancelled: 0 },
      { stage: 3, total: 0, waiting: 0, pending: 0, running: 0, succeeded: 0, failed: 0, cancelled: 0 },
    ]);
    // all members purged: the OUTER APPLY gives one row without a stage
    assert.equal(toBatch([row({ status: 'SUCCEEDED', finished_at: new Date() })])!.stages.every((s) => s.total === 0), true);
    assert.equal(toBatch([]), null);
  });

  it('maps batch and stage of an execution, null outside a batch', () => {
    const base = {
      id: '5', token: 'AAAAAAAA-0000-0000-0000-000000000005', procedure: 'demo.noop', arguments: '{}', queue: 'default',
      status: 'WAITING', submitted_at: new Date(0), run_at: null, started_at: null, finished_at: null, attempts: 0,
      max_attempts: 1, submitted_by: null, error_number: null, error_severity: null, error_state: null, error_line: null,
      error_message: null, result: null, session_id: null, worker: null, row_version: Buffer.alloc(8, 1),
    } as const;
    const member = toExecution({ ...base, batch_id: 'ABCDEF01-2345-6789-ABCD-EF0123456789', stage: 2 } as ExecutionRow);
    assert.equal(member.batchId, 'abcdef01-2345-6789-abcd-ef0123456789');
    assert.equal(member.stage, 2);
    const alone = toExecution({ ...base, batch_id: null, stage: null } as ExecutionRow);
    assert.equal(alone.batchId, null);
    assert.equal(alone.stage, null);
  });
});

describe('mssql: monitoring', () => {
  it('reports recent outcomes by queue and echoes the window', () => {
    const info = toQueueInfo(
      { name: 'default', concurrency: 10, paused: true, waiting: 1, pending: 2, running: 3, recent_succeeded: 4, recent_failed: 5, recent_cancelled: 6 },
      3600,
    );
    assert.deepEqual(info, {
      name: 'default', concurrency: 10, paused: true, groupCommits: { size: 1, maxMs: 50 }, waiting: 1, pending: 2, running: 3,
      recent: { succeeded: 4, failed: 5, cancelled: 6 }, recentSeconds: 3600,
    });
  });

  it('takes a whole, non-negative window that DATEADD accepts', () => {
    assert.equal(checkRecentSeconds(3600), 3600);
    assert.equal(checkRecentSeconds(90.9), 90);
    assert.equal(checkRecentSeconds(0), 0);
    assert.equal(checkRecentSeconds(1e12), 2_147_483_647);
    for (const bad of [-1, Number.NaN, Number.POSITIVE_INFINITY]) {
      assert.throws(() => checkRecentSeconds(bad), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT', String(bad));
    }
  });

  it('refuses a bad limit for the running list before asking the server', async () => {
    const pool = { request: () => assert.fail('no request expected') } as unknown as sql.ConnectionPool;
    for (const bad of [-1, 1.5, Number.NaN]) {
      await assert.rejects(listRunning(pool, null, bad), (e: unknown) => e instanceof EngineError && e.code === 'BAD_USER_INPUT');
    }
  });
});

describe('mssql: cancelBatch (T-SQL)', () => {
  const BATCH_LOCK = 'FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)';
  const SETTLE = 'EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;';
  /** usp_AsyncExecCancelBatch as migrated: `code` without comments and strings, `sql` without comments. */
  async function cancelBatchProcedure() {
    const found = (await currentProcedures()).get('usp_AsyncExecCancelBatch');
    assert.ok(found, 'some script creates usp_AsyncExecCancelBatch');
    const sqlText = found.text.replace(/\/\*[\s\S]*?\*\//g, (m) => m.replace(/[^\n]/g, ' ')).replace(/--[^\n]*/g, (m) => ' '.repeat(m.length));
    return { file: found.file, text: found.text, code: codeOnly(found.text), sql: sqlText };
  }

  it('lives in its own procedure file', async () => {
    const { file, code } = await cancelBatchProcedure();
    assert.equal(file, 'procedures/usp_AsyncExecCancelBatch.sql');
    assert.match(code, /^\s*CREATE OR ALTER PROCEDURE asyncexec\.usp_AsyncExecCancelBatch\b/);
  });

  it('locks the batch row first, in its one transaction, and takes no application lock', async () => {
    const { code, sql: text } = await cancelBatchProcedure();
    const begin = code.indexOf('BEGIN TRANSACTION');
    assert.ok(begin > 0);
    assert.equal(code.indexOf('BEGIN TRANSACTION', begin + 1), -1, 'one transaction');
    const lock = code.indexOf(BATCH_LOCK);
    assert.ok(lock > begin, 'the batch row is locked inside the transaction');
    const members = [...code.matchAll(/asyncexec\.(AsyncExecResults|usp_AsyncExecBatchCancelUnstarted)\b/g)].map((m) => m.index!);
    assert.ok(members.length >= 2);
    for (const at of members) assert.ok(at > lock, `member rows (at ${at}) only after the batch row`);
    assert.doesNotMatch(code, /sp_getapplock/, 'no per-call application lock while the batch row is held (lock order)');
    // NOT_FOUND / FINISHED decided under the lock, before anything changes
    const refused = text.search(/IF @status IS NULL OR @status <> 'RUNNING'\s+BEGIN\s+ROLLBACK TRANSACTION;/);
    assert.ok(refused > lock && refused < members[0]);
    assert.match(text, /SET @outcome = CASE WHEN @status IS NULL THEN 'NOT_FOUND' ELSE 'FINISHED' END;\s+RETURN;/);
  });

  it('cancels every member not yet started as the settle does, marks running ones, and settles before the commit', async () => {
    const { code, sql: text } = await cancelBatchProcedure();
    // the settle's own cancel (usp_AsyncExecBatchCancelUnstarted: WAITING, held or not, and
    // PENDING; the wake-up request of usp_AsyncExecCancel under a savepoint), with our message
    const cancel = text.search(/EXEC asyncexec\.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId, @reason = N'cancelled with its batch';/);
    assert.ok(cancel > 0);
    assert.equal(statusUpdates(code).length, 0, 'no status changed here but through usp_AsyncExecBatchCancelUnstarted');
    // RUNNING members: only cancel_requested, their status is left to whoever ends them; after
    // the cancel, which leaves none WAITING or PENDING (so none can start meanwhile)
    const running = text.search(/UPDATE asyncexec\.AsyncExecResults\s+SET cancel_requested = 1\s+WHERE batch_id = @batchId AND status = 'RUNNING' AND cancel_requested = 0;/);
    assert.ok(running > cancel);
    const settle = code.indexOf(SETTLE);
    const lastUpdate = code.lastIndexOf('UPDATE asyncexec.AsyncExecResults');
    const commit = code.lastIndexOf('COMMIT TRANSACTION');
    assert.ok(settle > lastUpdate && settle < commit, 'settled after every member change, before the commit');
    assert.match(text, /COMMIT TRANSACTION;\s+SET @outcome = 'CANCELLED';/);
  });

  it('ends the statement before each THROW with a semicolon, refuses an open transaction, rolls back on error', async () => {
    const { code, sql: text } = await cancelBatchProcedure();
    const throws = [...code.matchAll(/\bTHROW\b/g)];
    assert.ok(throws.length >= 3);
    for (const match of throws) {
      const before = code.slice(0, match.index).trimEnd();
      assert.ok(before.endsWith(';') || /\bBEGIN$/.test(before), `the statement before THROW at ${match.index} ends with a semicolon`);
    }
    assert.match(text, /IF @@TRANCOUNT > 0\s+BEGIN\s+(?:SET @message = [^;]+;\s+)+THROW 50023, @message, 1;/);
    assert.ok(text.indexOf('IF @@TRANCOUNT > 0') < text.indexOf('BEGIN TRANSACTION'));
    assert.match(text, /BEGIN CATCH\s+IF XACT_STATE\(\) <> 0\s+ROLLBACK TRANSACTION;\s+THROW;\s+END CATCH;\s+END;\s*$/);
    assert.match(text, /SET XACT_ABORT OFF;/, 'a failed wake-up SEND leaves the transaction usable');
  });
});

describe('mssql: cancelBatch (TypeScript)', () => {
  const ID = 'abcdef01-2345-6789-abcd-ef0123456789';
  const batch = (status: BatchStatus): Batch => ({
    id: ID,
    status,
    onFailure: 'CANCEL',
    currentStage: 1,
    stageCount: 1,
    submittedAt: new Date(0),
    finishedAt: status === 'RUNNING' ? null : new Date(1),
    submittedBy: null,
    stages: [],
  });
  const code = (expected: string) => (error: unknown) => error instanceof EngineError && error.code === expected;

  /**
   * Fake steps: `members` are the RUNNING members (their first request's answer, then their
   * reads in turn, the last repeating); `batches` the batch reads in turn (the last repeats).
   */
  function fake(
    outcome: CancelBatchOutcome,
    members: Record<string, { request: CancelRequestStatus | Error; statuses: ExecutionStatus[] }>,
    batches: BatchStatus[],
  ) {
    const log: string[] = [];
    let clock = 0;
    const steps: CancelBatchSteps = {
      async cancel() {
        log.push('cancel');
        return outcome;
      },
      async running() {
        log.push('running');
        return Object.keys(members);
      },
      member(token) {
        const member = members[token];
        return {
          async request() {
            log.push(`request:${token}`);
            if (member.request instanceof Error) throw member.request;
            return { id: token, status: member.request };
          },
          async read() {
            const status = member.statuses.length > 1 ? member.statuses.shift()! : member.statuses[0];
            log.push(`read:${token}:${status}`);
            return { status } as Execution;
          },
          async kill(_id, killed) {
            log.push(`kill:${token}`);
            killed.add(1);
          },
          async settle() {
            log.push(`settle:${token}`);
          },
          sleep: async () => assert.fail('member steps do not sleep here'),
          now: () => clock,
        };
      },
      async read() {
        const status = batches.length > 1 ? batches.shift()! : batches[0];
        log.push(`batch:${status}`);
        return batch(status);
      },
      async sleep(ms) {
        log.push('sleep');
        clock += ms;
      },
      now: () => clock,
    };
    return { steps, log };
  }

  it('refuses an unknown batch (NOT_FOUND) and one that has ended (ALREADY_FINISHED), changing nothing else', async () => {
    const missing = fake('NOT_FOUND', {}, ['RUNNING']);
    await assert.rejects(runCancelBatch(ID, missing.steps, { allowKill: true }), code('NOT_FOUND'));
    assert.deepEqual(missing.log, ['cancel']);
    const ended = fake('FINISHED', {}, ['SUCCEEDED']);
    await assert.rejects(runCancelBatch(ID, ended.steps, { allowKill: true }), code('ALREADY_FINISHED'));
    assert.deepEqual(ended.log, ['cancel']);
  });

  it('without allowKill returns the batch at once: running members run to their end, which is no error', async () => {
    const { steps, log } = fake('CANCELLED', { a: { request: new EngineError('FORBIDDEN', 'no'), statuses: ['RUNNING'] } }, ['RUNNING']);
    assert.equal((await runCancelBatch(ID, steps, { allowKill: false })).status, 'RUNNING');
    assert.deepEqual(log, ['cancel', 'batch:RUNNING']);
  });

  it('returns at once when no member is running', async () => {
    const { steps, log } = fake('CANCELLED', {}, ['CANCELLED']);
    assert.equal((await runCancelBatch(ID, steps, { allowKill: true })).status, 'CANCELLED');
    assert.deepEqual(log, ['cancel', 'running', 'batch:CANCELLED']);
  });

  it('asks every running member to stop before killing any, then kills and waits for them together', async () => {
    const { steps, log } = fake(
      'CANCELLED',
      { a: { request: 'RUNNING', statuses: ['RUNNING', 'CANCELLED'] }, b: { request: 'RUNNING', statuses: ['CANCELLED'] } },
      ['RUNNING', 'CANCELLED'],
    );
    assert.equal((await runCancelBatch(ID, steps, { allowKill: true })).status, 'CANCELLED');
    assert.deepEqual(log, [
      'cancel',
      'running',
      'request:a',
      'request:b',
      'kill:a',
      'settle:a',
      'read:a:RUNNING',
      'kill:b',
      'settle:b',
      'read:b:CANCELLED',
      'batch:RUNNING',
      'sleep',
      'kill:a',
      'settle:a',
      'read:a:CANCELLED',
      'batch:CANCELLED',
    ]);
  });

  it('gives up waiting after waitMs and returns the batch as it is', async () => {
    const { steps, log } = fake('CANCELLED', { a: { request: 'RUNNING', statuses: ['RUNNING'] } }, ['RUNNING']);
    const result = await runCancelBatch(ID, steps, { allowKill: true, waitMs: 300, pollMs: 100 });
    assert.equal(result.status, 'RUNNING');
    assert.equal(log.filter((l) => l === 'sleep').length, 3);
    assert.equal(log.at(-1), 'batch:RUNNING');
  });

  it('does not wait for a member it may not kill (reported), nor for one that ended meanwhile (not reported)', async () => {
    const reported: string[] = [];
    const { steps, log } = fake(
      'CANCELLED',
      {
        a: { request: new EngineError('FORBIDDEN', 'lacks ALTER ANY CONNECTION'), statuses: ['RUNNING'] },
        b: { request: new EngineError('ALREADY_FINISHED', 'done'), statuses: ['SUCCEEDED'] },
      },
      ['RUNNING'],
    );
    const result = await runCancelBatch(ID, steps, { allowKill: true, onMemberError: (token) => reported.push(token) });
    assert.equal(result.status, 'RUNNING');
    assert.deepEqual(log, ['cancel', 'running', 'request:a', 'request:b', 'batch:RUNNING']);
    assert.deepEqual(reported, ['a']);
  });

  it('maps the procedure’s outcome and errors, and refuses a malformed id before asking the server', async () => {
    const calls: Array<{ procedure: string; batchId: unknown }> = [];
    let answer: () => unknown = () => ({ output: { outcome: 'NOT_FOUND' } });
    const originalExecute = sql.Request.prototype.execute;
    const originalQuery = sql.Request.prototype.query;
    sql.Request.prototype.execute = async function (this: sql.Request, procedure: string) {
      calls.push({ procedure, batchId: (this.parameters as Record<string, { value: unknown }>).batchId?.value });
      return answer();
    } as unknown as typeof originalExecute;
    sql.Request.prototype.query = async function () {
      return {
        recordset: [
          {
            id: ID.toUpperCase(), status: 'CANCELLED', on_failure: 'CANCEL', current_stage: 1, stage_count: 1,
            submitted_at: new Date(0), finished_at: new Date(1), submitted_by: null,
            stage: 1, total: 2, waiting: 0, pending: 0, running: 0, succeeded: 1, failed: 0, cancelled: 1,
          } satisfies BatchRow,
        ],
      };
    } as unknown as typeof originalQuery;
    const pool = {} as sql.ConnectionPool;
    const thrown = (number: number) => {
      const error = new sql.RequestError(`error ${number}`, 'EREQUEST');
      error.number = number;
      return error;
    };
    try {
      for (const bad of ['', 'not-a-uuid', `${ID}x`, 42 as unknown as string]) {
        await assert.rejects(cancelBatch(pool, bad, { allowKill: true }), code('BAD_USER_INPUT'), String(bad));
      }
      assert.equal(calls.length, 0, 'nothing reached the server');
      await assert.rejects(cancelBatch(pool, ID, { allowKill: true }), code('NOT_FOUND'));
      assert.deepEqual(calls, [{ procedure: 'asyncexec.usp_AsyncExecCancelBatch', batchId: ID }]);
      answer = () => ({ output: { outcome: 'FINISHED' } });
      await assert.rejects(cancelBatch(pool, ID, { allowKill: true }), code('ALREADY_FINISHED'));
      answer = () => {
        throw thrown(50005);
      };
      await assert.rejects(cancelBatch(pool, ID, { allowKill: true }), code('BAD_USER_INPUT'));
      answer = () => {
        throw thrown(50023);
      };
      await assert.rejects(cancelBatch(pool, ID, { allowKill: true }), (error) => error instanceof Error && !(error instanceof EngineError));
      answer = () => ({ output: { outcome: null } });
      await assert.rejects(cancelBatch(pool, ID, { allowKill: true }), /reported null/);
      // cancelled, KILL not allowed: the batch as getBatch reads it, at once
      answer = () => ({ output: { outcome: 'CANCELLED' } });
      const result = await cancelBatch(pool, ID.toUpperCase(), { allowKill: false });
      assert.equal(result.id, ID);
      assert.equal(result.status, 'CANCELLED');
      assert.deepEqual(result.stages.map((s) => [s.succeeded, s.cancelled]), [[1, 1]]);
    } finally {
      sql.Request.prototype.execute = originalExecute;
      sql.Request.prototype.query = originalQuery;
    }
  });
});

describe('mssql: identity (0009_identity.sql)', () => {
  /** Calls sql.Request makes while `fn` runs: the procedure or query text and the parameters, answered with nothing. */
  async function requests(fn: () => Promise<unknown>): Promise<Array<{ text: string; params: Record<string, unknown> }>> {
    const seen: Array<{ text: string; params: Record<string, unknown> }> = [];
    const { execute, query } = sql.Request.prototype;
    const record = function (this: sql.Request, text: string) {
      const params = Object.fromEntries(Object.entries(this.parameters as Record<string, { value: unknown }>).map(([n, p]) => [n, p.value]));
      seen.push({ text, params });
      const recordset = text.includes('COUNT_BIG') ? [{ n: 0 }] : [];
      return Promise.resolve({ recordset, recordsets: [[], [{ upto: Buffer.alloc(8) }]], output: { id: '1' } });
    };
    sql.Request.prototype.execute = record as unknown as typeof execute;
    sql.Request.prototype.query = record as unknown as typeof query;
    try {
      await fn();
    } finally {
      sql.Request.prototype.execute = execute;
      sql.Request.prototype.query = query;
    }
    return seen;
  }
  const current = async (name: string) => {
    const found = (await currentProcedures()).get(name);
    assert.ok(found, `some script creates ${name}`);
    return { file: found.file, code: codeOnly(found.text) };
  };

  it('maps 50009 (the caller’s roles do not allow the procedure) to FORBIDDEN', () => {
    const error = new sql.RequestError('no', 'EREQUEST');
    error.number = 50009;
    const mapped = mapDatabaseError(error);
    assert.ok(mapped instanceof EngineError && mapped.code === 'FORBIDDEN');
  });

  it('passes the caller’s valid role names to usp_AsyncExecInvoke as a JSON array, and NULL (not checked) when there are none', async () => {
    const tx = {} as sql.Transaction;
    const seen = await requests(async () => {
      await enqueue(tx, { procedure: 'demo.noop', arguments: {}, callerRoles: ['ops', 'admin ', 'ops', 'x y', 'reporting:read'] });
      await enqueue(tx, { procedure: 'demo.noop', arguments: {}, callerRoles: [] });
      await enqueue(tx, { procedure: 'demo.noop', arguments: {} });
    });
    assert.deepEqual(
      seen.map((r) => [r.text, r.params.callerRoles]),
      [
        ['asyncexec.usp_AsyncExecInvoke', '["ops","reporting:read"]'],
        ['asyncexec.usp_AsyncExecInvoke', '[]'],
        ['asyncexec.usp_AsyncExecInvoke', null],
      ],
    );
  });

  it('refuses a withdrawn registration and checks the caller’s roles, exactly, before usp_AsyncExecInvoke writes anything', async () => {
    const { file, code } = await current('usp_AsyncExecInvoke');
    assert.equal(file, 'procedures/usp_AsyncExecInvoke.sql', 'the definition that counts');
    assert.match(code, /WHERE r\.name = @procedure AND r\.unregistered_at IS NULL;/);
    const forbidden = code.indexOf('THROW 50009');
    assert.ok(forbidden > code.indexOf('THROW 50001') && forbidden < code.indexOf('BEGIN TRY'), 'after the registry lookup, before any write');
    assert.match(code, /IF @callerRoles IS NOT NULL AND EXISTS \(SELECT 1 FROM OPENJSON\(@registeredRoles\)\)/);
    assert.match(code, /c\.\[value\] COLLATE Latin1_General_BIN2 = r\.\[value\]\s+AND DATALENGTH\(c\.\[value\]\) = DATALENGTH\(r\.\[value\]\)/);
    assert.match(code, /c\.\[value\] COLLATE Latin1_General_BIN2 = '\s+' AND DATALENGTH\(c\.\[value\]\) = DATALENGTH\('\s+'\)/, 'admin, exactly');
    assert.ok(code.indexOf('ISJSON(@callerRoles) = 0') < code.indexOf('OPENJSON(@callerRoles)'), 'malformed roles are refused, not an OPENJSON error');
  });

  it('registers with roles, clearing a withdrawal; unregisters by marking the row (NOT_FOUND: 50006)', async () => {
    const register = (await current('usp_AsyncExecRegister')).code;
    assert.match(register, /roles = @roles, unregistered_at = NULL/);
    assert.ok(register.indexOf('THROW 50005', register.indexOf('ISJSON(@roles)')) < register.indexOf('UPDATE asyncexec.AsyncExecProcedures'));
    const { file, code } = await current('usp_AsyncExecUnregister');
    assert.equal(file, 'procedures/usp_AsyncExecUnregister.sql');
    assert.match(code, /UPDATE asyncexec\.AsyncExecProcedures SET unregistered_at = SYSUTCDATETIME\(\)\s+WHERE name = @procedure AND unregistered_at IS NULL;\s+IF @@ROWCOUNT = 0/);
    assert.doesNotMatch(code, /DELETE/, 'the row stays for the calls submitted before');
  });

  it('filters by submittedBy exactly (case and trailing blanks count, an empty subject is one) in every read', async () => {
    const pool = {} as sql.ConnectionPool;
    const exact = /e\.submitted_by = @submittedBy AND e\.submitted_by COLLATE Latin1_General_BIN2 = @submittedBy\s+AND DATALENGTH\(e\.submitted_by\) = DATALENGTH\(@submittedBy\)/;
    for (const subject of ['alice', '']) {
      const seen = await requests(async () => {
        await listExecutions(pool, { submittedBy: subject }, { first: 5 });
        await countExecutions(pool, { submittedBy: subject });
        await readChanges(pool, { xmin: 1n, xmax: 1n, xip: [] }, { filter: { submittedBy: subject }, limit: 10 });
        await listRunning(pool, null, 10, subject);
      });
      assert.equal(seen.length, 4);
      for (const { text, params } of seen) {
        assert.match(text, exact);
        assert.equal(params.submittedBy, subject);
      }
    }
    const unfiltered = await requests(() => listRunning(pool, null, 10, null));
    assert.doesNotMatch(unfiltered[0].text, /submitted_by =/);
  });

  it('filters by procedure, queue and schedule exactly, as PostgreSQL and the change feed do; a value longer than its column matches nothing and is never sent', async () => {
    const pool = {} as sql.ConnectionPool;
    const filters = { procedure: ['procedure', 'e\\.\\[procedure\\]', 261], queue: ['queue', 'e\\.queue', 100], schedule: ['schedule', 'e\\.schedule_name', 128] } as const;
    for (const [key, [param, column, max]] of Object.entries(filters)) {
      const exact = new RegExp(`${column} = @${param} AND ${column} COLLATE Latin1_General_BIN2 = @${param} AND DATALENGTH\\(${column}\\) = DATALENGTH\\(@${param}\\)`);
      const fits = await requests(async () => {
        await listExecutions(pool, { [key]: 'Default' }, { first: 5 });
        await readChanges(pool, { xmin: 1n, xmax: 1n, xip: [] }, { filter: { [key]: 'Default' }, limit: 10 });
      });
      for (const { text, params } of fits) {
        assert.match(text, exact, key);
        assert.equal(params[param], 'Default');
      }
      const long = await requests(() => listExecutions(pool, { [key]: 'x'.repeat(max + 1) }, { first: 5 }));
      assert.match(long[0].text, /1 = 0/, key);
      assert.equal(long[0].params[param], undefined, `${key}: not sent`);
    }
    const running = await requests(async () => {
      await listRunning(pool, 'Default', 10, null);
      await listRunning(pool, 'x'.repeat(101), 10, null);
    });
    assert.match(running[0].text, /e\.queue = @queue AND e\.queue COLLATE Latin1_General_BIN2 = @queue/);
    assert.match(running[1].text, /1 = 0/);
  });

  it('usp_AsyncExecInvoke, usp_AsyncExecRegister and a refused schedule fire record the queue as it is named; argument names are cut in messages (the service refuses long ones); a uniqueidentifier must have its shape, whole', async () => {
    const { code } = await current('usp_AsyncExecInvoke');
    assert.match(code, /SELECT @service = service_name, @queueName = name FROM asyncexec\.AsyncExecQueues WHERE name = @queue;/);
    assert.ok(code.indexOf('SET @queue = @queueName;') > code.indexOf('THROW 50003') && code.indexOf('SET @queue = @queueName;') < code.indexOf('INSERT asyncexec.AsyncExecResults'));
    // the unknown and the duplicate argument's messages (codeOnly blanks the literals)
    assert.equal([...code.matchAll(/CONCAT\(N?'[^']*', LEFT\(a\.\[key\], 200\), N?'[^']*'\)/g)].length, 2);
    assert.doesNotMatch(code, /CONCAT\(N?'[^']*', a\.\[key\]/, 'no message takes a whole key');
    // and the service refuses an argument name longer than any parameter's before the call
    await assert.rejects(
      enqueue({} as sql.Transaction, { procedure: 'dbo.p', arguments: { ['k'.repeat(129)]: 1 } }),
      (e: unknown) => e instanceof EngineError && e.code === 'INVALID_ARGUMENTS',
    );
    // a registration and a refused schedule fire record the queue (and procedure) as named too
    const register = (await current('usp_AsyncExecRegister')).code;
    assert.match(register, /SELECT @queueName = name FROM asyncexec\.AsyncExecQueues WHERE name = @queue;\s+IF @queueName IS NULL/);
    assert.ok(register.indexOf('SET @queue = @queueName;') > register.indexOf('THROW 50003') && register.indexOf('SET @queue = @queueName;') < register.indexOf('UPDATE asyncexec.AsyncExecProcedures'));
    const fire = (await current('usp_AsyncExecFireSchedule')).code;
    assert.match(fire, /COALESCE\(@registeredName, @procedure\), @arguments, COALESCE\(@recordedQueue, @queue, @registeredQueue, '\s*'\)/);
    // N'uniqueidentifier', blanked by codeOnly (its N too): the shape, whole, bare or in braces
    assert.match(code, /ELSE IF @base = ' {17}'\s+AND NOT \(DATALENGTH\(@value\) = 72 AND @value COLLATE Latin1_General_BIN2 LIKE @guid\)\s+AND NOT \(DATALENGTH\(@value\) = 76 AND @value COLLATE Latin1_General_BIN2 LIKE '\s*' \+ @guid \+ '\s*'\)\s+SET @ok = 0;/);
    assert.match(code, /@guid nvarchar\(400\) = REPLACE\('\s+', '\s*', '\s+'\)/);
  });
});

describe('mssql: the procedures revision guard (0016_routines_revision.sql), checked without a server', () => {
  it('refuses a write of AsyncExecRoutines by a migrator older than the installed revision, with 50046, inside its transaction', async () => {
    const text = codeOnly(await readFile(path.join(MSSQL_SQL_DIR, '0016_routines_revision.sql'), 'utf8'));
    assert.match(text, /CREATE TRIGGER asyncexec\.TR_AsyncExecRoutines_guard ON asyncexec\.AsyncExecRoutines\s+AFTER INSERT, UPDATE/);
    assert.match(text, /TRY_CONVERT\(int, SESSION_CONTEXT\(N?'\s+'\)\)/);
    assert.match(text, /IF @installed IS NOT NULL AND @mine < @installed AND EXISTS \(SELECT 1 FROM inserted\)\s+BEGIN[\s\S]+THROW 50046, @message, 1;/);
    assert.doesNotMatch(text, /SET XACT_ABORT OFF/, "a trigger's error must roll the migrator's transaction back");
    const migrator = await readFile(new URL('../src/engines/mssql/migrator.ts', import.meta.url), 'utf8');
    // the migrator says its revision before its first write of AsyncExecRoutines, in the same transaction
    const said = migrator.indexOf("EXEC sys.sp_set_session_context @key = N'asyncexec.routines_revision', @value = @revision;");
    const written = migrator.indexOf('UPDATE asyncexec.AsyncExecRoutines SET sha256');
    assert.ok(said > 0 && said < written);
  });
});

describe('mssql: live progress through CONTEXT_INFO, checked without a server', () => {
  it('the run names its call for usp_AsyncExecProgress before running it, stores its last report with the outcome, and clears both after', async () => {
    const run = codeOnly((await currentProcedures()).get('usp_AsyncExecRun')!.text);
    const named = run.indexOf('EXEC sys.sp_set_session_context @key = ');
    const call = run.indexOf('EXEC sys.sp_executesql @sql');
    const stored = run.indexOf('EXEC asyncexec.usp_AsyncExecProgressRead @id = @id');
    const outcome = run.indexOf('UPDATE asyncexec.AsyncExecResults');
    assert.ok(named > 0 && named < call, 'the session context names the call before it runs');
    assert.ok(/SET CONTEXT_INFO 0x00;\s+BEGIN TRY\s+EXEC sys\.sp_executesql @sql/.test(run), "an earlier call's report is cleared before the call");
    assert.ok(stored > call && stored < outcome, 'the last report is stored before the outcome row is locked');
    // after the outcome: cleared whatever the session context says (a read_only key must not keep the lock)
    assert.match(
      run.slice(outcome),
      /SET CONTEXT_INFO 0x00;\s+BEGIN TRY\s+EXEC sys\.sp_set_session_context @key = '\s*', @value = NULL;\s+END TRY\s+BEGIN CATCH\s+END CATCH;\s+EXEC sys\.sp_releaseapplock/,
    );
    // before the call: a refusing session context costs the call's progress, not the call
    assert.match(run.slice(0, call), /BEGIN TRY\s+EXEC sys\.sp_set_session_context @key = '\s*', @value = @id;\s+END TRY\s+BEGIN CATCH\s+IF XACT_STATE\(\) = -1\s+BEGIN\s+THROW;\s+END;\s+END CATCH;/);
    // the last report is stored only in the outcome's own transaction: an error that doomed or ended it is rethrown
    assert.match(run.slice(call, outcome), /IF SUBSTRING\(CONTEXT_INFO\(\), 1, 4\) = 0x41455031\s+BEGIN\s+BEGIN TRY\s+EXEC asyncexec\.usp_AsyncExecProgressRead @id = @id;\s+END TRY\s+BEGIN CATCH\s+IF XACT_STATE\(\) <> 1 AND @fresh = 0\s+BEGIN\s+THROW;\s+END;\s+IF XACT_STATE\(\) = -1\s+ROLLBACK TRANSACTION;\s+IF @@TRANCOUNT = 0\s+BEGIN\s+BEGIN TRANSACTION;\s+BEGIN CONVERSATION TIMER \(@h\) TIMEOUT = @lease;/);
    // only a transaction that holds none of the call's work may be begun again
    assert.match(run, /BEGIN TRANSACTION;\s+BEGIN CONVERSATION TIMER \(@h\) TIMEOUT = @lease;\s+SET @fresh = 1;/);
  });

  it('a report read from a session is taken only for the call that session runs now, and never replaces a newer one', async () => {
    const read = codeOnly((await currentProcedures()).get('usp_AsyncExecProgressRead')!.text);
    // both paths (the service's reads of other sessions, the run's own report) take a report only for the call it names
    assert.equal(read.match(/e\.status = '\s*' AND e\.started_at IS NOT NULL AND d\.execution_id = e\.id/g)?.length, 2);
    assert.match(read, /r\.session_id = e\.session_id/);
    assert.match(read, /s\.session_id = e\.session_id/);
    assert.match(read, /WHERE e\.id = @id AND e\.session_id = @@SPID/);
    // the run's own path references no DMV (an impersonated activation context)
    const own = read.slice(read.indexOf('ELSE'), read.indexOf('MERGE'));
    assert.doesNotMatch(own, /sys\.dm_/);
    assert.match(read, /WHEN MATCHED AND \(p\.run_started_at < n\.started_at OR \(p\.run_started_at = n\.started_at AND p\.sequence < n\.sequence\)\)/);
    // no EXECUTE AS: the DMVs need the caller's own server permission
    assert.doesNotMatch(read, /EXECUTE\s+AS/i);
  });

  it('encodes a report in at most 128 bytes, in the layout the decoder reads', async () => {
    const text = await readFile(path.join(MSSQL_SQL_DIR, 'procedures', 'usp_AsyncExecProgress.sql'), 'utf8');
    const decoder = await readFile(path.join(MSSQL_SQL_DIR, 'procedures', 'AsyncExecProgressReport.sql'), 'utf8');
    // magic 4 + id 8 + number 4 + percent 2 + length 1 + at most 108 bytes of message
    assert.match(text, /IF DATALENGTH\(@text\) > 108\s+SET @text = SUBSTRING\(@text, 1, 108\);/);
    assert.ok(4 + 8 + 4 + 2 + 1 + 108 <= 128);
    assert.match(text, /0x41455031 \+ CAST\(@id AS binary\(8\)\) \+ CAST\(@sequence AS binary\(4\)\)/);
    for (const field of ['SUBSTRING(@info, 1, 4) = 0x41455031', 'SUBSTRING(@info, 5, 8) AS bigint', 'SUBSTRING(@info, 13, 4) AS int', 'SUBSTRING(@info, 17, 2) AS smallint', 'SUBSTRING(@info, 20, 2 *']) {
      assert.ok(decoder.includes(field), field);
    }
    assert.match(text, /THROW 50045, @error, 1;/);
  });
});
