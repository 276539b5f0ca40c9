import { ownerFilter, owns } from '../auth/principal.js';
import { formatSnapshot } from '../changeCursor.js';
import {
  EXECUTION_STATUSES,
  type Attempt,
  type Execution,
  type ExecutionError,
  type ExecutionEvent,
  type ExecutionFilter,
  type ExecutionProgress,
  type ExecutionResult,
} from '../engine.js';
import { builder, type Context } from './builder.js';
import { guard, userError } from './errors.js';
import { checkPageCursor } from './input.js';
import { withId } from './ids.js';

export const ExecutionStatusEnum = builder.enumType('ExecutionStatus', {
  description: 'WAITING → PENDING → RUNNING → SUCCEEDED | FAILED | CANCELLED; a retry goes back to WAITING.',
  values: EXECUTION_STATUSES,
});

/** How numbers too large or too precise for JavaScript travel in JSON fields. */
export const EXACT_NUMBERS =
  'Numbers a JavaScript number cannot hold exactly (integers beyond ±(2^53−1), such as large bigint values; numerics with more digits than a double keeps) are given as strings holding the exact decimal.';

const ExecutionErrorRef = builder.objectRef<ExecutionError>('ExecutionError').implement({
  description: 'Why a call failed, as the database reported it.',
  fields: (t) => ({
    number: t.exposeString('number', { nullable: true, description: 'SQLSTATE (PostgreSQL) or error number (SQL Server).' }),
    message: t.exposeString('message'),
    severity: t.exposeInt('severity', { nullable: true }),
    state: t.exposeInt('state', { nullable: true }),
    line: t.exposeInt('line', { nullable: true }),
    detail: t.exposeString('detail', { nullable: true, description: "PostgreSQL's DETAIL (also appended to `message`); null on SQL Server." }),
    context: t.exposeString('context', {
      nullable: true,
      description: "Where it failed: PostgreSQL's CONTEXT (the call stack, innermost first); on SQL Server the procedure (ERROR_PROCEDURE()).",
    }),
  }),
});

const ExecutionResultRef = builder.objectRef<ExecutionResult>('ExecutionResult').implement({
  description: `What a successful call returned. ${EXACT_NUMBERS}`,
  fields: (t) => ({
    returnValue: t.field({ type: 'JSON', nullable: true, resolve: (r) => r.returnValue ?? null }),
    outputParameters: t.field({
      type: 'JSON',
      nullable: true,
      description: 'OUT / INOUT / OUTPUT parameters keyed by name: every one, also an INOUT parameter left to its default.',
      resolve: (r) => r.outputParameters ?? null,
    }),
    rows: t.field({
      type: 'JSON',
      nullable: true,
      description: 'The first result set: its first rows, at most the service\'s cap (ASYNCPROC_MAX_ROWS, default 100); see `truncated`.',
      resolve: (r) => r.rows ?? null,
    }),
    rowCount: t.exposeInt('rowCount', {
      nullable: true,
      description: 'Rows the routine produced, also those cut from `rows`; null when it returned no result set or the engine does not count them (SQL Server).',
    }),
    truncated: t.exposeBoolean('truncated', {
      nullable: true,
      description: '`rows` holds fewer rows than the routine produced (cut at the cap); null when not known (SQL Server, results recorded by an older version).',
    }),
  }),
});

const ExecutionProgressRef = builder.objectRef<ExecutionProgress>('ExecutionProgress').implement({
  description:
    'How far a running call says it has got (PostgreSQL: the procedure calls `asyncproc.progress(percent, message)`). Stored outside the call\'s transaction, so it is seen while the call runs; at most a few reports a second are kept, the latest winning.',
  fields: (t) => ({
    percent: t.exposeFloat('percent', { description: '0–100.' }),
    message: t.exposeString('message', {
      nullable: true,
      description: 'As reported, at most 200 characters on PostgreSQL and 54 on SQL Server (longer ones are cut there).',
    }),
    at: t.expose('at', { type: 'DateTime', description: 'When the report was stored (database clock).' }),
  }),
});

