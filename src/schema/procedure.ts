import { checkRoles } from '../auth/apiKeys.js';
import type { GroupCommits, OutcomeCounts, Procedure, ProcedureParameter, QueueInfo } from '../engine.js';
import { builder, type Context } from './builder.js';
import { guard, requireAdmin, userError } from './errors.js';

const ParameterModeEnum = builder.enumType('ParameterMode', { values: ['IN', 'OUT', 'INOUT'] as const });

const ParameterRef = builder.objectRef<ProcedureParameter>('Parameter').implement({
  fields: (t) => ({
    name: t.exposeString('name'),
    type: t.exposeString('type', { description: "The database's own type name." }),
    mode: t.field({ type: ParameterModeEnum, resolve: (p) => (p.mode === 'OUT' || p.mode === 'INOUT' ? p.mode : 'IN') }),
    hasDefault: t.exposeBoolean('hasDefault', { description: 'May be left out of `arguments`.' }),
    position: t.exposeInt('position'),
  }),
});

const ProcedureRef = builder.objectRef<Procedure>('Procedure').implement({
  description: 'A registered (invocable) procedure.',
  fields: (t) => ({
    name: t.exposeString('name'),
    parameters: t.field({ type: [ParameterRef], resolve: (p) => p.parameters }),
    queue: t.exposeString('queue', { description: 'Queue used when the call names none.' }),
    maxAttempts: t.exposeInt('maxAttempts'),
    timeoutMs: t.exposeInt('timeoutMs', { nullable: true }),
    roles: t.exposeStringList('roles', { description: 'Roles that may invoke it (any one, or admin); empty: any authenticated caller.' }),
    transactional: t.exposeBoolean('transactional', {
      description: 'true: a call and its outcome commit together. false: it runs with no transaction open (it may commit itself) and its outcome is recorded after.',
    }),
  }),
});

const RegisterProcedureInput = builder.inputType('RegisterProcedureInput', {
  fields: (t) => ({
    name: t.string({
      required: true,
      description: 'The routine: an unambiguous schema-qualified name (`demo.add`) or its signature (`demo.add(integer, integer)`).',
    }),
    queue: t.string({ required: false, description: 'Queue used when a call names none. @default "default"' }),
    maxAttempts: t.int({ required: false, description: '1–100. @default 1' }),
    timeoutMs: t.int({ required: false, description: 'A run longer than this is cancelled and fails.' }),
    roles: t.stringList({ required: false, description: 'Roles that may invoke it; empty or absent: any authenticated caller.' }),
    transactional: t.boolean({
      required: false,
      description:
        'false: calls run with no transaction open (a procedure may COMMIT, commit in chunks, run what cannot run in a transaction); a run whose worker is lost then ends FAILED, never re-run. @default true',
    }),
  }),
});

const ProcedurePayload = builder.objectRef<{ procedure: Procedure }>('ProcedurePayload').implement({
  fields: (t) => ({ procedure: t.field({ type: ProcedureRef, resolve: (p) => p.procedure }) }),
});

const OutcomeCountsRef = builder.objectRef<OutcomeCounts>('OutcomeCounts').implement({
  description: 'Executions that ended, by outcome.',
  fields: (t) => ({
    succeeded: t.exposeInt('succeeded'),
    failed: t.exposeInt('failed'),
    cancelled: t.exposeInt('cancelled'),
  }),
});

const GroupCommitsRef = builder.objectRef<GroupCommits>('GroupCommits').implement({
  description:
    'Grouped commits: a worker runs up to `size` short calls in one transaction, each under its own savepoint (a failing call rolls back alone), and commits them together. size 1: one transaction per call.',
  fields: (t) => ({
    size: t.exposeInt('size', { description: 'Calls at most in one transaction (1–1000); 1: off.' }),
    maxMs: t.exposeInt('maxMs', { description: 'No call joins a group begun longer ago than this (ms).' }),
  }),
});

const QueueRef = builder.objectRef<QueueInfo>('Queue').implement({
  description: 'A named activation queue with its own concurrency limit.',
  fields: (t) => ({
    name: t.exposeString('name'),
    concurrency: t.exposeInt('concurrency'),
    paused: t.exposeBoolean('paused', {
      description: 'Paused (pauseQueue): its calls are taken and wait PENDING; none starts until resumeQueue.',
    }),
    groupCommits: t.field({ type: GroupCommitsRef, resolve: (q) => q.groupCommits }),
    waiting: t.exposeInt('waiting'),
    pending: t.exposeInt('pending'),
    running: t.exposeInt('running'),
    recent: t.field({
      type: OutcomeCountsRef,
      description: 'Executions of this queue that ended within the last `recentSeconds`.',
      resolve: (q) => q.recent,
    }),
    recentSeconds: t.exposeInt('recentSeconds'),
  }),
});

