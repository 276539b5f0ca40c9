import type pg from 'pg';
import { EngineError, type Execution, type Schedule, type ScheduleChange, type ScheduleInput } from '../../engine.js';
import {
  checkCron,
  changedSchedule,
  checkScheduleName,
  clockOf,
  completeScheduleInput as complete,
  dueInstantKept,
  FIRE_PAGE,
  fireRounds,
  nextRunAfter,
  planFire,
  toSchedule,
  type CompleteScheduleInput as CompleteInput,
  type DueSchedule,
  type ScheduleRow,
} from '../../schedules.js';
import { callerRoles } from '../identity.js';
import { mapDatabaseError, mapSubmitError } from './errors.js';
import { checkArguments } from './invoke.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

async function inTransaction<T>(pool: pg.Pool, fn: (client: pg.PoolClient) => Promise<T>): Promise<T> {
  const client = await pool.connect();
  let broken: Error | undefined;
  try {
    await client.query('begin');
    const result = await fn(client);
    await client.query('commit');
    return result;
  } catch (error) {
    await client.query('rollback').catch((e) => (broken = e as Error));
    throw mapDatabaseError(error);
  } finally {
    client.release(broken);
  }
}

/**
 * The checks of a submit, by a submit: asyncproc.submit run in a savepoint that is then
 * rolled back, so a schedule is refused with exactly the codes invoke would give.
 */
async function dryRun(client: pg.ClientBase, s: CompleteInput): Promise<void> {
  checkArguments({ procedure: s.procedure, arguments: s.arguments });
  await client.query('savepoint schedule_check');
  try {
    await client.query(`select 1 from asyncproc.submit($1, $2::jsonb, $3, null, $4, null, true, caller_roles => $5::text[])`, [
      s.procedure,
      JSON.stringify(s.arguments),
      s.queue,
      s.maxAttempts,
      callerRoles(s.callerRoles),
    ]);
  } catch (error) {
    // refused as invoke refuses it (a domain's check raising: INVALID_ARGUMENTS)
    throw mapSubmitError(error);
  } finally {
    await client.query('rollback to savepoint schedule_check');
  }
}

/** How far ahead the service's and the database's rules of a schedule's time zone must agree. */
const ZONE_HORIZON_DAYS = 731;

/**
 * BAD_USER_INPUT unless the database knows `timezone` and gives it the UTC offsets the service
 * does, every 6 hours over the next two years. The service plans a schedule's instants with its
 * own time-zone data (croner, through Node's ICU), and the database reads the relative dates of
 * the arguments ('today', 'tomorrow 08:00') in the zone with its own; where the two disagree (a
 * zone whose rules changed, known to one side's data only), a call fired at 08:30 by the one
 * would be given the date of 09:30 by the other, one day past midnight, without a word.
 */
async function checkZoneAgrees(client: pg.ClientBase, timezone: string): Promise<void> {
  const from = new Date(Math.floor(Date.now() / 3_600_000) * 3_600_000);
  let rows: { at: string; offset: number }[];
  await client.query('savepoint zone_check');
  try {
    ({ rows } = await client.query<{ at: string; offset: number }>(
      `select (extract(epoch from t) * 1000)::bigint::text as at,
              extract(epoch from (t at time zone $1) - (t at time zone 'UTC'))::integer as offset
         from generate_series($2::timestamptz, $2::timestamptz + $3 * interval '1 day', interval '6 hours') t`,
      [timezone, from, ZONE_HORIZON_DAYS],
    ));
    await client.query('release savepoint zone_check');
  } catch (error) {
    await client.query('rollback to savepoint zone_check');
    // 22023: time zone "…" not recognized
    if ((error as { code?: string }).code === '22023') throw new EngineError('BAD_USER_INPUT', `the database does not know the time zone "${timezone}"`);
    throw error;
  }
  const format = new Intl.DateTimeFormat('en-US', { timeZone: timezone, timeZoneName: 'longOffset' });
  for (const row of rows) {
    const at = new Date(Number(row.at));
    const name = format.formatToParts(at).find((part) => part.type === 'timeZoneName')?.value ?? '';
    const [, sign, hours, minutes] = /^GMT(?:([+-])(\d{2}):(\d{2}))?$/.exec(name) ?? [];
    const offset = sign ? (sign === '-' ? -1 : 1) * (Number(hours) * 3600 + Number(minutes) * 60) : 0;
    if (offset !== row.offset) {
      const hhmm = (seconds: number) =>
        `${seconds < 0 ? '-' : '+'}${String(Math.floor(Math.abs(seconds) / 3600)).padStart(2, '0')}:${String((Math.abs(seconds) % 3600) / 60).padStart(2, '0')}`;
      throw new EngineError(
        'BAD_USER_INPUT',
        `the database and the service disagree on the time zone "${timezone}": at ${at.toISOString()} it is UTC${hhmm(row.offset)} to the ` +
          `database and UTC${hhmm(offset)} to the service (one of them has older time-zone data); update that one, or name a zone both agree on`,
      );
    }
  }
}

export async function createSchedule(pool: pg.Pool, input: ScheduleInput): Promise<Schedule> {
  checkScheduleName(input.name);
  const s = complete(input);
  checkCron(s.cron, s.timezone);
  return inTransaction(pool, async (client) => {
    await checkZoneAgrees(client, s.timezone);
    await dryRun(client, s);
    const { rows } = await client
      .query<ScheduleRow>(
        // last_execution_id: the newest call of a schedule of this name deleted before, so that overlap SKIP
        // waits for a call it started that still runs (by the index on (schedule_name, id): one entry read)
        `insert into asyncproc.schedules (name, procedure, arguments, cron, timezone, queue, max_attempts, overlap, catch_up,
                                          next_run_at, created_by, last_execution_id)
         values ($1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9, $10, $11,
                 (select max(e.id) from asyncproc.executions e where e.schedule_name = $1)) returning *`,
        [s.name, s.procedure, JSON.stringify(s.arguments), s.cron, s.timezone, s.queue, s.maxAttempts, s.overlap, s.catchUp,
          nextRunAfter(s.cron, s.timezone, new Date()), input.createdBy ?? null],
      )
      .catch((error) => {
        if ((error as { code?: string }).code === '23505') throw new EngineError('BAD_USER_INPUT', `a schedule named "${s.name}" exists`);
        throw error;
      });
    return toSchedule(rows[0]);
  });
}

