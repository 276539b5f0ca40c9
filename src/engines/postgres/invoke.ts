import type pg from 'pg';
import { checkIdempotencyKey, EngineError, LONE_SURROGATE, markReplayed, type Execution, type InvokeCall } from '../../engine.js';
import { callerRoles } from '../identity.js';
import { mapSubmitError } from './errors.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';
import { ENGINE_TYPES } from './types.js';

/** Arguments are a JSON object keyed by parameter name, and a key is one (the database checks the rest). */
export function checkArguments(call: InvokeCall): void {
  if (call === null || typeof call !== 'object') throw new EngineError('BAD_USER_INPUT', 'a call must be an object: { procedure, arguments, … }');
  if (call.arguments === null || typeof call.arguments !== 'object' || Array.isArray(call.arguments)) {
    throw new EngineError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
  checkIdempotencyKey(call.idempotencyKey);
}

/** Longest `submittedBy` kept, in UTF-8 bytes (an index holds it: past about 2,700 bytes PostgreSQL refuses the row). */
const MAX_SUBMITTED_BY = 1000;
/** A NUL, or half of a surrogate pair: PostgreSQL's text and jsonb hold neither. */
const UNSTORABLE = new RegExp(`\\u0000|${LONE_SURROGATE.source}`);

/**
 * What in `value` JSON would not carry as it is: a string (a key too) PostgreSQL cannot store, or
 * a number JSON has no form for (JSON.stringify writes NaN and ±Infinity as null: the call ran
 * with NULL). Null when there is nothing.
 */
function unstorable(value: unknown): string | null {
  if (typeof value === 'string') return UNSTORABLE.test(value) ? 'a NUL or half of a surrogate pair, which PostgreSQL cannot store' : null;
  if (typeof value === 'number') return Number.isFinite(value) ? null : `${value}, which JSON has no form for (it would arrive as NULL)`;
  if (value === null || typeof value !== 'object') return null;
  for (const [key, item] of Object.entries(value)) {
    const problem = (!Array.isArray(value) && unstorable(key)) || unstorable(item);
    if (problem) return problem;
  }
  return null;
}

/**
 * What the database would refuse only by failing the statement, checked before anything is sent
 * (`invoke(tx, call)` runs on the caller's transaction: a statement that fails aborts it):
 * fields of the wrong type, a runAt that is no instant, a maxAttempts that is no integer, text
 * PostgreSQL cannot store, arguments that are not JSON. BAD_USER_INPUT or INVALID_ARGUMENTS.
 * Returns the call with runAt as a Date (an ISO string is taken too).
 */
export function checkCall(call: InvokeCall): InvokeCall {
  checkArguments(call);
  const bad = (message: string) => new EngineError('BAD_USER_INPUT', message);
  const text = (name: string, value: unknown, optional: boolean) => {
    if (value === undefined || value === null) {
      if (optional) return;
      throw bad(`${name} must be a string`);
    }
    if (typeof value !== 'string') throw bad(`${name} must be a string, not ${typeof value}`);
    if (UNSTORABLE.test(value)) throw bad(`${name} holds a NUL or half of a surrogate pair, which PostgreSQL cannot store`);
  };
  text('procedure', call.procedure, false);
  text('queue', call.queue, true);
  text('submittedBy', call.submittedBy, true);
  if (typeof call.submittedBy === 'string' && Buffer.byteLength(call.submittedBy) > MAX_SUBMITTED_BY) throw bad(`submittedBy is longer than ${MAX_SUBMITTED_BY} bytes (UTF-8)`);
  let runAt = call.runAt ?? null;
  if (typeof runAt === 'string') runAt = new Date(runAt);
  if (runAt !== null && !(runAt instanceof Date && Number.isFinite(runAt.getTime()))) throw bad('runAt must be a Date (or an ISO 8601 string)');
  const attempts = call.maxAttempts ?? null;
  if (attempts !== null && !(Number.isInteger(attempts) && Math.abs(attempts) <= 2 ** 31 - 1)) throw bad('maxAttempts must be a whole number');
  const roles = call.callerRoles ?? null;
  if (roles !== null && !(Array.isArray(roles) && roles.every((role) => typeof role === 'string'))) throw bad('callerRoles must be an array of strings');
  try {
    JSON.stringify(call.arguments);
  } catch (error) {
    throw new EngineError('INVALID_ARGUMENTS', `arguments must be JSON: ${(error as Error).message}`, { cause: error });
  }
  const problem = unstorable(call.arguments);
  if (problem) throw new EngineError('INVALID_ARGUMENTS', `arguments hold ${problem}`);
  return { ...call, runAt };
}

/**
 * Enqueue one call on the caller's open transaction (any pg client inside BEGIN).
 * Validation happens in asyncproc.submit itself, so plain SQL callers get the same checks; a
 * refusal is thrown (an EngineError) without failing the caller's transaction, which goes on.
 * `quiet`: the caller sends the notifications after its commit (see notifier.ts);
 * otherwise they are part of the transaction.
 */
export async function invoke(tx: pg.ClientBase, call: InvokeCall, quiet = false): Promise<Execution> {
  const checked = checkCall(call);
  let row: ExecutionRow & { refused_code: string | null; refused_message: string | null; refused_hint: string | null };
  try {
    // unnamed: `tx` may be the caller's own client, behind who knows what (a named statement outlives the transaction)
    // the engine's parsers, whatever the caller's client reads its own values with
    ({ rows: [row] } = await tx.query({ text: SUBMIT_IN_CALLERS_TRANSACTION, values: submitValues(checked, quiet), types: ENGINE_TYPES }));
  } catch (error) {
    throw mapSubmitError(error);
  }
  // refused without failing the statement: the caller's transaction goes on (submit_or_refuse.sql);
  // mapped as a submit's error raised (class 22, an argument PostgreSQL could not read as its type: INVALID_ARGUMENTS)
  if (row.refused_code !== null) {
    throw mapSubmitError(Object.assign(new Error(row.refused_message ?? 'refused'), { code: row.refused_code, hint: row.refused_hint ?? undefined }));
  }
  return submitted(row);
}

/**
 * Whether a submit's row is a replay: a keyed execution made before this statement began (a new
 * one is inserted during it, at clock_timestamp()). Made earlier in the same statement (two calls
 * of one request with one key), it is this request's own.
 */
const REPLAYED_COLUMN = `(e.idempotency_key is not null and e.submitted_at < statement_timestamp()) as replayed`;

/** A submit's row as the execution it returned, marked when an idempotency key replayed it (isReplayed). */
function submitted(row: ExecutionRow & { replayed?: boolean }): Execution {
  const execution = toExecution(row);
  return row.replayed ? markReplayed(execution) : execution;
}

const SUBMIT_IN_CALLERS_TRANSACTION = `select r.refused_code, r.refused_message, r.refused_hint, ${EXECUTION_COLUMNS}, ${REPLAYED_COLUMN}
  from asyncproc.submit_or_refuse($1, $2::jsonb, $3, $4, $5, $6, $7, $8::text[], $9) r
  cross join lateral (select (r.execution).*) e`;

// the service's own statements never wait for a key another transaction holds (key_wait, submit.sql)
const SUBMIT_ONE = `select ${EXECUTION_COLUMNS}, ${REPLAYED_COLUMN} from asyncproc.submit($1, $2::jsonb, $3, $4, $5, $6, $7, caller_roles => $8::text[], idempotency_key => $9, key_wait => false) e`;

function submitValues(call: InvokeCall, quiet: boolean): unknown[] {
  return [
    call.procedure,
    JSON.stringify(call.arguments),
    call.queue ?? null,
    call.runAt ?? null,
    call.maxAttempts ?? null,
    call.submittedBy ?? null,
    quiet,
    callerRoles(call.callerRoles),
    call.idempotencyKey ?? null,
  ];
}

/** Calls as the database reads them from JSON (submitMany, submit_batch): caller roles checked here. */
export function callsAsJson(calls: readonly InvokeCall[]): InvokeCall[] {
  return calls.map((call) => ({ ...call, callerRoles: callerRoles(call.callerRoles) }));
}

/**
 * All calls in one statement (so one transaction, one round trip): all or none, in order. Named
 * statements on the engine's own pool: parsed and planned once per connection, which roughly halves
 * PostgreSQL's CPU per call (the registry, the roles and the routine's signature are read by the
 * statement each time it runs, so nothing that may change is kept with it).
 */
export async function submitMany(pool: pg.Pool, calls: readonly InvokeCall[]): Promise<Execution[]> {
  for (const call of calls) checkArguments(call);
  try {
    return await submitRows(pool, calls);
  } catch (error) {
    throw mapSubmitError(error);
  }
}

/** submitMany's statement, its errors as the database raised them. */
async function submitRows(pool: pg.Pool, calls: readonly InvokeCall[]): Promise<Execution[]> {
  if (calls.length === 1) {
    const { rows } = await pool.query<ExecutionRow>({ name: 'asyncproc-submit', text: SUBMIT_ONE, values: submitValues(calls[0], true) });
    return [submitted(rows[0])];
  }
  const { rows } = await pool.query<ExecutionRow>({
    name: 'asyncproc-submit-many',
    text: `select ${EXECUTION_COLUMNS}, ${REPLAYED_COLUMN}
       from jsonb_array_elements($1::jsonb) with ordinality c (call, n),
            lateral asyncproc.submit(c.call ->> 'procedure', c.call -> 'arguments', c.call ->> 'queue',
                                     (c.call ->> 'runAt')::timestamptz, (c.call ->> 'maxAttempts')::integer,
                                     c.call ->> 'submittedBy', true,
                                     caller_roles => asyncproc.text_array(c.call -> 'callerRoles'),
                                     idempotency_key => c.call ->> 'idempotencyKey', key_wait => false) e
      order by c.n`,
    values: [JSON.stringify(callsAsJson(calls))],
  });
  return rows.map(submitted);
}

/**
 * SQLSTATE classes of errors after which the statement certainly did not commit: the server
 * answered with an error, so the statement's own transaction rolled back. Not so for a lost
 * connection (class 08, or none) or a server shutting down (57P): a commit may have happened.
 */
function rolledBack(error: unknown): boolean {
  const code = (error as { code?: unknown })?.code;
  return typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code) && !code.startsWith('08') && !code.startsWith('57P');
}

