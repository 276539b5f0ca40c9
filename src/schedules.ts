/**
 * Recurring schedules, the part both engines share: cron and time-zone checks, the next
 * instant of a schedule (croner, which applies the zone's daylight-saving rules), and the
 * plan of a fire that an engine then commits in one transaction (see
 * sql/postgres/routines/fire_due_schedules.sql).
 */
import { Cron } from 'croner';
import { EngineError, type Schedule, type ScheduleChange, type ScheduleInput } from './engine.js';

/**
 * A fire later than this after its instant counts as missed (the service was down, or far
 * behind); missed fires collapse into one fire (catch-up ONCE) or none (SKIP). A fire within it
 * is on time, however many of the schedule's instants it is late by: each of them fires in
 * turn (a tick that comes late, 250 schedules due at once). @default 60 s
 */
export const MISFIRE_GRACE_MS = 60_000;

/** Schedule names: 1–128 of A-Z a-z 0-9 _ . : - (as queue names). */
export const SCHEDULE_NAME = /^[A-Za-z0-9_.:-]{1,128}$/;

/**
 * Vixie cron's rule for the day fields: a day matches both day-of-month and day-of-week when
 * either field starts with `*` (every other day of the month from `*`, with 1-5 as day-of-week:
 * odd-numbered weekdays), and either of them when both are restricted (`0 9 1,15 * 1`: the 1st,
 * the 15th and Mondays). croner's default is either, always.
 */
function daysTogether(cron: string): boolean {
  const fields = cron.trim().split(/\s+/);
  if (fields.length < 5) return false; // a nickname (@daily, …)
  const [dayOfMonth, , dayOfWeek] = fields.slice(-3);
  return /^[*?]/.test(dayOfMonth) || /^[*?]/.test(dayOfWeek);
}

function cronOf(cron: string, timezone: string): Cron {
  return new Cron(cron, {
    timezone,
    // standard five fields, or six with seconds first
    mode: '5-or-6-parts',
    paused: true,
    domAndDow: daysTogether(cron),
    // daylight saving as Vixie cron treats it: a job whose seconds, minutes and hours have no
    // wildcard and no step (a list or a range included: `30 2,14 * * *`) is a fixed-time job, run
    // at the first valid time after a spring-forward gap and once when a fall-back repeats its
    // time; croner's default counts only single values, so `30 2,14` ran twice on the fall-back
    // night and not at all on the spring-forward one
    fixedTimeRule: 'no-wildcard',
  });
}

/** BAD_USER_INPUT unless `timezone` is an IANA time zone (or UTC) this runtime knows. */
export function checkTimezone(timezone: string): void {
  try {
    new Intl.DateTimeFormat('en', { timeZone: timezone });
  } catch (error) {
    throw new EngineError('BAD_USER_INPUT', `unknown time zone "${timezone}"`, { cause: error });
  }
}

/** The longest cron expression kept (SQL Server's column is nvarchar(200); six fields need far fewer). */
export const MAX_CRON_LENGTH = 200;

/** BAD_USER_INPUT for a malformed cron expression or time zone, one too long, or one that never fires. */
export function checkCron(cron: string, timezone: string): void {
  checkTimezone(timezone);
  if (cron.length > MAX_CRON_LENGTH) {
    throw new EngineError('BAD_USER_INPUT', `a cron expression is at most ${MAX_CRON_LENGTH} characters (this one has ${cron.length})`);
  }
  let next: Date | null;
  try {
    next = cronOf(cron, timezone).nextRun();
  } catch (error) {
    throw new EngineError('BAD_USER_INPUT', `malformed cron expression "${cron}": ${(error as Error).message}`, { cause: error });
  }
  if (next === null) throw new EngineError('BAD_USER_INPUT', `cron expression "${cron}" never fires`);
}

export function checkScheduleName(name: string): void {
  if (!SCHEDULE_NAME.test(name)) throw new EngineError('BAD_USER_INPUT', 'a schedule name is 1–128 characters of A-Z a-z 0-9 _ . : -');
}

/** The first instant of `cron` in `timezone` strictly after `after` (null: none). */
export function nextRunAfter(cron: string, timezone: string, after: Date): Date | null {
  return cronOf(cron, timezone).nextRun(after);
}

/**
 * A schedule's due instant to keep through a change of its cron or zone: its next_run_at when
 * that has come (a fire of it is due, not yet made) and the new expression has that instant
 * too; else null (the next instant is then the first after now). An update at a fire's moment
 * must not drop an instant the new expression still wants.
 */
export function dueInstantKept(cron: string, timezone: string, nextRunAt: Date | null, now: Date): Date | null {
  if (!nextRunAt || nextRunAt > now) return null;
  return nextRunAfter(cron, timezone, new Date(nextRunAt.getTime() - 1))?.getTime() === nextRunAt.getTime() ? nextRunAt : null;
}

/** A due schedule as the engine read it. */
export interface DueSchedule {
  name: string;
  cron: string;
  timezone: string;
  nextRunAt: Date;
}

