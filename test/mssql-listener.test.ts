/**
 * The SQL Server listener without a server: the text of its batches and procedures, the
 * decisions of one notification cycle (driven with stand-in steps), and the start-up check
 * of READ_COMMITTED_SNAPSHOT. The same code runs against a server in the conformance suite
 * when MSSQL_URL is set.
 */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { describe, it } from 'node:test';
import { databaseProbe, databaseProblems, readCommittedSnapshotProblem, type DatabaseProbe } from '../src/engines/mssql/checks.js';
import {
  EndRetries,
  leftOpenBatch,
  LEFT_OPEN_BUDGET_MS,
  REQUEST_MARGIN_MS,
  RETRY_ENDS_LIMIT,
  LeftOpenSweep,
  MAX_END_ATTEMPTS,
  notifyCycle,
  receiveBatch,
  retryEndsBatch,
  type EndFailure,
  type LeftOpenResult,
  type NotifyCycleSteps,
  type ReceiveResult,
} from '../src/engines/mssql/listener.js';
import { MSSQL_SQL_DIR } from '../src/engines/mssql/migrator.js';
import type { Logger } from '../src/logger.js';

/** Comments blanked out, so a test never matches the explanation instead of the code. */
const code = (text: string) => text.replace(/--[^\n]*/g, '');
const procedure = async (name: string) => code(await readFile(path.join(MSSQL_SQL_DIR, 'procedures', `${name}.sql`), 'utf8'));

/** Each END CONVERSATION of the text, with the TRY…CATCH around it (or null when it has none). */
function endsAndTheirCatch(text: string): { tried: boolean; catchBody: string }[] {
  return [...text.matchAll(/END CONVERSATION @h;/g)].map((match) => {
    const before = text.slice(0, match.index);
    const tryAt = before.lastIndexOf('BEGIN TRY');
    const tried = tryAt >= 0 && before.slice(tryAt + 'BEGIN TRY'.length).trim() === '';
    const after = text.slice(match.index! + match[0].length);
    const catchMatch = /^\s*(?:SET @\w+ \+= 1;\s*)?END TRY\s*BEGIN CATCH([\s\S]*?)END CATCH;/.exec(after);
    return { tried: tried && catchMatch !== null, catchBody: catchMatch?.[1] ?? '' };
  });
}

function capturingLogger() {
  const lines: { level: string; msg: string; detail: unknown }[] = [];
  const log = (level: string) => (detail: unknown, msg?: string) => lines.push({ level, msg: msg ?? String(detail), detail });
  const logger = { warn: log('warn'), error: log('error'), info: log('info'), debug: log('debug') } as unknown as Logger;
  return { logger, lines };
}

