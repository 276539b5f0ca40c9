/**
 * Recurring schedules on SQL Server: asyncexec.AsyncExecSchedules (0013_schedules.sql) and
 * usp_AsyncExecFireSchedule, which fires one planned instant exactly once (see its header).
 * The service plans the fires with croner (src/schedules.ts) and a ticker in the process that
 * runs the sweeper calls the procedure once a second.
 */
import sql from 'mssql';
import { EngineError, toError, type Closeable, type Schedule, type ScheduleChange, type ScheduleInput } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { parseExactJson } from '../exactJson.js';
import {
  changedSchedule,
  checkCron,
  checkScheduleName,
  completeScheduleInput,
  clockOf,
  dueInstantKept,
  FIRE_PAGE,
  fireRounds,
  nextRunAfter,
  planFire,
  SCHEDULE_NAME,
  toSchedule,
  type CompleteScheduleInput,
  type PlannedFire,
  type ScheduleRow,
} from '../../schedules.js';
import { errorNumber, mapDatabaseError } from './errors.js';
import { getExecutionsById } from './executions.js';
import { enqueue } from './invoke.js';
import { encodeArguments } from './types.js';

const NAMES = ['name', '[procedure]', 'arguments', 'cron', 'timezone', 'queue', 'max_attempts', 'overlap', 'catch_up', 'paused',
  'next_run_at', 'last_run_at', 'created_at', 'created_by'];
/** The columns fromRow reads, optionally of `inserted.` or `deleted.` (OUTPUT). */
const columns = (prefix = '') => NAMES.map((name) => prefix + name).join(', ');
const COLUMNS = columns();

type StoredRow = Omit<ScheduleRow, 'arguments'> & { arguments: string };

function fromRow(row: StoredRow): Schedule {
  return toSchedule({ ...row, paused: Boolean(row.paused), arguments: parseExactJson(row.arguments) as Record<string, unknown> });
}

/**
 * The checks of an invoke, by an invoke: usp_AsyncExecInvoke in a transaction then rolled
 * back (its row, dialog and message with it), so a schedule is refused with the codes invoke gives.
 */
async function dryRun(pool: sql.ConnectionPool, s: CompleteScheduleInput): Promise<void> {
  const tx = new sql.Transaction(pool);
  await tx.begin();
  try {
    await enqueue(tx, { procedure: s.procedure, arguments: s.arguments, queue: s.queue, maxAttempts: s.maxAttempts, callerRoles: s.callerRoles });
  } finally {
    await tx.rollback();
  }
}

function scheduleInputs(req: sql.Request, s: CompleteScheduleInput): sql.Request {
  return req
    .input('name', sql.NVarChar(128), s.name)
    .input('procedure', sql.NVarChar(261), s.procedure)
    .input('arguments', sql.NVarChar(sql.MAX), encodeArguments(s.arguments))
    .input('cron', sql.NVarChar(200), s.cron)
    .input('timezone', sql.NVarChar(100), s.timezone)
    .input('queue', sql.NVarChar(100), s.queue)
    .input('maxAttempts', sql.Int, s.maxAttempts)
    .input('overlap', sql.VarChar(5), s.overlap)
    .input('catchUp', sql.VarChar(4), s.catchUp)
    .input('nextRunAt', sql.DateTime2(3), nextRunAfter(s.cron, s.timezone, new Date()));
}

function missing(name: string): EngineError {
  return new EngineError('NOT_FOUND', `no schedule named "${name}"`);
}

export async function createSchedule(pool: sql.ConnectionPool, input: ScheduleInput): Promise<Schedule> {
  checkScheduleName(input.name);
  const s = completeScheduleInput(input);
  checkCron(s.cron, s.timezone);
  await dryRun(pool, s);
  try {
    const result = await scheduleInputs(pool.request(), s)
      .input('createdBy', sql.NVarChar(256), input.createdBy ?? null)
      .query<StoredRow>(
        // last_execution_id: the newest call of a schedule of this name deleted before, so that overlap SKIP
        // waits for a call it started that still runs (IX_AsyncExecResults_schedule: one entry read)
        `INSERT asyncexec.AsyncExecSchedules (name, [procedure], arguments, cron, timezone, queue, max_attempts, overlap, catch_up,
                                              next_run_at, created_by, last_execution_id)
         OUTPUT ${columns('inserted.')}
         VALUES (@name, @procedure, @arguments, @cron, @timezone, @queue, @maxAttempts, @overlap, @catchUp, @nextRunAt, @createdBy,
                 (SELECT MAX(r.id) FROM asyncexec.AsyncExecResults AS r WHERE r.schedule_name = @name))`,
      );
    return fromRow(result.recordset[0]);
  } catch (error) {
    // 2627: a duplicate key in a PRIMARY KEY constraint
    if (errorNumber(error) === 2627) throw new EngineError('BAD_USER_INPUT', `a schedule named "${s.name}" exists`, { cause: error });
    throw mapDatabaseError(error);
  }
}

