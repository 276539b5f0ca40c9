import { randomUUID } from 'node:crypto';
import { hostname } from 'node:os';
import sql from 'mssql';
import { toError, type Closeable, type ListenerSink } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { ConnectionPool } from './pool.js';

export interface MssqlListenerOptions {
  config: sql.config;
  sink: ListenerSink;
  logger: Logger;
  /** WAITFOR … TIMEOUT of one RECEIVE from the notification queue. @default 1000 */
  waitMs?: number;
  /** Most messages taken per round trip. @default 500 */
  batchSize?: number;
  /** Longest pause between reconnect attempts. @default 30000 */
  maxBackoffMs?: number;
  /**
   * Wake the other instances after each batch received, and be woken by them (a wake-up
   * queue of this instance's own, see docs/mssql.md "Every instance hears every completion").
   * Off: the others hear of this instance's batches from their poll only. @default true
   */
  fanOut?: boolean;
  /** WAITFOR timeout on the wake-up queue, and so the heartbeat period. @default 5000 */
  wakeWaitMs?: number;
  /** A listener without a heartbeat this long is no longer woken, and is swept. @default 60 */
  staleSeconds?: number;
  /** How often the dialogs whose end was lost are looked for (see leftOpenBatch); 0: never. @default 300000 */
  leftOpenSweepMs?: number;
}

const END_DIALOG = 'http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog';
const ERROR = 'http://schemas.microsoft.com/SQL/ServiceBroker/Error';

/** Ends of one dialog tried and failed this many times are given up (logged, never retried). */
export const MAX_END_ATTEMPTS = 5;
/**
 * What the notification loop's requests may take beyond their WAITFOR before the driver cancels
 * them (its request timeout: the WAITFOR's + this).
 */
export const REQUEST_MARGIN_MS = 30_000;
/** Failed ends one cycle retries at most (retryEndsBatch): each may wait out a 2 s lock timeout. */
export const RETRY_ENDS_LIMIT = 10;
/** Given-up handles remembered (a process restart forgets them: its sweeps try them once more, MAX_END_ATTEMPTS times at most). */
const GIVEN_UP_KEPT = 10_000;

/**
 * END CONVERSATION for each handle `handles` selects, each in its own TRY…CATCH, with no
 * transaction open (so a failure rolls back that END alone and XACT_STATE() is 0 in the
 * CATCH); each failure goes to @failed (handle, error number, message), declared by the caller
 * with @h.
 */
function endEach(handles: string, budget?: { deadline: string; tried: string }): string {
  // with a budget: no END begins past the deadline (a datetime2 variable), and each END begun is counted
  return `DECLARE ends CURSOR LOCAL STATIC FOR
    ${handles};
OPEN ends;
FETCH NEXT FROM ends INTO @h;
WHILE @@FETCH_STATUS = 0${budget ? ` AND SYSUTCDATETIME() < ${budget.deadline}` : ''}
BEGIN${budget ? `\n    SET ${budget.tried} += 1;` : ''}
    BEGIN TRY
        END CONVERSATION @h;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
        INSERT @failed VALUES (@h, ERROR_NUMBER(), ERROR_MESSAGE());
    END CATCH;
    FETCH NEXT FROM ends INTO @h;
END;
CLOSE ends;
DEALLOCATE ends;`;
}

/** The dialogs a receive batch ends: those whose EndDialog or Error message it took. */
const ENDED_DIALOGS = `SELECT DISTINCT conversation_handle FROM @m WHERE message_type_name IN (N'${END_DIALOG}', N'${ERROR}')`;

/**
 * END CONVERSATION for every handle `handles` selects, in ONE transaction (one log flush for
 * all of them), with XACT_ABORT ON. If any of them fails, the CATCH rolls the transaction
 * back (under XACT_ABORT ON an error in a TRY block leaves it uncommittable, XACT_STATE() = -1:
 * only a full rollback is allowed), so none of them is ended, and @endedTogether (declared by
 * the caller, 1 beforehand) is 0: the caller then ends them one by one (endEach). Service
 * Broker statements are transactional: a rolled-back END CONVERSATION leaves the dialog as it
 * was, and its EndDialog message to the other side is sent only at the commit. No transaction
 * is opened when there is nothing to end.
 */