const GroupCommitsInput = builder.inputType('GroupCommitsInput', {
  fields: (t) => ({
    size: t.int({ required: false, description: 'Calls at most in one transaction (1–1000); 1 turns grouping off. Omitted: unchanged. @default 1' }),
    maxMs: t.int({ required: false, description: 'No call joins a group begun longer ago than this (1–10000 ms). Omitted: unchanged. @default 50' }),
  }),
});

const ConfigureQueueInput = builder.inputType('ConfigureQueueInput', {
  fields: (t) => ({
    name: t.string({ required: true, description: '1–128 characters of A-Z a-z 0-9 _ . : - (at most 100 on SQL Server)' }),
    concurrency: t.int({ required: true, description: 'Calls of this queue that may run at once, across all workers (1–1000).' }),
    groupCommits: t.field({
      type: GroupCommitsInput,
      required: false,
      description:
        'Run several short transactional calls (no timeout, not in a batch) in one transaction. Off for a procedure that must commit alone. Omitted: unchanged. PostgreSQL only (NOT_SUPPORTED on SQL Server).',
    }),
  }),
});

const ConfigureQueuePayload = builder.objectRef<{ queue: QueueInfo }>('ConfigureQueuePayload').implement({
  fields: (t) => ({ queue: t.field({ type: QueueRef, resolve: (p) => p.queue }) }),
});

builder.mutationFields((t) => ({
  configureQueue: t.field({
    type: ConfigureQueuePayload,
    description: 'Create a named queue or change its concurrency limit and grouped commits.',
    args: { input: t.arg({ type: ConfigureQueueInput, required: true }) },
    resolve: (_root, { input }, { engine, principal }) =>
      guard(async () => {
        requireAdmin(principal, 'configureQueue');
        const grouping = input.groupCommits;
        return {
          queue: await engine.configureQueue(input.name, input.concurrency, {
            size: grouping?.size ?? undefined,
            maxMs: grouping?.maxMs ?? undefined,
          }),
        };
      }),
  }),
  pauseQueue: t.field({
    type: ConfigureQueuePayload,
    description:
      'Start no more calls of a queue, in any worker process, until resumeQueue. Its calls are still taken and wait PENDING; calls running now end as they would; cancels, retries, batches and schedules go on. Admins only. NOT_FOUND for an unknown queue.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, context) => queueSwitch('pauseQueue', context, name, true),
  }),
  resumeQueue: t.field({
    type: ConfigureQueuePayload,
    description: 'Start the calls of a paused queue again, oldest first, within its concurrency. Admins only. A queue not paused is returned as it is.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, context) => queueSwitch('resumeQueue', context, name, false),
  }),
  registerProcedure: t.field({
    type: ProcedurePayload,
    description: 'Make a routine invocable (or change its registration), with the checks of asyncproc.register. Admins only.',
    args: { input: t.arg({ type: RegisterProcedureInput, required: true }) },
    resolve: (_root, { input }, { engine, principal }) =>
      guard(async () => {
        requireAdmin(principal, 'registerProcedure');
        const procedure = await engine.registerProcedure(input.name, {
          queue: input.queue ?? undefined,
          maxAttempts: input.maxAttempts ?? undefined,
          timeoutMs: input.timeoutMs ?? null,
          roles: checkRoles(input.roles ?? []),
          transactional: input.transactional ?? undefined,
        });
        return { procedure };
      }),
  }),
  unregisterProcedure: t.field({
    type: ProcedurePayload,
    description: 'Stop accepting calls of a procedure (the routine stays; calls already submitted still run). Admins only.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, { engine, principal }) =>
      guard(async () => {
        requireAdmin(principal, 'unregisterProcedure');
        return { procedure: await engine.unregisterProcedure(name) };
      }),
  }),
}));

builder.queryFields((t) => ({
  procedures: t.field({ type: [ProcedureRef], resolve: (_root, _args, { engine }) => engine.listProcedures() }),
  queues: t.field({
    type: [QueueRef],
    args: {
      recentSeconds: t.arg.int({ required: false, defaultValue: 3600, description: 'Window of `Queue.recent`: 1 second to 7 days.' }),
    },
    resolve: (_root, { recentSeconds }, { engine }) =>
      guard(async () => {
        const window = recentSeconds ?? 3600;
        if (window < 1 || window > 7 * 86_400) throw userError('BAD_USER_INPUT', 'recentSeconds must be between 1 and 604800');
        return engine.listQueues(window);
      }),
  }),
}));

/** pauseQueue and resumeQueue: admins only, logged with who did it. */
function queueSwitch(what: 'pauseQueue' | 'resumeQueue', context: Context, name: string, paused: boolean) {
  return guard(async () => {
    requireAdmin(context.principal, what);
    const queue = await context.engine.pauseQueue(name, paused);
    context.logger.info({ queue: queue.name, by: context.principal.subject }, what);
    return { queue };
  });
}