export async function getSchedule(db: sql.ConnectionPool, name: string): Promise<Schedule | null> {
  // no schedule has such a name (nor could it be sent as nvarchar(128))
  if (!SCHEDULE_NAME.test(name)) return null;
  const result = await db.request().input('name', sql.NVarChar(128), name).query<StoredRow>(
    `SELECT ${COLUMNS} FROM asyncexec.AsyncExecSchedules WHERE name = @name`,
  );
  return result.recordset.length ? fromRow(result.recordset[0]) : null;
}

export async function listSchedules(db: sql.ConnectionPool): Promise<Schedule[]> {
  const result = await db.request().query<StoredRow>(`SELECT ${COLUMNS} FROM asyncexec.AsyncExecSchedules ORDER BY name`);
  return result.recordset.map(fromRow);
}

export async function updateSchedule(pool: sql.ConnectionPool, name: string, change: ScheduleChange): Promise<Schedule> {
  const current = await getSchedule(pool, name);
  if (!current) throw missing(name);
  const s = changedSchedule(current, change);
  await dryRun(pool, s);
  // a new cron or zone keeps the due instant it has too, only if no fire moved next_run_at since it was read
  const kept = dueInstantKept(s.cron, s.timezone, current.nextRunAt, new Date());
  const result = await scheduleInputs(pool.request(), s).input('kept', sql.DateTime2(3), kept).query<StoredRow>(
    `UPDATE asyncexec.AsyncExecSchedules
        SET [procedure] = @procedure, arguments = @arguments, cron = @cron, timezone = @timezone, queue = @queue,
            max_attempts = @maxAttempts, overlap = @overlap, catch_up = @catchUp,
            updated_at = SYSUTCDATETIME(),
            -- the same cron and zone keep their next instant: an update at a fire's moment must not lose it
            next_run_at = CASE WHEN paused = 1 THEN NULL
                               WHEN cron COLLATE Latin1_General_BIN2 = @cron AND timezone COLLATE Latin1_General_BIN2 = @timezone THEN next_run_at
                               WHEN @kept IS NOT NULL AND next_run_at = @kept THEN @kept
                               ELSE @nextRunAt END
     WHERE name = @name;
     SELECT ${COLUMNS} FROM asyncexec.AsyncExecSchedules WHERE name = @name;`,
  );
  if (!result.recordset.length) throw missing(name);
  return fromRow(result.recordset[0]);
}

/** Pause (next_run_at NULL) or resume (from the next instant after now). The UPDATE waits for a fire in flight on the row. */
async function setPaused(pool: sql.ConnectionPool, name: string, paused: boolean): Promise<Schedule> {
  const current = await getSchedule(pool, name);
  if (!current) throw missing(name);
  if (current.paused === paused) return current;
  const result = await pool
    .request()
    .input('name', sql.NVarChar(128), name)
    .input('paused', sql.Bit, paused)
    .input('nextRunAt', sql.DateTime2(3), paused ? null : nextRunAfter(current.cron, current.timezone, new Date()))
    .query<StoredRow>(
      `UPDATE asyncexec.AsyncExecSchedules SET paused = @paused, next_run_at = @nextRunAt, updated_at = SYSUTCDATETIME()
        WHERE name = @name AND paused <> @paused;
       SELECT ${COLUMNS} FROM asyncexec.AsyncExecSchedules WHERE name = @name;`,
    );
  if (!result.recordset.length) throw missing(name);
  return fromRow(result.recordset[0]);
}

export const pauseSchedule = (pool: sql.ConnectionPool, name: string) => setPaused(pool, name, true);
export const resumeSchedule = (pool: sql.ConnectionPool, name: string) => setPaused(pool, name, false);