function endTogether(handles: string): string {
  return `IF EXISTS (${handles})
BEGIN
    BEGIN TRY
        BEGIN TRANSACTION;
        DECLARE together CURSOR LOCAL STATIC FOR
            ${handles};
        OPEN together;
        FETCH NEXT FROM together INTO @h;
        WHILE @@FETCH_STATUS = 0
        BEGIN
            END CONVERSATION @h;
            FETCH NEXT FROM together INTO @h;
        END;
        CLOSE together;
        DEALLOCATE together;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
        SET @endedTogether = 0;
    END CATCH;
END;`;
}

/**
 * One round trip on the notification queue. Wait for the first messages, take whatever
 * else is queued (each RECEIVE returns the messages of one conversation group, i.e. of one
 * call), and COMMIT: the messages are consumed whatever happens next. Only then end the
 * dialogs whose EndDialog or Error arrived. An END CONVERSATION that fails (a login that is
 * neither the dialog's owner nor db_owner nor sysadmin may not end it: END CONVERSATION,
 * Permissions) used to roll the RECEIVE back under XACT_ABORT, so the same messages came back
 * every cycle and nothing was delivered again. Now it is reported in the second result set
 * (handle, error) and retried a few times by retryEndsBatch.
 *
 * The ends go first all together, in ONE transaction of their own (endTogether): one log
 * flush for the batch's dialogs instead of one each. Ended one at a time, each END is its own
 * autocommit transaction waiting for its own flush, so under load (166 calls a batch at most:
 * three messages a call) the listener spent a flush per call, one after the other, and could
 * not end dialogs faster than the log's flush rate. If any END of that transaction fails, the
 * whole transaction is rolled back (none of them ended) and they are ended one by one instead,
 * each in its own TRY…CATCH (endEach), so that only the failing one is reported and the others
 * are ended.
 *
 * XACT_ABORT stays ON for the receive transaction and for the ends' transaction: a run-time
 * error in either ends and rolls back the transaction it is in (SET XACT_ABORT); inside the
 * ends' TRY it makes that transaction uncommittable (XACT_STATE() = -1) and the CATCH rolls it
 * back, which is all it has to do. A batch cut by a timeout or a cancel (an attention, which no
 * TRY…CATCH catches and which by itself neither commits nor rolls back an open transaction)
 * never leaves a transaction open for later: the listener drops its connection after any
 * batch that failed or was cancelled (ConnectionLoop.run and close), and a disconnect rolls
 * the session's open transaction back. Cut in the receive, the messages stay queued for the
 * next batch; cut in the ends, that batch's dialogs stay open (their messages were delivered),
 * as when a batch was cut among its one-by-one ends.
 * XACT_ABORT is turned OFF after the ends' transaction, whatever it did: for the one-by-one
 * ends, where with no transaction open each END is its own autocommit transaction, so a
 * failed one rolls back alone and the CATCH finds XACT_STATE() = 0 (XACT_STATE: a -1 state
 * allows only a full rollback, which ON would force on any error inside a TRY…CATCH around an
 * open transaction); and for the result sets, so that a run-time error in one of them does
 * not end the batch before the others. The @m table variable keeps its rows through
 * any rollback, so the Status rows are returned whatever the ends did.
 */
export function receiveBatch(waitMs: number, batchSize: number): string {
  const wait = Math.max(0, Math.trunc(waitMs));
  const size = Math.max(1, Math.trunc(batchSize));
  // LOCK_TIMEOUT: the default (wait as long as it takes) again, whatever a sweep of dialogs left
  // open (leftOpenBatch, 2 s) that failed before its own reset left on this connection
  return `SET NOCOUNT ON; SET XACT_ABORT ON; SET LOCK_TIMEOUT -1;
DECLARE @m TABLE (conversation_handle uniqueidentifier, message_type_name sysname, message_body varbinary(max), queuing_order bigint);
DECLARE @failed TABLE (conversation_handle uniqueidentifier, error_number int, error_message nvarchar(4000));
DECLARE @got int, @total int, @h uniqueidentifier, @endedTogether bit = 1;
BEGIN TRANSACTION;
WAITFOR (RECEIVE conversation_handle, message_type_name, message_body, queuing_order
           FROM asyncexec.AsyncExecNotifyQueue INTO @m), TIMEOUT ${wait};
SELECT @got = @@ROWCOUNT;
SET @total = @got;
WHILE @got > 0 AND @total < ${size}
BEGIN
    SET @got = 0;   -- RECEIVE must follow a statement ended by a semicolon
    RECEIVE TOP (${size}) conversation_handle, message_type_name, message_body, queuing_order
      FROM asyncexec.AsyncExecNotifyQueue INTO @m;
    SELECT @got = @@ROWCOUNT;
    SET @total += @got;
END;
COMMIT TRANSACTION;
${endTogether(ENDED_DIALOGS)}
SET XACT_ABORT OFF;
IF @endedTogether = 0
BEGIN
    ${endEach(ENDED_DIALOGS)}
END;
SELECT CAST(message_body AS xml).value('(/status/@id)[1]', 'bigint') AS id,
       CAST(message_body AS xml).value('(/status/@status)[1]', 'varchar(10)') AS status,
       CAST(message_body AS xml).value('(/status/@cursor)[1]', 'varchar(18)') AS [cursor]
  FROM @m
 WHERE message_type_name = N'asyncexec/Status'
 ORDER BY queuing_order;
SELECT LOWER(CONVERT(nvarchar(36), conversation_handle)) AS handle, error_number, error_message FROM @failed;
SELECT @total AS received;`;
}