interface Waiting {
  call: InvokeCall;
  resolve: (execution: Execution) => void;
  reject: (error: unknown) => void;
}

/**
 * Single calls of separate requests (each its own `invoke`) share statements: while `maxInFlight`
 * submits are on their way, the calls that come meanwhile wait and then go together, as one
 * statement and one commit (one round trip and one WAL flush instead of one each). A call that
 * finds a free slot goes at once, alone: nothing waits for company. If such a shared statement
 * fails, the database rolled it back whole (see rolledBack): each of its calls is then submitted
 * again alone, so one caller's bad call fails that caller only, and every other call commits
 * exactly once. A lost connection fails every call of the statement, as it would fail each
 * alone (whether it committed is unknown, so nothing is sent again).
 */
export class SubmitCoalescer {
  private readonly waiting: Waiting[] = [];
  private inFlight = 0;

  constructor(
    private readonly pool: pg.Pool,
    private readonly maxInFlight = 1,
    /** Calls per shared statement at most. */
    private readonly maxShared = 64,
  ) {}

  submit(call: InvokeCall): Promise<Execution> {
    checkArguments(call);
    // a keyed call alone: its key may be refused (IDEMPOTENCY_KEY_IN_USE), which would roll back
    // the statement it shares and send every other call of it again alone (a client retrying a held
    // key with no pause slowed every other caller of the instance)
    if (call.idempotencyKey != null) return submitMany(this.pool, [call]).then(([execution]) => execution);
    return new Promise((resolve, reject) => {
      this.waiting.push({ call, resolve, reject });
      this.pump();
    });
  }

  private pump(): void {
    while (this.inFlight < this.maxInFlight && this.waiting.length) {
      const calls = this.waiting.splice(0, this.maxShared);
      this.inFlight++;
      void this.send(calls).finally(() => {
        this.inFlight--;
        this.pump();
      });
    }
  }

  private async send(calls: Waiting[]): Promise<void> {
    try {
      const executions = await submitRows(this.pool, calls.map((w) => w.call));
      calls.forEach((w, i) => w.resolve(executions[i]));
    } catch (error) {
      if (calls.length === 1 || !rolledBack(error)) {
        for (const w of calls) w.reject(mapSubmitError(error));
        return;
      }
      // which call failed is not known: each alone, at once (the slot is held meanwhile)
      await Promise.all(
        calls.map((w) => submitRows(this.pool, [w.call]).then(([execution]) => w.resolve(execution), (e: unknown) => w.reject(mapSubmitError(e)))),
      );
    }
  }
}