describe('mssql listener: the receive batch', () => {
  const text = code(receiveBatch(1000, 500));

  it('commits the RECEIVE before it ends any dialog, so a failed end can never return the messages', () => {
    const commit = text.indexOf('COMMIT TRANSACTION;');
    const firstEnd = text.indexOf('END CONVERSATION');
    const lastReceive = text.lastIndexOf('FROM asyncexec.AsyncExecNotifyQueue');
    assert.ok(commit > lastReceive, 'the commit follows every RECEIVE');
    assert.ok(firstEnd > commit, 'no END CONVERSATION inside the receive transaction');
    assert.match(text, /SET NOCOUNT ON; SET XACT_ABORT ON;[\s\S]*BEGIN TRANSACTION;/, 'the RECEIVEs still roll back if the batch is cancelled');
    assert.match(text, /^SET NOCOUNT ON; SET XACT_ABORT ON; SET LOCK_TIMEOUT -1;/, "no sweep's lock timeout outlives it on this connection");
  });

  it("ends the batch's dialogs first in one transaction of their own (one log flush), rolled back whole if any end fails", () => {
    const afterReceive = text.slice(text.indexOf('COMMIT TRANSACTION;') + 'COMMIT TRANSACTION;'.length);
    const together = /^\s*IF EXISTS \((SELECT DISTINCT conversation_handle FROM @m [^)]*\))\)\s*BEGIN\s*BEGIN TRY\s*BEGIN TRANSACTION;([\s\S]*?)COMMIT TRANSACTION;\s*END TRY\s*BEGIN CATCH([\s\S]*?)END CATCH;\s*END;/.exec(afterReceive);
    assert.ok(together, 'right after the receive commits: a transaction over all the ends, inside TRY, when there is one to end');
    const [, , body, catchBody] = together;
    assert.match(body, /WHILE @@FETCH_STATUS = 0\s*BEGIN\s*END CONVERSATION @h;/, 'every end of the batch inside that one transaction');
    assert.doesNotMatch(body, /BEGIN TRY|XACT_ABORT/, 'no end of it is caught alone, and XACT_ABORT stays ON through it (a timeout rolls it back)');
    assert.match(catchBody, /IF XACT_STATE\(\) <> 0 ROLLBACK TRANSACTION;\s*SET @endedTogether = 0;/, 'a failure rolls every end back and asks for the ends one by one');
    assert.doesNotMatch(afterReceive.slice(0, together.index), /XACT_ABORT OFF/);
    assert.match(text, /@endedTogether bit = 1;/, 'nothing to end counts as ended');
  });

  it('after a failed transaction, ends each dialog in its own TRY…CATCH with XACT_ABORT off, and reports the failures', () => {
    const ends = endsAndTheirCatch(text);
    assert.equal(ends.length, 2, 'the ends together, then one by one');
    assert.ok(!ends[0].tried && ends[1].tried, 'the second END CONVERSATION is alone in a TRY block followed by its CATCH');
    assert.match(ends[1].catchBody, /INSERT @failed VALUES \(@h, ERROR_NUMBER\(\), ERROR_MESSAGE\(\)\)/);
    const oneByOne = /SET XACT_ABORT OFF;\s*IF @endedTogether = 0\s*BEGIN([\s\S]*?)DEALLOCATE ends;\s*END;/.exec(text);
    assert.ok(oneByOne, 'XACT_ABORT goes off after the transaction whatever it did; the one-by-one ends run only when it failed');
    assert.ok(oneByOne.index > text.lastIndexOf('END CATCH;\nEND;'), 'after the transaction of the ends');
    assert.doesNotMatch(oneByOne[1], /BEGIN TRANSACTION/, 'each end its own autocommit transaction: a failed one rolls back alone');
    assert.equal(text.match(/BEGIN TRANSACTION/g)?.length, 2, "the receive's transaction and the ends' one, no other");
    // result sets: the Status rows, the failed ends, the count of messages taken
    assert.match(text, /FROM @m\s+WHERE message_type_name = N'asyncexec\/Status'/);
    assert.match(text, /SELECT LOWER\(CONVERT\(nvarchar\(36\), conversation_handle\)\) AS handle, error_number, error_message FROM @failed;/);
    assert.match(text, /SELECT @total AS received;\s*$/);
  });

  it('ends the dialogs of EndDialog and Error messages only', () => {
    assert.match(text, /message_type_name IN \(N'http:\/\/schemas\.microsoft\.com\/SQL\/ServiceBroker\/EndDialog', N'http:\/\/schemas\.microsoft\.com\/SQL\/ServiceBroker\/Error'\)/);
  });

  it('retries failed ends one by one, passing the handles as a parameter, skipping dialogs already gone', () => {
    const retry = code(retryEndsBatch());
    // an END waiting on its conversation group's lock fails after 2 s (1222, caught, counted), and the batch ends waiting as long as it takes again
    assert.match(retry, /^SET NOCOUNT ON; SET XACT_ABORT OFF; SET LOCK_TIMEOUT 2000;/);
    assert.match(retry, /SET LOCK_TIMEOUT -1;$/);
    assert.ok(RETRY_ENDS_LIMIT * 2000 < REQUEST_MARGIN_MS, 'a retry batch whose ENDs all time out ends inside the request timeout');
    assert.doesNotMatch(retry, /BEGIN TRANSACTION/);
    assert.match(retry, /OPENJSON\(@handles\)/);
    assert.match(retry, /sys\.conversation_endpoints[\s\S]*ce\.state <> 'CD'/);
    const ends = endsAndTheirCatch(retry);
    assert.equal(ends.length, 1);
    assert.ok(ends[0].tried);
    assert.match(ends[0].catchBody, /INSERT @failed/);
  });
});