/**
 * End again the dialogs whose end failed before (@handles: a JSON array of handles), each
 * in its own TRY…CATCH with no transaction open. A handle no longer in
 * sys.conversation_endpoints was ended meanwhile (by an administrator, or NEW_BROKER):
 * it counts as done. Returns the ones that failed again, with the error.
 */
export function retryEndsBatch(): string {
  // LOCK_TIMEOUT: an END waits at most 2 s for its conversation group's lock (1222, caught,
  // counted as a failure), and a batch tries at most RETRY_ENDS_LIMIT of them, so it ends well
  // inside the request timeout; then back to waiting as long as it takes
  return `SET NOCOUNT ON; SET XACT_ABORT OFF; SET LOCK_TIMEOUT 2000;
DECLARE @failed TABLE (conversation_handle uniqueidentifier, error_number int, error_message nvarchar(4000));
DECLARE @h uniqueidentifier;
${endEach(`SELECT CONVERT(uniqueidentifier, j.[value]) FROM OPENJSON(@handles) AS j
     WHERE EXISTS (SELECT 1 FROM sys.conversation_endpoints AS ce
                    WHERE ce.conversation_handle = CONVERT(uniqueidentifier, j.[value]) AND ce.state <> 'CD')`)}
SELECT LOWER(CONVERT(nvarchar(36), conversation_handle)) AS handle, error_number, error_message FROM @failed;
SET LOCK_TIMEOUT -1;`;
}

/**
 * The notification side of calls' dialogs that a lost end left open: initiator endpoints of
 * [asyncexec/NotifyService] (usp_AsyncExecInvoke begins every call's dialog FROM it) whose other
 * side ended the dialog, with no message of theirs left in the notification queue.
 *  * DI: "the remote side of the conversation has issued an END CONVERSATION. The conversation
 *    remains in this state until the local side of the conversation issues an END
 *    CONVERSATION"; ER: an error ended it and "the Error message has been placed in the
 *    application queue" (sys.conversation_endpoints). Neither gets another message.
 *  * "An application might still receive messages" of a DI conversation, and END CONVERSATION
 *    removes the conversation's messages from the queue: an endpoint with a message still
 *    queued (its Status or its EndDialog, not yet received) is left to the listener, which
 *    ends it when it takes them. The queue is read WITH (NOLOCK), as "Querying Queues"
 *    advises, so that this read never blocks a RECEIVE; a message some RECEIVE is taking may
 *    then be missed, which is why an endpoint is ended only when two sweeps a period apart
 *    both found it left open (see leftOpenBatch).
 * sys.conversation_endpoints shows only the endpoints the login owns or has a permission on:
 * the service's db_owner login sees them all (docs/mssql.md, Permissions).
 */
const LEFT_OPEN = `SELECT ce.conversation_handle
      FROM sys.conversation_endpoints AS ce
     WHERE ce.is_initiator = 1 AND ce.state IN ('DI', 'ER')
       AND ce.service_id = (SELECT s.service_id FROM sys.services AS s WHERE s.name = N'asyncexec/NotifyService')
       AND NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecNotifyQueue AS q WITH (NOLOCK)
                        WHERE q.conversation_handle = ce.conversation_handle)`;