const AttemptStatusEnum = builder.enumType('AttemptStatus', {
  description: 'LOST: the worker (or session) running it died; the call was started again. CANCELLED: stopped while running by cancelExecution.',
  values: ['RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'LOST'] as const,
});

const AttemptRef = builder.objectRef<Attempt>('Attempt').implement({
  description: 'One attempt of an execution, from the execution log.',
  fields: (t) => ({
    number: t.exposeInt('number'),
    status: t.field({ type: AttemptStatusEnum, resolve: (a) => a.status }),
    startedAt: t.expose('startedAt', { type: 'DateTime' }),
    finishedAt: t.expose('finishedAt', { type: 'DateTime', nullable: true }),
    worker: t.exposeString('worker', { nullable: true }),
    sessionId: t.exposeInt('sessionId', { nullable: true }),
    error: t.field({ type: ExecutionErrorRef, nullable: true, resolve: (a) => a.error }),
  }),
});

export const ExecutionRef = builder.objectRef<Execution>('Execution').implement({
  description: 'One requested call of a registered procedure.',
  interfaces: [builder.nodeInterfaceRef()],
  fields: (t) => ({
    id: t.globalID({
      description: 'Global id (Relay `Node`): the same for this execution in every query, mutation and subscription, so a normalised client cache keeps one object per execution. `token` is what the other fields take (they take this id too).',
      resolve: (e) => ({ type: 'Execution', id: e.token }),
    }),
    token: t.exposeID('token'),
    procedure: t.exposeString('procedure'),
    arguments: t.field({
      type: 'JSON',
      description: `As submitted, with relative dates and times ("today", "now", …) resolved at submit (PostgreSQL; SQL Server takes ISO 8601 dates and times only). ${EXACT_NUMBERS}`,
      resolve: (e) => e.arguments,
    }),
    queue: t.exposeString('queue'),
    status: t.field({ type: ExecutionStatusEnum, resolve: (e) => e.status }),
    submittedAt: t.expose('submittedAt', { type: 'DateTime' }),
    runAt: t.expose('runAt', { type: 'DateTime', nullable: true }),
    startedAt: t.expose('startedAt', { type: 'DateTime', nullable: true }),
    finishedAt: t.expose('finishedAt', { type: 'DateTime', nullable: true }),
    attempts: t.exposeInt('attempts', {
      description:
        'Runs that reached an outcome (succeeded, failed, timed out, cancelled), counted against maxAttempts. A run lost with its worker is not one: the call runs again, and ends FAILED after five such losses (error AP010 on PostgreSQL, 50010 on SQL Server); `history` lists the lost runs.',
    }),
    maxAttempts: t.exposeInt('maxAttempts'),
    submittedBy: t.exposeString('submittedBy', { nullable: true }),
    schedule: t.exposeString('schedule', { nullable: true, description: 'The schedule that started it; null for a call submitted by a client.' }),
    error: t.field({ type: ExecutionErrorRef, nullable: true, resolve: (e) => e.error }),
    result: t.field({ type: ExecutionResultRef, nullable: true, resolve: (e) => e.result }),
    worker: t.exposeString('worker', { nullable: true, description: 'The worker (PostgreSQL) or session (SQL Server) that ran it.' }),
    sessionId: t.exposeInt('sessionId', { nullable: true, description: 'Backend pid (PostgreSQL) or session id (SQL Server).' }),
    progress: t.field({
      type: ExecutionProgressRef,
      nullable: true,
      description:
        'The latest progress the current (or last) attempt reported; null when it reported none. On SQL Server the procedure calls `asyncexec.usp_AsyncExecProgress` and the service needs VIEW SERVER STATE to read it while the call runs (see docs/mssql.md).',
      resolve: (e, _args, { loaders }) => (e.progress !== undefined ? e.progress : loaders.progress.load(e.id)),
    }),
    history: t.field({
      type: [AttemptRef],
      description: 'Every attempt, oldest first: when it ran, who ran it, how it ended.',
      resolve: (e, _args, { loaders }) => loaders.history.load(e.id),
    }),
  }),
});

export const ExecutionEventRef = builder.objectRef<ExecutionEvent>('ExecutionEvent').implement({
  description: 'A status change. `cursor` resumes a stream after this event.',
  fields: (t) => ({
    cursor: t.exposeString('cursor'),
    status: t.field({ type: ExecutionStatusEnum, resolve: (e) => e.status }),
    execution: t.field({ type: ExecutionRef, resolve: (e) => e.execution }),
  }),
});

export const ExecutionFilterInput = builder.inputType('ExecutionFilter', {
  fields: (t) => ({
    status: t.field({ type: [ExecutionStatusEnum], required: false }),
    procedure: t.string({ required: false }),
    queue: t.string({ required: false }),
    schedule: t.string({ required: false, description: 'Only the executions this schedule started (its name).' }),
    submittedBy: t.string({
      required: false,
      description: "Only the executions this subject submitted (`Execution.submittedBy`). A plain caller sees only its own work whatever it asks: another subject matches nothing.",
    }),
  }),
});

/**
 * What a plain caller asking for another subject's work filters by: its own subject with a
 * control character added, which no verified caller's subject can hold (a JWT's `sub` with one
 * is refused), so it matches nothing, and whatever it could match would still be the caller's.
 */
const nobodyBut = (own: string) => `${own}\u0001`;

/** The filter a caller asked for, narrowed to its own executions unless it sees everything. */
export function toFilter(
  input: { status?: readonly string[] | null; procedure?: string | null; queue?: string | null; schedule?: string | null; submittedBy?: string | null } | null | undefined,
  context: Context,
): ExecutionFilter {
  const own = ownerFilter(context.principal);
  const asked = input?.submittedBy ?? null;
  return {
    status: (input?.status as ExecutionFilter['status']) ?? null,
    procedure: input?.procedure ?? null,
    queue: input?.queue ?? null,
    schedule: input?.schedule ?? null,
    submittedBy: own === null ? asked : asked === null || asked === own ? own : nobodyBut(own),
  };
}

/** The execution, if the caller may see it: another caller's execution is as unknown as one that never was. */
export async function visibleExecution({ engine, principal }: Context, token: string): Promise<Execution | null> {
  const execution = await engine.getExecution(token);
  return execution && owns(principal, execution.submittedBy) ? execution : null;
}

export const ExecutionConnectionRef = builder.connectionObject(
  {
    type: ExecutionRef,
    name: 'ExecutionConnection',
    fields: (tc) => ({
      totalCount: tc.int({
        description: 'All executions matching the filter.',
        resolve: (connection, _args, { engine }) => engine.countExecutions((connection as unknown as { filter: ExecutionFilter }).filter),
      }),
    }),
  },
  { name: 'ExecutionEdge' },
);

/** One page of an ExecutionConnection (Query.executions, Schedule.executions), newest first; it keeps its filter for `totalCount`. */
export async function executionPage(
  { engine }: Context,
  filter: ExecutionFilter,
  args: { first?: number | null; last?: number | null; after?: string | null; before?: string | null },
) {
  for (const n of [args.first, args.last]) {
    if (n != null && (n < 0 || n > 500)) throw userError('BAD_USER_INPUT', 'first/last must be between 0 and 500');
  }
  const page = await engine.listExecutions(filter, {
    first: args.first,
    last: args.last,
    after: checkPageCursor(args.after),
    before: checkPageCursor(args.before),
  });
  return {
    filter,
    edges: page.items.map((node) => ({ cursor: node.id, node })),
    pageInfo: {
      hasNextPage: page.hasNextPage,
      hasPreviousPage: page.hasPreviousPage,
      startCursor: page.items[0]?.id ?? null,
      endCursor: page.items.at(-1)?.id ?? null,
    },
  };
}

builder.queryFields((t) => ({
  changeCursor: t.string({
    description:
      'Where the change feed is now. Pass it as `after` to `executionEvents` to miss nothing from this moment on, also when a stream drops before its first event.',
    resolve: (_root, _args, { engine }) => guard(async () => formatSnapshot(await engine.currentPosition())),
  }),
  execution: t.field({
    type: ExecutionRef,
    nullable: true,
    args: { token: t.arg.id({ required: true }) },
    description: "null for an unknown token, and for another caller's execution (plain callers see only their own). Takes the execution's `id` too.",
    resolve: (_root, { token }, context) => withId(String(token), 'Execution', (uuid) => visibleExecution(context, uuid)),
  }),
  executions: t.connection(
    {
      type: ExecutionRef,
      description: 'Executions, newest first: all of them for admins and operators, a plain caller\'s own otherwise.',
      args: { filter: t.arg({ type: ExecutionFilterInput, required: false }) },
      resolve: (_root, args, context) => guard(() => executionPage(context, toFilter(args.filter, context), args)),
    },
    ExecutionConnectionRef,
  ),
}));