describe('mssql listener: one notification cycle', () => {
  const steps = (over: Partial<NotifyCycleSteps> & { logger: Logger }) => {
    const calls = { catchUp: 0, wake: 0, retried: [] as string[][] };
    const s: NotifyCycleSteps = {
      receive: async () => ({ received: 0, failures: [] }),
      retryEnds: async (handles) => {
        calls.retried.push([...handles]);
        return [];
      },
      wake: async () => void calls.wake++,
      catchUp: () => void calls.catchUp++,
      ...over,
    };
    return { s, calls };
  };

  it('runs the catch-up when the receive fails, then fails the cycle (the loop reconnects)', async () => {
    const { logger } = capturingLogger();
    const { s, calls } = steps({ logger, receive: async () => Promise.reject(new Error('RECEIVE permission denied')) });
    await assert.rejects(notifyCycle(s, new EndRetries()), /RECEIVE permission denied/);
    assert.equal(calls.catchUp, 1, 'the table is read although nothing was received');
    assert.equal(calls.wake, 0);
  });

  it('catches up and wakes the others once per batch that took messages, and neither for an empty one', async () => {
    const { logger } = capturingLogger();
    const { s, calls } = steps({ logger, receive: async () => ({ received: 37, failures: [] }) });
    await notifyCycle(s, new EndRetries());
    assert.deepEqual([calls.catchUp, calls.wake], [1, 1], 'one wake-up per batch, whatever its size');
    const empty = steps({ logger });
    await notifyCycle(empty.s, new EndRetries());
    assert.deepEqual([empty.calls.catchUp, empty.calls.wake], [0, 0]);
  });

  it('a wake-up that fails is logged, not thrown', async () => {
    const { logger, lines } = capturingLogger();
    const { s, calls } = steps({ logger, receive: async () => ({ received: 1, failures: [] }), wake: async () => Promise.reject(new Error('229')) });
    await notifyCycle(s, new EndRetries());
    assert.equal(calls.catchUp, 1);
    assert.ok(lines.some((l) => l.level === 'warn' && /could not wake/.test(l.msg)));
  });

  it('retries a failed end on the next cycles and gives it up after the poison count, once, loudly', async () => {
    const { logger, lines } = capturingLogger();
    const retries = new EndRetries();
    const handle = '6f9619ff-8b86-d011-b42d-00c04fc964ff';
    const failure: EndFailure = { handle, error_number: 15151, error_message: 'Cannot find the conversation, or you do not have permission' };
    let first = true;
    const receive = async (): Promise<ReceiveResult> => {
      const r = { received: first ? 2 : 0, failures: first ? [failure] : [] };
      first = false;
      return r;
    };
    const { s, calls } = steps({ logger, receive, retryEnds: async (handles) => (calls.retried.push([...handles]), handles.map((h) => ({ ...failure, handle: h }))) });
    for (let i = 0; i < MAX_END_ATTEMPTS + 3; i++) await notifyCycle(s, retries);
    assert.equal(calls.retried.length, MAX_END_ATTEMPTS - 1, 'the first failure came from the receive; then one retry a cycle until the limit');
    assert.ok(calls.retried.every((h) => h.length === 1 && h[0] === handle));
    assert.equal(retries.size, 0, 'given up: never tried again');
    assert.equal(lines.filter((l) => l.level === 'error').length, 1, 'given up once, as an error');
    assert.equal(lines.filter((l) => l.level === 'warn').length, MAX_END_ATTEMPTS - 1);
  });

  it(`retries at most ${RETRY_ENDS_LIMIT} failed ends a cycle, the rest on the next ones`, async () => {
    const { logger } = capturingLogger();
    const retries = new EndRetries();
    const failures = Array.from({ length: 25 }, (_, i) => ({ handle: `h${i}`, error_number: 1222, error_message: 'Lock request time out period exceeded.' }));
    let first = true;
    const receive = async (): Promise<ReceiveResult> => {
      const r = { received: first ? 25 : 0, failures: first ? failures : [] };
      first = false;
      return r;
    };
    const { s, calls } = steps({ logger, receive });
    for (let i = 0; i < 3; i++) await notifyCycle(s, retries);
    assert.deepEqual(calls.retried.map((h) => h.length), [10, 10, 5]);
    assert.equal(new Set(calls.retried.flat()).size, 25, 'each once');
    assert.equal(retries.size, 0);
  });

  it('forgets an end that succeeds on retry', async () => {
    const { logger } = capturingLogger();
    const retries = new EndRetries();
    const { s, calls } = steps({ logger, receive: async () => ({ received: 1, failures: [{ handle: 'a', error_number: 1205, error_message: 'deadlock' }] }) });
    await notifyCycle(s, retries);
    assert.deepEqual(calls.retried, [['a']], 'retried in the same cycle');
    assert.equal(retries.size, 0);
  });
});