/**
 * End the dialogs a lost end left open (LEFT_OPEN): a receive batch cut between its commit and
 * its ends (a lost connection, a listener killed), or an end given up. Only those the previous
 * sweep, a period ago, found left open too (@handles, a JSON array) are ended: the listener ends
 * a dialog within milliseconds of taking its EndDialog, so one still open a period later is one
 * whose end was lost. Each END runs in its own TRY…CATCH with no transaction open (endEach),
 * failures reported as the receive batch reports them. An END waits for its conversation
 * group's lock (END CONVERSATION, Remarks); LOCK_TIMEOUT bounds that wait, so that a sweep
 * never holds the notification loop long: a timed-out END fails with 1222, is caught and
 * reported, and is retried as any failed end is; and no END begins once the sweep has spent
 * `budgetMs` (LEFT_OPEN_BUDGET_MS), so that it ends well inside the request timeout however many
 * ENDs wait. Result sets: the failures; how many ENDs were tried, and whether the login sees
 * the notification service at all (one that does not sees
 * no endpoint, and the sweep would do nothing without a word); then at most `limit` endpoints
 * left open now, for the next sweep (those just ended are closed, 'CD', or gone, and not among
 * them).
 */
export function leftOpenBatch(limit: number, budgetMs = LEFT_OPEN_BUDGET_MS): string {
  const top = Math.max(1, Math.trunc(limit));
  // DATEADD takes an int
  const budget = Math.min(2_147_483_647, Math.max(0, Math.trunc(budgetMs) || 0));
  return `SET NOCOUNT ON; SET XACT_ABORT OFF; SET LOCK_TIMEOUT 2000;
DECLARE @failed TABLE (conversation_handle uniqueidentifier, error_number int, error_message nvarchar(4000));
DECLARE @ending TABLE (conversation_handle uniqueidentifier PRIMARY KEY);
DECLARE @h uniqueidentifier;
DECLARE @tried int = 0;
DECLARE @deadline datetime2 = DATEADD(millisecond, ${budget}, SYSUTCDATETIME());
INSERT @ending (conversation_handle)
SELECT o.conversation_handle
  FROM (${LEFT_OPEN}) AS o
 WHERE o.conversation_handle IN (SELECT CONVERT(uniqueidentifier, j.[value]) FROM OPENJSON(@handles) AS j);
${endEach('SELECT conversation_handle FROM @ending', { deadline: '@deadline', tried: '@tried' })}
SELECT LOWER(CONVERT(nvarchar(36), conversation_handle)) AS handle, error_number, error_message FROM @failed;
SELECT @tried AS tried,
       CAST(CASE WHEN EXISTS (SELECT 1 FROM sys.services WHERE name = N'asyncexec/NotifyService') THEN 1 ELSE 0 END AS bit) AS visible;
SELECT TOP (${top}) LOWER(CONVERT(nvarchar(36), o.conversation_handle)) AS handle FROM (${LEFT_OPEN}) AS o;
SET LOCK_TIMEOUT -1;`;
}

/** How often the listener looks for dialogs left open (leftOpenBatch). */
export const LEFT_OPEN_SWEEP_MS = 300_000;
/** Endpoints one sweep considers at most, the rest waiting for the next sweeps: each end is a commit of its own (a log flush). */
export const LEFT_OPEN_LIMIT = 200;
/**
 * Time a sweep's ends may take: no END begins after it, so a sweep whose ENDs all wait out their
 * LOCK_TIMEOUT (2 s each) ends after the budget, the END then under way and its last reads (each
 * lock request of which may wait 2 s too), well inside the loop's request timeout (the WAITFOR's
 * + REQUEST_MARGIN_MS; 200 such ENDs would take 400 s and be cancelled by the driver). What it
 * did not reach is still left open, found again, and ended by a later sweep.
 */
export const LEFT_OPEN_BUDGET_MS = 10_000;

/**
 * When the next sweep of dialogs left open is due, and what the last one found left open: the
 * next one ends those, unless a retry of the receive batch's failed ends is on them or gave them
 * up (EndRetries). The first sweep comes a period after start, and ends nothing (it has no earlier
 * finding).
 */
export class LeftOpenSweep {
  private found: string[] = [];
  private last: number;
  /** Whether the warning that the login cannot see the notification service was written (once a process). */
  blindLogged = false;