export async function deleteSchedule(pool: sql.ConnectionPool, name: string): Promise<Schedule> {
  if (!SCHEDULE_NAME.test(name)) throw missing(name);
  const result = await pool.request().input('name', sql.NVarChar(128), name).query<StoredRow>(
    `DELETE asyncexec.AsyncExecSchedules OUTPUT ${columns('deleted.')} WHERE name = @name`,
  );
  if (!result.recordset.length) throw missing(name);
  return fromRow(result.recordset[0]);
}

/** Plan every due schedule's fire with croner, then fire each (usp_AsyncExecFireSchedule: its own transaction). Returns the ids of the calls started. */
export async function fireDueSchedules(pool: sql.ConnectionPool, clock?: () => Date): Promise<string[]> {
  const { started, failed } = await fireAll(pool, clock);
  if (failed.length) throw firingFailed(failed);
  return started;
}

const firingFailed = (failed: Error[]) => new AggregateError(failed, failed.map((e) => e.message).join('; '));

/** fireDueSchedules' rounds: the ids of the calls started, and the schedules that could not fire. */
async function fireAll(pool: sql.ConnectionPool, clock?: () => Date): Promise<{ started: string[]; failed: Error[] }> {
  // the database's clock, not this process's (clockOf)
  clock ??= await clockOf(async () => (await pool.request().query<{ now: Date }>('SELECT SYSUTCDATETIME() AS now')).recordset[0].now);
  const failed: Error[] = [];
  const started = await fireRounds((now) => fireRound(pool, now, failed), clock);
  return { started, failed };
}

/** One round of fireDueSchedules: the due schedules of one page, each fired in its own transaction. */
async function fireRound(pool: sql.ConnectionPool, now: Date, failed: Error[]): Promise<{ planned: PlannedFire[]; read: number; fired: string[] }> {
  const due = await pool.request().input('now', sql.DateTime2(3), now).query<{ name: string; cron: string; timezone: string; next_run_at: Date }>(
    `SELECT TOP (${FIRE_PAGE}) name, cron, timezone, next_run_at FROM asyncexec.AsyncExecSchedules
      WHERE paused = 0 AND next_run_at <= @now ORDER BY next_run_at`,
  );
  const started: string[] = [];
  const planned: PlannedFire[] = [];
  for (const row of due.recordset) {
    // one schedule that cannot fire (a deadlock victim, say) holds up no other; it is tried again next round
    try {
      const fire = planFire({ name: row.name, cron: row.cron, timezone: row.timezone, nextRunAt: row.next_run_at }, now);
      planned.push(fire);
      const result = await pool
        .request()
        .input('name', sql.NVarChar(128), fire.name)
        .input('due', sql.DateTime2(3), fire.due)
        .input('next', sql.DateTime2(3), fire.next)
        .input('missed', sql.Bit, fire.missed)
        .input('now', sql.DateTime2(3), now)
        .output('id', sql.BigInt)
        .output('fired', sql.Bit)
        .execute('asyncexec.usp_AsyncExecFireSchedule');
      if (result.output.id != null) started.push(String(result.output.id));
    } catch (error) {
      failed.push(new Error(`schedule "${row.name}" did not fire: ${toError(error).message}`, { cause: error }));
    }
  }
  return { planned, read: due.recordset.length, fired: started };
}

/** Fires due schedules every `periodMs` until closed; a failed round is logged and tried again on the next. */
export function startScheduleTicker(pool: sql.ConnectionPool, logger: Logger, periodMs = 1000): Closeable {
  let closed = false;
  let running: Promise<void> = Promise.resolve();
  const timer = setInterval(() => {
    running = running.then(async () => {
      if (closed) return;
      try {
        const { started, failed } = await fireAll(pool);
        // as a client's invoke is logged, so `grep <token>` begins with its submit
        for (const { token, procedure, queue, status, runAt, schedule, submittedBy } of await getExecutionsById(pool, started)) {
          logger.info({ token, procedure, queue, status, runAt, schedule, by: submittedBy }, 'execution submitted');
        }
        if (failed.length) throw firingFailed(failed);
      } catch (error) {
        logger.warn({ err: toError(error) }, 'firing due schedules failed; the next round tries again');
      }
    });
  }, periodMs);
  return {
    async close() {
      closed = true;
      clearInterval(timer);
      await running;
    },
  };
}