/** What the fire transaction is told: move next_run_at from `due` to `next`, firing unless `missed` (and catch-up SKIP). */
export interface PlannedFire {
  name: string;
  due: Date;
  next: Date | null;
  missed: boolean;
}

/**
 * Plan a due schedule's fire at `now`. On time (within MISFIRE_GRACE_MS of its instant) the
 * next instant is the one after `due`, so that every instant fires once, each in turn, also
 * when the fire comes an instant or more late; missed, it is the first after `now`: however
 * many instants passed while nothing ran, one fire (or none) stands for them all.
 */
export function planFire(schedule: DueSchedule, now: Date): PlannedFire {
  const missed = now.getTime() - schedule.nextRunAt.getTime() > MISFIRE_GRACE_MS;
  return { name: schedule.name, due: schedule.nextRunAt, next: nextRunAfter(schedule.cron, schedule.timezone, missed ? now : schedule.nextRunAt), missed };
}

/**
 * The database's clock as seen from here: `readNow` once (the database's current time), then
 * this process's clock moved by the difference. Fires are planned by it, so that a process
 * whose own clock runs ahead neither fires a schedule early nor counts its fires as missed,
 * and every process of a cluster agrees on what is due.
 */
export async function clockOf(readNow: () => Promise<Date>): Promise<() => Date> {
  const offset = (await readNow()).getTime() - Date.now();
  return () => new Date(Date.now() + offset);
}

/** Rounds of fires one tick makes at most while due schedules remain (a full page, or instants a late tick left due). */
export const FIRE_ROUNDS = 10;
/** Due schedules one round reads and fires at most. */
export const FIRE_PAGE = 100;

/**
 * Fire rounds until nothing is left due that this process can fire now: a round that read a
 * full page, or planned a next instant already due, is followed by another, up to FIRE_ROUNDS
 * (what is left waits for the next tick). A round that read what the one before it read ends it:
 * nothing of that page moved (another process is firing it). One that fired nothing does not:
 * a page of schedules all passed over (overlap SKIP) moved on, and the next page may be due.
 */
export async function fireRounds<T>(round: (now: Date) => Promise<{ planned: PlannedFire[]; read: number; fired: T[] }>, clock: () => Date): Promise<T[]> {
  const fired: T[] = [];
  let previous = '';
  for (let i = 0; i < FIRE_ROUNDS; i++) {
    const now = clock();
    const result = await round(now);
    fired.push(...result.fired);
    const page = JSON.stringify(result.planned.map((fire) => [fire.name, fire.due]));
    const behind = result.planned.some((fire) => fire.next !== null && fire.next <= now);
    if (!result.read || page === previous || (result.read < FIRE_PAGE && !behind)) break;
    previous = page;
  }
  return fired;
}

/** A schedule's row, as both engines store it (arguments parsed). */
export interface ScheduleRow {
  name: string;
  procedure: string;
  arguments: Record<string, unknown>;
  cron: string;
  timezone: string;
  queue: string | null;
  max_attempts: number | null;
  overlap: Schedule['overlap'];
  catch_up: Schedule['catchUp'];
  paused: boolean;
  next_run_at: Date | null;
  last_run_at: Date | null;
  created_at: Date;
  created_by: string | null;
}

export function toSchedule(row: ScheduleRow): Schedule {
  return {
    name: row.name,
    procedure: row.procedure,
    arguments: row.arguments,
    cron: row.cron,
    timezone: row.timezone,
    queue: row.queue,
    maxAttempts: row.max_attempts,
    overlap: row.overlap,
    catchUp: row.catch_up,
    paused: row.paused,
    nextRunAt: row.next_run_at,
    lastRunAt: row.last_run_at,
    createdAt: row.created_at,
    createdBy: row.created_by,
  };
}

/** A schedule's input with its defaults filled in. */
export type CompleteScheduleInput = Pick<Schedule, 'name' | 'procedure' | 'arguments' | 'cron' | 'timezone' | 'queue' | 'maxAttempts' | 'overlap' | 'catchUp'> & {
  callerRoles: readonly string[] | null;
};

export function completeScheduleInput(input: ScheduleInput): CompleteScheduleInput {
  return {
    name: input.name,
    procedure: input.procedure,
    arguments: input.arguments,
    cron: input.cron,
    timezone: input.timezone ?? 'UTC',
    queue: input.queue ?? null,
    maxAttempts: input.maxAttempts ?? null,
    overlap: input.overlap ?? 'ALLOW',
    catchUp: input.catchUp ?? 'ONCE',
    callerRoles: input.callerRoles ?? null,
  };
}


/** A schedule with a change applied (fields left undefined keep their value), its cron and time zone checked. */
export function changedSchedule(current: Schedule, change: ScheduleChange): CompleteScheduleInput {
  const s = completeScheduleInput({ ...current, ...Object.fromEntries(Object.entries(change).filter(([, v]) => v !== undefined)) });
  checkCron(s.cron, s.timezone);
  return s;
}