  constructor(
    readonly periodMs = LEFT_OPEN_SWEEP_MS,
    private readonly now: () => number = Date.now,
  ) {
    this.last = now();
  }

  due(): boolean {
    return this.periodMs > 0 && this.now() - this.last >= this.periodMs;
  }

  /** The endpoints to end now: those the last sweep found that no retry handles. */
  toEnd(retries: EndRetries): string[] {
    return this.found.filter((handle) => !retries.handles(handle));
  }

  /** What this sweep found left open, for the next one (nothing when the sweep itself failed). */
  swept(found: readonly string[]): void {
    this.found = [...found];
    this.last = this.now();
  }
}

/** A dialog end that failed, as the batches report it. */
export interface EndFailure {
  handle: string;
  error_number: number | null;
  error_message: string | null;
}

/** What one receive from the notification queue gave. */
export interface ReceiveResult {
  /** Messages taken (Status, EndDialog, Error). */
  received: number;
  /** Dialogs whose END CONVERSATION failed. */
  failures: EndFailure[];
}

/**
 * The poison count of dialog ends: each failed end is retried on the next cycles, and
 * after MAX_END_ATTEMPTS failures given up for good (logged once as an error), so one dialog
 * that cannot be ended costs a few statements, never a loop. The messages were consumed
 * already: a given-up dialog is an endpoint left open (sys.conversation_endpoints, state
 * DI), nothing undelivered.
 */
export class EndRetries {
  private readonly attempts = new Map<string, number>();
  /** Handles given up, the latest GIVEN_UP_KEPT (so that the sweep of dialogs left open does not try them again and again). */
  private readonly givenUp = new Set<string>();

  constructor(private readonly limit = MAX_END_ATTEMPTS) {}

  /** Count one failure; 'give-up' when this was the last attempt. */
  failed(handle: string): 'retry' | 'give-up' {
    const n = (this.attempts.get(handle) ?? 0) + 1;
    if (n >= this.limit) {
      this.attempts.delete(handle);
      this.givenUp.add(handle);
      if (this.givenUp.size > GIVEN_UP_KEPT) this.givenUp.delete(this.givenUp.values().next().value!);
      return 'give-up';
    }
    this.attempts.set(handle, n);
    return 'retry';
  }

  /** Whether this handle is being retried or was given up. */
  handles(handle: string): boolean {
    return this.attempts.has(handle) || this.givenUp.has(handle);
  }

  /** Handles to try again, at most `max`. */
  pending(max = 100): string[] {
    return [...this.attempts.keys()].slice(0, max);
  }

  /** The retried handles that did not fail again are done. */
  settle(tried: readonly string[], failedAgain: readonly EndFailure[]): void {
    const again = new Set(failedAgain.map((f) => f.handle));
    for (const handle of tried) if (!again.has(handle)) this.attempts.delete(handle);
  }

  get size(): number {
    return this.attempts.size;
  }
}

/** The I/O one cycle of the notification loop does, so that a test can drive the cycle. */
export interface NotifyCycleSteps {
  receive(): Promise<ReceiveResult>;
  retryEnds(handles: readonly string[]): Promise<EndFailure[]>;
  /** Wake the other instances (after a batch that took messages). */
  wake(): Promise<void>;
  /** Read the change feed (the sink's onChange). */
  catchUp(): void;
  /** End the dialogs left open that the last sweep found (leftOpenBatch), and find those left open now. */
  sweepLeftOpen?(handles: readonly string[]): Promise<LeftOpenResult>;
  logger: Logger;
}

/** What one sweep of the dialogs left open did. */
export interface LeftOpenResult {
  /** Ends tried (the last sweep's findings that were still left open). */
  tried: number;
  /** Whether the login sees [asyncexec/NotifyService] (without it, the sweep can see no endpoint). */
  visible?: boolean;
  failures: EndFailure[];
  /** Left open now, for the next sweep. */
  found: string[];
}

/**
 * One cycle of the notification loop: receive, then the catch-up whatever the receive did
 * (a receive that failed is rethrown after it, so the loop backs off and reconnects), then
 * wake the others, then the dialog ends that failed: counted, retried, given up. Only the
 * receive can fail the cycle; a wake or an end that fails is logged and the cycle goes on.
 */