describe('mssql listener: dialogs whose end was lost', () => {
  const text = code(leftOpenBatch(1000));
  const leftOpen = /SELECT ce\.conversation_handle\s+FROM sys\.conversation_endpoints AS ce\s+WHERE ce\.is_initiator = 1 AND ce\.state IN \('DI', 'ER'\)\s+AND ce\.service_id = \(SELECT s\.service_id FROM sys\.services AS s WHERE s\.name = N'asyncexec\/NotifyService'\)\s+AND NOT EXISTS \(SELECT 1 FROM asyncexec\.AsyncExecNotifyQueue AS q WITH \(NOLOCK\)\s+WHERE q\.conversation_handle = ce\.conversation_handle\)/g;

  it('ends only what the last sweep found, that is still the notification side of a dialog its other side ended, with nothing of it queued', () => {
    assert.match(text, /^SET NOCOUNT ON; SET XACT_ABORT OFF;/);
    assert.doesNotMatch(text, /BEGIN TRANSACTION/, 'each END its own autocommit transaction');
    assert.equal(text.match(leftOpen)?.length, 2, 'the same test for what is ended and for what is found');
    const ending = /INSERT @ending \(conversation_handle\)\s+SELECT o\.conversation_handle\s+FROM \(([\s\S]*?)\) AS o\s+WHERE o\.conversation_handle IN \(SELECT CONVERT\(uniqueidentifier, j\.\[value\]\) FROM OPENJSON\(@handles\) AS j\);/.exec(text);
    assert.ok(ending, 'the ends are the earlier findings that are still left open now');
    const ends = endsAndTheirCatch(text);
    assert.equal(ends.length, 1);
    assert.ok(ends[0].tried, 'in its own TRY');
    assert.match(ends[0].catchBody, /INSERT @failed VALUES \(@h, ERROR_NUMBER\(\), ERROR_MESSAGE\(\)\)/);
    assert.match(text, /CURSOR LOCAL STATIC FOR\s+SELECT conversation_handle FROM @ending;/);
    // result sets, in order: failures, ends tried, what is left open now (after the ends)
    const failures = text.indexOf('FROM @failed;');
    const tried = text.search(/SELECT @tried AS tried,\s+CAST\(CASE WHEN EXISTS \(SELECT 1 FROM sys\.services WHERE name = N'asyncexec\/NotifyService'\) THEN 1 ELSE 0 END AS bit\) AS visible;/);
    const found = text.search(/SELECT TOP \(1000\) LOWER\(CONVERT\(nvarchar\(36\), o\.conversation_handle\)\) AS handle FROM \(/);
    assert.ok(text.lastIndexOf('END CONVERSATION') < failures && failures < tried && tried < found, 'failures, count, then the findings');
    // an END waiting on a conversation group's lock fails after 2 s (1222, caught) rather than hold the loop
    assert.match(text, /^SET NOCOUNT ON; SET XACT_ABORT OFF; SET LOCK_TIMEOUT 2000;/);
    assert.ok(text.indexOf('SET LOCK_TIMEOUT -1;') > text.lastIndexOf('END CONVERSATION'), 'and back to waiting as long as it takes after the ends');
  });

  it('begins no END past its time budget, and counts the ENDs it began, so that ENDs that all wait out their lock timeout end it well inside the request timeout', () => {
    assert.match(text, /DECLARE @tried int = 0;\s+DECLARE @deadline datetime2 = DATEADD\(millisecond, 10000, SYSUTCDATETIME\(\)\);/);
    assert.equal(LEFT_OPEN_BUDGET_MS, 10_000);
    assert.match(code(leftOpenBatch(1000, 2500)), /DATEADD\(millisecond, 2500, SYSUTCDATETIME\(\)\)/);
    // DATEADD takes an int
    assert.match(code(leftOpenBatch(1000, Number.NaN)), /DATEADD\(millisecond, 0, /);
    assert.match(code(leftOpenBatch(1000, 1e12)), /DATEADD\(millisecond, 2147483647, /);
    // the deadline is tested before each END (the loop's condition), and each END begun is counted before its TRY
    assert.match(text, /WHILE @@FETCH_STATUS = 0 AND SYSUTCDATETIME\(\) < @deadline\s+BEGIN\s+SET @tried \+= 1;\s+BEGIN TRY\s+END CONVERSATION @h;/);
    // the worst sweep: the budget, the END then under way and the two reads after the ENDs each waiting out
    // the LOCK_TIMEOUT (which stays set to the batch's end), against the notification loop's request
    // timeout (its WAITFOR + REQUEST_MARGIN_MS)
    const lockTimeoutMs = Number(/SET LOCK_TIMEOUT (\d+);/.exec(text)![1]);
    assert.ok(LEFT_OPEN_BUDGET_MS + 3 * lockTimeoutMs < REQUEST_MARGIN_MS, `${LEFT_OPEN_BUDGET_MS} + 3 × ${lockTimeoutMs} ms`);
    assert.match(text, /SET LOCK_TIMEOUT -1;$/, 'back to waiting as long as it takes, at the very end');
    // the receive batch's own ends have no budget: every dialog it took the end of is ended or reported
    assert.doesNotMatch(code(receiveBatch(1000, 100)), /@deadline|@tried/);
  });

  const handle = (n: number) => `00000000-0000-0000-0000-${String(n).padStart(12, '0')}`;
  const sweeping = () => {
    let now = 0;
    const sweep = new LeftOpenSweep(300_000, () => now);
    const calls: string[][] = [];
    let answer: (handles: readonly string[]) => LeftOpenResult = () => ({ tried: 0, failures: [], found: [] });
    const { logger, lines } = capturingLogger();
    const steps: NotifyCycleSteps = {
      receive: async () => ({ received: 0, failures: [] }),
      retryEnds: async () => [],
      wake: async () => undefined,
      catchUp: () => undefined,
      sweepLeftOpen: async (handles) => (calls.push([...handles]), answer(handles)),
      logger,
    };
    return {
      sweep, calls, lines, steps,
      at: (ms: number) => void (now = ms),
      answer: (fn: typeof answer) => void (answer = fn),
    };
  };

  it('sweeps once a period; the first only looks, the next ends what the one before found', async () => {
    const s = sweeping();
    const retries = new EndRetries();
    await notifyCycle(s.steps, retries, s.sweep);
    s.at(299_999);
    await notifyCycle(s.steps, retries, s.sweep);
    assert.deepEqual(s.calls, [], 'not before a period');
    s.answer(() => ({ tried: 0, failures: [], found: [handle(1), handle(2)] }));
    s.at(300_000);
    await notifyCycle(s.steps, retries, s.sweep);
    await notifyCycle(s.steps, retries, s.sweep);
    assert.deepEqual(s.calls, [[]], 'the first sweep ends nothing, and comes once');
    s.answer((handles) => ({ tried: handles.length, failures: [], found: [] }));
    s.at(600_000);
    await notifyCycle(s.steps, retries, s.sweep);
    assert.deepEqual(s.calls[1], [handle(1), handle(2)], 'a period later: what the first found');
    assert.ok(s.lines.some((l) => l.level === 'info' && (l.detail as { ended?: number }).ended === 2), 'says how many it ended');
  });

  it("leaves to the receive's retries what they handle; counts its own failed ends as theirs; a failed sweep only looks next time", async () => {
    const s = sweeping();
    const retries = new EndRetries(2);
    // one end given up, one being retried
    retries.failed(handle(1));
    retries.failed(handle(1));
    retries.failed(handle(2));
    s.answer(() => ({ tried: 0, failures: [], found: [handle(1), handle(2), handle(3), handle(4)] }));
    s.at(300_000);
    await notifyCycle({ ...s.steps, retryEnds: async (handles) => handles.map((h) => ({ handle: h, error_number: 15151, error_message: 'no' })) }, retries, s.sweep);
    assert.ok(retries.handles(handle(1)) && retries.handles(handle(2)));
    // between the sweeps, a receive's end of the fourth fails: its retries take it over
    retries.failed(handle(4));
    const failure = { handle: handle(3), error_number: 15151, error_message: 'Cannot find the conversation' };
    s.answer((handles) => ({ tried: handles.length, failures: [failure], found: [] }));
    s.at(600_000);
    await notifyCycle({ ...s.steps, retryEnds: async (handles) => handles.map((h) => ({ handle: h, error_number: 15151, error_message: 'no' })) }, retries, s.sweep);
    assert.deepEqual(s.calls[1], [handle(3)], 'neither the given-up end nor those being retried');
    assert.ok(retries.handles(handle(3)), 'its failed end is retried as a failed end of a receive is');
    assert.ok(s.lines.some((l) => l.level === 'warn' && /END CONVERSATION failed/.test(l.msg)));

    s.answer(() => {
      throw new Error('VIEW DEFINITION permission denied');
    });
    s.at(900_000);
    await notifyCycle(s.steps, retries, s.sweep);
    assert.ok(s.lines.some((l) => l.level === 'warn' && /could not look for dialogs left open/.test(l.msg)));
    s.answer((handles) => ({ tried: handles.length, failures: [], found: [] }));
    s.at(1_200_000);
    await notifyCycle(s.steps, retries, s.sweep);
    assert.deepEqual(s.calls.at(-1), [], 'after a failed sweep the next one ends nothing');
  });

  it('says once that the login cannot see the notification service', async () => {
    const s = sweeping();
    s.answer(() => ({ tried: 0, visible: false, failures: [], found: [] }));
    for (const at of [300_000, 600_000, 900_000]) {
      s.at(at);
      await notifyCycle(s.steps, new EndRetries(), s.sweep);
    }
    assert.equal(s.calls.length, 3);
    assert.equal(s.lines.filter((l) => l.level === 'warn' && /does not see \[asyncexec\/NotifyService\]/.test(l.msg)).length, 1);
  });

  it('a listener made with a period of 0 never sweeps', () => {
    const never = new LeftOpenSweep(0, () => 1e12);
    assert.equal(never.due(), false);
  });
});

describe('mssql listener: every instance hears every completion (0012, usp_AsyncExecListener*)', () => {
  it('0012 registers listeners in a table without a rowversion (a heartbeat must not hold the change feed back)', async () => {
    const text = code(await readFile(path.join(MSSQL_SQL_DIR, '0012_listeners.sql'), 'utf8'));
    assert.match(text, /CREATE TABLE asyncexec\.AsyncExecListeners \(/);
    assert.doesNotMatch(text, /rowversion|timestamp/i);
    assert.match(text, /CREATE MESSAGE TYPE \[asyncexec\/Wake\] VALIDATION = EMPTY;/);
    assert.match(text, /CREATE CONTRACT \[asyncexec\/WakeContract\] \(\[asyncexec\/Wake\] SENT BY INITIATOR\);/);
  });

  it('start creates the instance queue and service as owner, and sweeps the stale first', async () => {
    const text = await procedure('usp_AsyncExecListenerStart');
    assert.match(text, /WITH EXECUTE AS OWNER/);
    assert.match(text, /EXEC asyncexec\.usp_AsyncExecListenerSweep @staleSeconds = @staleSeconds;/);
    assert.match(text, /N'CREATE QUEUE asyncexec\.' \+ QUOTENAME\(@queue\)/);
    assert.match(text, /N'CREATE SERVICE ' \+ QUOTENAME\(@service\) \+ N' ON QUEUE asyncexec\.' \+ QUOTENAME\(@queue\)\s*\+ N' \(\[asyncexec\/WakeContract\]\);'/);
    assert.match(text, /@queue sysname = N'AsyncExecWake_' \+ @name/);
    assert.match(text, /REPLACE\(LOWER\(CONVERT\(nvarchar\(36\), @instance\)\), N'-', N''\)/, 'names made of hex digits only');
  });

  it('wake sends one message to each other live listener, each in its own TRY…CATCH, on a reused dialog', async () => {
    const text = await procedure('usp_AsyncExecListenerWake');
    assert.match(text, /WITH EXECUTE AS OWNER/);
    assert.match(text, /SET XACT_ABORT OFF;/);
    assert.doesNotMatch(text, /BEGIN TRANSACTION/);
    // a failed send is rolled back whole: never inside a caller's transaction
    const refuse = text.indexOf('IF @@TRANCOUNT > 0\n    BEGIN\n        THROW 50044,');
    assert.ok(refuse > 0 && refuse < text.indexOf('WHILE 1 = 1'), 'refuses to run inside a transaction, before any send');
    assert.match(text, /WHERE l\.instance_id <> @instance\s+AND l\.heartbeat_at >= DATEADD\(second, -@staleSeconds, SYSUTCDATETIME\(\)\)/, 'not itself, not the stale');
    assert.match(text, /JOIN sys\.services AS s ON s\.name = l\.service_name/, 'only services that exist (else the message waits in sys.transmission_queue)');
    assert.match(text, /CASE WHEN ce\.state IN \('SO', 'CO'\) THEN 1 ELSE 0 END/, 'reuses a dialog that is still open');
    const loop = text.slice(text.indexOf('WHILE 1 = 1'));
    const send = loop.indexOf('SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Wake];');
    assert.ok(send > 0 && loop.match(/SEND ON CONVERSATION/g)?.length === 1, 'one SEND a receiver');
    assert.ok(loop.lastIndexOf('BEGIN TRY', send) > 0 && loop.indexOf('BEGIN CATCH', send) > send, 'the send is inside a TRY…CATCH');
    assert.match(loop.slice(loop.indexOf('BEGIN CATCH', send)), /^BEGIN CATCH\s+IF XACT_STATE\(\) <> 0 ROLLBACK TRANSACTION;\s+SET @failed \+= 1;/);
    assert.match(text, /FROM SERVICE ' \+ QUOTENAME\(N'asyncexec\/Wake\/' \+ @name\)/);
    assert.match(text, /ON CONTRACT \[asyncexec\/WakeContract\] WITH ENCRYPTION = OFF;/);
  });

  it('a call costs no wake-up: only the listener wakes, after a batch', async () => {
    for (const name of ['usp_AsyncExecInvoke', 'usp_AsyncExecRun', 'usp_AsyncExecActivated']) {
      assert.doesNotMatch(await procedure(name), /asyncexec\/Wake|usp_AsyncExecListenerWake/, name);
    }
  });

  it('wait records the heartbeat, waits on its own queue and ends the dialogs others ended, each in a TRY…CATCH', async () => {
    const text = await procedure('usp_AsyncExecListenerWait');
    assert.match(text, /UPDATE asyncexec\.AsyncExecListeners SET heartbeat_at = SYSUTCDATETIME\(\), @queue = queue_object\s+WHERE instance_id = @instance;/);
    assert.match(text, /WAITFOR \(RECEIVE conversation_handle, message_type_name FROM asyncexec\.' \+ QUOTENAME\(@queue\) \+ N' INTO @m\), TIMEOUT '\s*\+ CAST\(@waitMs AS nvarchar\(10\)\)/);
    const ends = endsAndTheirCatch(text);
    assert.equal(ends.length, 1);
    assert.ok(ends[0].tried);
    assert.match(text, /CAST\(0 AS bit\) AS registered/, 'says when it was swept');
  });

  it('stop leaves the registry first, ends its dialogs under a savepoint each, then drops service and queue', async () => {
    const text = await procedure('usp_AsyncExecListenerStop');
    const at = (s: string) => text.indexOf(s);
    assert.ok(at('DELETE asyncexec.AsyncExecListeners') < at('END CONVERSATION @h;'));
    assert.ok(at('END CONVERSATION @h;') < at("N'DROP SERVICE '") && at("N'DROP SERVICE '") < at("N'DROP QUEUE asyncexec.'"));
    assert.match(text, /SAVE TRANSACTION listener_end;\s+BEGIN TRY\s+END CONVERSATION @h;\s+END TRY/);
    assert.match(text, /ROLLBACK TRANSACTION listener_end;/);
    assert.match(text, /SET XACT_ABORT OFF;/, 'a caught error must not doom the whole transaction');
  });
});

describe('mssql checks: READ_COMMITTED_SNAPSHOT', () => {
  it('is required, with the statement that turns it on', () => {
    assert.equal(readCommittedSnapshotProblem({ name: 'asyncproc', is_read_committed_snapshot_on: true }), null);
    const problem = readCommittedSnapshotProblem({ name: 'odd]name', is_read_committed_snapshot_on: false });
    assert.match(problem!, /READ_COMMITTED_SNAPSHOT is off in database \[odd\]name\]/);
    assert.match(problem!, /ALTER DATABASE \[odd\]\]name\] SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE;/);
  });
});

describe('mssql checks: the database itself (compatibility level, collation, owner)', () => {
  const fine: DatabaseProbe = { name: 'asyncproc', compatibility_level: 150, collation_name: 'SQL_Latin1_General_CP1_CI_AS', ranges_ok: true, impersonation_error: null, dbo_login: 'sa' };

  it('accepts a database at level 130 or higher whose collation keeps [A-Za-z] and whose owner is a login', () => {
    assert.deepEqual(databaseProblems(fine), []);
    assert.deepEqual(databaseProblems({ ...fine, compatibility_level: 130 }), []);
    assert.deepEqual(databaseProblems(undefined), []);
  });

  it('refuses a level below 130 (OPENJSON), naming the statement that raises it', () => {
    const [problem, ...rest] = databaseProblems({ ...fine, name: 'odd]name', compatibility_level: 120 });
    assert.equal(rest.length, 0);
    assert.match(problem, /compatibility level 120; the service needs 130 or higher \(OPENJSON\)/);
    assert.match(problem, /ALTER DATABASE \[odd\]\]name\] SET COMPATIBILITY_LEVEL = 150;/);
  });

  it("refuses a collation whose letter ranges skip letters (Estonian: [a-z] stops at z, before t), naming the collation", () => {
    const [problem] = databaseProblems({ ...fine, collation_name: 'Estonian_CI_AS', ranges_ok: false });
    assert.match(problem, /collation of database \[asyncproc\] \(Estonian_CI_AS\) does not keep the ASCII letters within \[A-Za-z\]/);
  });

  it('refuses an orphaned owner only when impersonating dbo failed with 15517 and its SID names no login', () => {
    const [problem] = databaseProblems({ ...fine, impersonation_error: 15517, dbo_login: null });
    assert.match(problem, /EXECUTE AS OWNER fails \(15517\)/);
    assert.match(problem, /ALTER AUTHORIZATION ON DATABASE::\[asyncproc\] TO \[a_valid_login\];/);
    // either sign alone is not enough: a permission error, or a SID this server cannot name for a moment
    assert.deepEqual(databaseProblems({ ...fine, impersonation_error: 15517, dbo_login: 'sa' }), []);
    assert.deepEqual(databaseProblems({ ...fine, impersonation_error: null, dbo_login: null }), []);
    assert.deepEqual(databaseProblems({ ...fine, impersonation_error: 15406, dbo_login: null }), []);
    // a Windows owner the server cannot resolve fails with 15404 instead
    assert.match(databaseProblems({ ...fine, impersonation_error: 15404, dbo_login: null })[0], /EXECUTE AS OWNER fails \(15404\)/);
  });

  it('reads it all in one batch; the LIKE is the name rules\' own pattern over every letter and digit they accept; impersonation only when asked', () => {
    const text = code(databaseProbe(true));
    assert.match(text, /^SET NOCOUNT ON;/);
    assert.match(text, /BEGIN TRY\s+EXECUTE AS USER = N'dbo';\s+REVERT;\s+END TRY\s+BEGIN CATCH\s+SET @impersonation = ERROR_NUMBER\(\);\s+END CATCH;/);
    assert.ok(text.includes(`N'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-' NOT LIKE N'%[^A-Za-z0-9_.:-]%'`));
    assert.match(text, /SUSER_SNAME\(\(SELECT p\.sid FROM sys\.database_principals AS p WHERE p\.name = N'dbo'\)\) AS dbo_login/);
    assert.match(text, /FROM sys\.databases AS d WHERE d\.database_id = DB_ID\(\);$/);
    assert.doesNotMatch(code(databaseProbe(false)), /EXECUTE AS/);
    // the pattern is the one the queue name rules use (0001's CHECK, usp_AsyncExecCreateQueue)
    assert.ok(text.includes(`N'%[^A-Za-z0-9_.:-]%'`));
  });
});