async function locked(client: pg.ClientBase, name: string): Promise<ScheduleRow> {
  const { rows } = await client.query<ScheduleRow>('select * from asyncproc.schedules where name = $1 for update', [name]);
  if (!rows.length) throw new EngineError('NOT_FOUND', `no schedule named "${name}"`);
  return rows[0];
}

export function updateSchedule(pool: pg.Pool, name: string, change: ScheduleChange): Promise<Schedule> {
  return inTransaction(pool, async (client) => {
    const row = await locked(client, name);
    const s = changedSchedule(toSchedule(row), change);
    await checkZoneAgrees(client, s.timezone);
    await dryRun(client, s);
    const now = new Date();
    const { rows } = await client.query<ScheduleRow>(
      `update asyncproc.schedules
          set procedure = $2, arguments = $3::jsonb, cron = $4, timezone = $5, queue = $6, max_attempts = $7, overlap = $8,
              catch_up = $9, updated_at = clock_timestamp(),
              -- the same cron and zone keep their next instant: an update at a fire's moment must not lose it
              next_run_at = case when paused then null when cron = $4 and timezone = $5 then next_run_at else $10::timestamptz end
        where name = $1 returning *`,
      [name, s.procedure, JSON.stringify(s.arguments), s.cron, s.timezone, s.queue, s.maxAttempts, s.overlap, s.catchUp,
        // a new cron or zone: its due instant kept if the new one has it too (the row is locked: no fire moves it meanwhile)
        dueInstantKept(s.cron, s.timezone, row.next_run_at, now) ?? nextRunAfter(s.cron, s.timezone, now)],
    );
    return toSchedule(rows[0]);
  });
}

export function pauseSchedule(pool: pg.Pool, name: string): Promise<Schedule> {
  return inTransaction(pool, async (client) => {
    await locked(client, name);
    const { rows } = await client.query<ScheduleRow>(
      `update asyncproc.schedules set paused = true, next_run_at = null, updated_at = clock_timestamp() where name = $1 returning *`,
      [name],
    );
    return toSchedule(rows[0]);
  });
}

/** Resumes from the next instant after now: instants passed while paused never fire. */
export function resumeSchedule(pool: pg.Pool, name: string): Promise<Schedule> {
  return inTransaction(pool, async (client) => {
    const row = await locked(client, name);
    if (!row.paused) return toSchedule(row);
    const { rows } = await client.query<ScheduleRow>(
      `update asyncproc.schedules set paused = false, next_run_at = $2, updated_at = clock_timestamp() where name = $1 returning *`,
      [name, nextRunAfter(row.cron, row.timezone, new Date())],
    );
    return toSchedule(rows[0]);
  });
}

export async function deleteSchedule(pool: pg.Pool, name: string): Promise<Schedule> {
  const { rows } = await pool.query<ScheduleRow>('delete from asyncproc.schedules where name = $1 returning *', [name]);
  if (!rows.length) throw new EngineError('NOT_FOUND', `no schedule named "${name}"`);
  return toSchedule(rows[0]);
}

export async function listSchedules(pool: pg.Pool): Promise<Schedule[]> {
  const { rows } = await pool.query<ScheduleRow>('select * from asyncproc.schedules order by name');
  return rows.map(toSchedule);
}

export async function getSchedule(pool: pg.Pool, name: string): Promise<Schedule | null> {
  const { rows } = await pool.query<ScheduleRow>('select * from asyncproc.schedules where name = $1', [name]);
  return rows.length ? toSchedule(rows[0]) : null;
}

/**
 * The activator's tick: plan every due schedule's fire with croner, then commit the fires
 * in one statement (asyncproc.fire_due_schedules: each fire moves next_run_at and submits
 * the call in one transaction, exactly once however many processes race). Returns the
 * executions started (or failed at once, for a procedure gone since).
 */
export async function fireDueSchedules(pool: pg.Pool, clock?: () => Date): Promise<Execution[]> {
  // the database's clock, not this process's (clockOf)
  clock ??= await clockOf(async () => (await pool.query<{ now: Date }>('select clock_timestamp() as now')).rows[0].now);
  return fireRounds(async (now) => {
    const { rows: due } = await pool.query<{ name: string; cron: string; timezone: string; next_run_at: Date }>(
      `select name, cron, timezone, next_run_at from asyncproc.schedules
        where not paused and next_run_at <= $1 order by next_run_at limit ${FIRE_PAGE}`,
      [now],
    );
    if (!due.length) return { planned: [], read: 0, fired: [] };
    const planned = due.map((row) => {
      const schedule: DueSchedule = { name: row.name, cron: row.cron, timezone: row.timezone, nextRunAt: row.next_run_at };
      return planFire(schedule, now);
    });
    const { rows } = await pool.query<ExecutionRow>(
      `select ${EXECUTION_COLUMNS} from asyncproc.fire_due_schedules($1, $2::jsonb) e`,
      [now, JSON.stringify(planned)],
    );
    return { planned, read: due.length, fired: rows.map(toExecution) };
  }, clock);
}