export async function notifyCycle(steps: NotifyCycleSteps, retries: EndRetries, leftOpen?: LeftOpenSweep): Promise<ReceiveResult> {
  let result: ReceiveResult;
  try {
    result = await steps.receive();
  } catch (error) {
    steps.catchUp(); // the table is the truth: a receive that fails must not hold back delivery
    throw error;
  }
  if (result.received) {
    steps.catchUp();
    await steps.wake().catch((error: unknown) => steps.logger.warn({ err: toError(error) }, 'could not wake the other instances; they hear of this batch from their poll'));
  }
  count(result.failures, retries, steps.logger);
  const tried = retries.pending(RETRY_ENDS_LIMIT);
  if (tried.length) {
    try {
      const again = await steps.retryEnds(tried);
      retries.settle(tried, again);
      count(again, retries, steps.logger);
    } catch (error) {
      steps.logger.warn({ err: toError(error) }, 'could not retry the dialog ends that failed');
    }
  }
  if (leftOpen?.due() && steps.sweepLeftOpen) {
    try {
      const swept = await steps.sweepLeftOpen(leftOpen.toEnd(retries));
      // what a retry handles is left out when the next sweep ends them (toEnd)
      leftOpen.swept(swept.found);
      if (swept.visible === false && !leftOpen.blindLogged) {
        leftOpen.blindLogged = true;
        steps.logger.warn(
          'this login does not see [asyncexec/NotifyService] (sys.services): dialogs whose end was lost cannot be found and ended (docs/mssql.md, Permissions)',
        );
      }
      const ended = swept.tried - swept.failures.length;
      if (ended > 0) {
        steps.logger.info({ ended }, 'ended dialogs whose end was lost (a receive cut before its ends, or an end given up before a restart)');
      }
      count(swept.failures, retries, steps.logger);
    } catch (error) {
      // found nothing this time: the next sweep, a period later, only looks
      leftOpen.swept([]);
      steps.logger.warn({ err: toError(error) }, 'could not look for dialogs left open; will look again');
    }
  }
  return result;
}

function count(failures: readonly EndFailure[], retries: EndRetries, logger: Logger): void {
  for (const failure of failures) {
    const detail = { handle: failure.handle, errorNumber: failure.error_number, error: failure.error_message };
    if (retries.failed(failure.handle) === 'give-up') {
      logger.error(
        detail,
        `END CONVERSATION failed ${MAX_END_ATTEMPTS} times; the dialog's endpoint stays open (its messages were delivered). ` +
          'The listener login must own the dialog or be db_owner (docs/mssql.md, Permissions); end it with END CONVERSATION as db_owner',
      );
    } else {
      logger.warn(detail, 'END CONVERSATION failed; will try again');
    }
  }
}

/** A loop of one kind of round trip on a connection of its own, reconnecting with capped backoff. */
class ConnectionLoop {
  private pool: sql.ConnectionPool | undefined;
  private pending: sql.Request | undefined;
  private closed = false;
  private loop: Promise<void> | undefined;
  private endWait: (() => void) | undefined;

  constructor(
    private readonly name: string,
    private readonly config: sql.config,
    private readonly requestTimeout: number,
    private readonly logger: Logger,
    private readonly maxBackoffMs: number,
    private readonly cycle: (request: () => sql.Request) => Promise<void>,
    private readonly onFailure: (error: Error) => void,
    private readonly onReconnect: () => void,
  ) {}

  async start(): Promise<void> {
    if (!this.pool) await this.connect();
    this.loop = this.run();
  }

  /** A request on this loop's connection (also for one-off calls before start()). */
  async request(): Promise<sql.Request> {
    const pool = this.pool ?? (await this.connect());
    return this.track(pool.request());
  }

  private track(request: sql.Request): sql.Request {
    this.pending = request;
    return request;
  }

  private async connect(): Promise<sql.ConnectionPool> {
    const pool = new ConnectionPool({ ...this.config, requestTimeout: this.requestTimeout, pool: { min: 0, max: 1 } }, () =>
      this.logger.warn(`${this.name}: its connection had a transaction left open (a batch cut by its requestTimeout): closed, which rolls it back`),
    );
    pool.on('error', (error: unknown) => this.logger.warn({ err: error }, `${this.name} connection failed`));
    await pool.connect();
    this.pool = pool;
    return pool;
  }

  private async dropConnection(): Promise<void> {
    const pool = this.pool;
    this.pool = undefined;
    await pool?.close().catch(() => undefined);
  }

  private async run(): Promise<void> {
    let backoff = 250;
    let lost = false;
    while (!this.closed) {
      try {
        const pool = this.pool ?? (await this.connect());
        // closed while it connected: no round trip more (close() cancelled none, none was on its way)
        if (this.closed) break;
        if (lost) {
          lost = false;
          this.logger.info(`${this.name} reconnected`);
          this.onReconnect();
        }
        await this.cycle(() => this.track(pool.request()));
        this.pending = undefined;
        backoff = 250;
      } catch (error) {
        this.pending = undefined;
        if (this.closed) break;
        const err = toError(error);
        this.logger.warn({ err, retryInMs: backoff }, `${this.name} failed; reconnecting`);
        // once per loss (the listener_reconnects_total metric), not once per attempt while the database is away
        if (!lost) this.onFailure(err);
        lost = true;
        await this.dropConnection();
        // the wait before the next attempt (up to maxBackoffMs) ends at once on close()
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, backoff);
          this.endWait = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        this.endWait = undefined;
        backoff = Math.min(backoff * 2, this.maxBackoffMs);
      }
    }
  }

  /** Stop the loop (cancelling a WAITFOR now rather than at its timeout); the connection stays for `after`. */
  async close(after?: () => Promise<void>): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.pending?.cancel();
    this.endWait?.();
    await this.loop?.catch(() => undefined);
    if (after) await after().catch((error: unknown) => this.logger.warn({ err: toError(error) }, `${this.name}: closing failed`));
    await this.dropConnection();
  }
}

/**
 * Wakes the completion hub from the notification queue, on a connection of its own.
 * A message says that a status change committed; the hub then reads the change feed
 * (the table is the truth), which also covers what this process did not receive
 * (another instance's listener took it, or it happened while disconnected).
 *
 * With fan-out (the default) the listener also registers a wake-up queue of its own and
 * waits on it on a second connection: the instance that receives a batch from the shared
 * notification queue wakes every other one, so every instance hears every completion
 * at once, not at its next poll (docs/mssql.md).
 */
export class MssqlListener implements Closeable {
  /** This instance's name in asyncexec.AsyncExecListeners. */
  readonly instanceId = randomUUID();
  private readonly waitMs: number;
  private readonly batchSize: number;
  private readonly wakeWaitMs: number;
  private readonly staleSeconds: number;
  private readonly retries = new EndRetries();
  private readonly leftOpen: LeftOpenSweep;
  private readonly notify: ConnectionLoop;
  private wakes: ConnectionLoop | undefined;
  private registered = false;
  private closed = false;
  private lastSweep = 0;

  constructor(private readonly options: MssqlListenerOptions) {
    this.waitMs = options.waitMs ?? 1000;
    this.batchSize = options.batchSize ?? 500;
    this.wakeWaitMs = options.wakeWaitMs ?? 5000;
    this.staleSeconds = options.staleSeconds ?? 60;
    this.leftOpen = new LeftOpenSweep(options.leftOpenSweepMs ?? LEFT_OPEN_SWEEP_MS);
    const maxBackoff = options.maxBackoffMs ?? 30_000;
    const sink = options.sink;
    this.notify = new ConnectionLoop(
      'listener',
      options.config,
      // longer than the WAITFOR, so the driver never cancels a RECEIVE that is only waiting
      this.waitMs + REQUEST_MARGIN_MS,
      options.logger,
      maxBackoff,
      (request) => this.notifyCycle(request).then(() => undefined),
      (error) => this.safely(() => sink.onError(error)),
      () => this.safely(() => sink.onChange()),
    );
    if (options.fanOut ?? true) {
      this.wakes = new ConnectionLoop(
        'listener wake-up queue',
        options.config,
        this.wakeWaitMs + REQUEST_MARGIN_MS,
        options.logger,
        maxBackoff,
        (request) => this.wakeCycle(request),
        () => undefined,
        () => this.safely(() => sink.onChange()),
      );
    }
  }

  async start(): Promise<void> {
    await this.notify.start();
    if (this.wakes) {
      try {
        await this.register(await this.wakes.request());
        await this.wakes.start();
      } catch (error) {
        this.options.logger.error(
          { err: toError(error), instanceId: this.instanceId },
          'could not register this listener for wake-ups (EXECUTE on asyncexec.usp_AsyncExecListenerStart, migrations 0012 and later): ' +
            'this instance hears completions received by other instances only from its once-a-second poll',
        );
        await this.wakes.close();
        this.wakes = undefined;
      }
    }
  }

  private async register(request: sql.Request): Promise<void> {
    await request
      .input('instance', sql.UniqueIdentifier, this.instanceId)
      .input('host', sql.NVarChar(128), hostname().slice(0, 128))
      .input('processId', sql.Int, process.pid)
      .input('staleSeconds', sql.Int, this.staleSeconds)
      .execute('asyncexec.usp_AsyncExecListenerStart');
    this.registered = true;
    this.lastSweep = Date.now();
  }

  private notifyCycle(request: () => sql.Request): Promise<ReceiveResult> {
    const { sink, logger } = this.options;
    return notifyCycle(
      {
        receive: async () => {
          const result = await request().batch(receiveBatch(this.waitMs, this.batchSize));
          // a round trip that came back: the database is heard (readiness, listener lag)
          this.safely(() => sink.onHeartbeat?.());
          const sets = result.recordsets as unknown as [unknown[], EndFailure[], { received: number }[]];
          return { received: sets[2]?.[0]?.received ?? 0, failures: sets[1] ?? [] };
        },
        retryEnds: async (handles) => {
          const result = await request().input('handles', sql.NVarChar(sql.MAX), JSON.stringify(handles)).batch(retryEndsBatch());
          return (result.recordset ?? []) as EndFailure[];
        },
        wake: async () => {
          if (!this.registered || this.closed) return;
          const result = await request()
            .input('instance', sql.UniqueIdentifier, this.instanceId)
            .input('staleSeconds', sql.Int, this.staleSeconds)
            .execute<{ sent: number; failed: number; error_number: number | null; error_message: string | null }>('asyncexec.usp_AsyncExecListenerWake');
          const row = result.recordset[0];
          if (row?.failed || row?.error_number) {
            logger.warn({ sent: row.sent, failed: row.failed, errorNumber: row.error_number, error: row.error_message }, 'some instances could not be woken');
          }
        },
        catchUp: () => {
          if (!this.closed) this.safely(() => sink.onChange());
        },
        sweepLeftOpen: async (handles) => {
          const result = await request().input('handles', sql.NVarChar(sql.MAX), JSON.stringify(handles)).batch(leftOpenBatch(LEFT_OPEN_LIMIT));
          const sets = result.recordsets as unknown as [EndFailure[], { tried: number; visible: boolean }[], { handle: string }[]];
          const counts = sets[1]?.[0];
          return { failures: sets[0] ?? [], tried: Number(counts?.tried ?? 0), visible: counts ? Boolean(counts.visible) : undefined, found: (sets[2] ?? []).map((row) => row.handle) };
        },
        logger,
      },
      this.retries,
      this.leftOpen,
    );
  }

  private async wakeCycle(request: () => sql.Request): Promise<void> {
    const { sink, logger } = this.options;
    if (!this.registered || Date.now() - this.lastSweep > this.staleSeconds * 1000) {
      // swept during a long pause, or time to sweep the dead: Start does both
      await this.register(request());
    }
    const result = await request()
      .input('instance', sql.UniqueIdentifier, this.instanceId)
      .input('waitMs', sql.Int, this.wakeWaitMs)
      .execute<{ wakes: number; ended: number; failed: number; registered: boolean }>('asyncexec.usp_AsyncExecListenerWait');
    const row = result.recordset[0];
    if (!row?.registered) {
      logger.warn({ instanceId: this.instanceId }, 'this listener was swept as stale (a pause longer than its heartbeat allows); registering again');
      this.registered = false;
      this.safely(() => sink.onChange()); // wake-ups may have been missed
      return;
    }
    if (row.failed) logger.warn({ failed: row.failed }, 'could not end some wake-up dialogs');
    if (row.wakes && !this.closed) this.safely(() => sink.onChange());
  }

  private safely(fn: () => void): void {
    try {
      fn();
    } catch (error) {
      this.options.logger.error({ err: error }, 'listener sink failed');
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.notify.close();
    await this.wakes?.close(async () => {
      if (!this.registered) return;
      // drop this instance's queue, service and dialogs now rather than after staleSeconds
      await (await this.wakes!.request())
        .input('instance', sql.UniqueIdentifier, this.instanceId)
        .execute('asyncexec.usp_AsyncExecListenerStop');
    });
  }
}
