import { resolveArrayConnection } from '@pothos/plugin-relay';
import { ownerFilter, owns, type Principal } from '../auth/principal.js';
import { BATCH_STATUSES, EngineError, isReplayed, type Batch, type BatchStage, type Engine, type RunningExecution } from '../engine.js';
import { builder } from './builder.js';
import { guard, userError } from './errors.js';
import { ExecutionRef } from './execution.js';
import { withId } from './ids.js';
import { InvokeInput, checkCallCount, logSubmitted, toCall } from './invoke.js';

const BatchStatusEnum = builder.enumType('BatchStatus', {
  description: 'RUNNING until every execution has ended; then FAILED if any failed, else CANCELLED if any was cancelled, else SUCCEEDED.',
  values: BATCH_STATUSES,
});

const BatchFailurePolicyEnum = builder.enumType('BatchFailurePolicy', {
  values: {
    CANCEL: { description: 'The first execution that does not succeed cancels every one not yet started (the default).' },
    CONTINUE: { description: 'Later stages run anyway.' },
  } as const,
});

const BatchStageRef = builder.objectRef<BatchStage>('BatchStage').implement({
  description: "Counts of one stage's executions by status.",
  fields: (t) => ({
    stage: t.exposeInt('stage', { description: '1-based.' }),
    total: t.exposeInt('total'),
    waiting: t.exposeInt('waiting'),
    pending: t.exposeInt('pending'),
    running: t.exposeInt('running'),
    succeeded: t.exposeInt('succeeded'),
    failed: t.exposeInt('failed'),
    cancelled: t.exposeInt('cancelled'),
  }),
});

/** The batch, if the caller may see it: another caller's batch is as unknown as one that never was. */
export async function visibleBatch(engine: Engine, principal: Principal, id: string): Promise<Batch | null> {
  const batch = await engine.getBatch(id);
  return batch && owns(principal, batch.submittedBy) ? batch : null;
}

const sum = (batch: Batch, key: keyof Omit<BatchStage, 'stage'>) => batch.stages.reduce((n, s) => n + s[key], 0);

export const BatchRef = builder.objectRef<Batch>('Batch').implement({
  description:
    'Executions in ordered stages: the calls of a stage may run in parallel; stage n+1 is released when every execution of stage n has ended.',
  interfaces: [builder.nodeInterfaceRef()],
  fields: (t) => ({
    id: t.globalID({
      description:
        'Global id (Relay `Node`), the same in every query, mutation and subscription. `batchId` is the batch\'s UUID; `batch`, `cancelBatch` and `batchCompleted` take either.',
      resolve: (b) => ({ type: 'Batch', id: b.id }),
    }),
    batchId: t.exposeID('id', { description: 'The batch\'s UUID (what `id` held before it became the global id).' }),
    status: t.field({ type: BatchStatusEnum, resolve: (b) => b.status }),
    onFailure: t.field({ type: BatchFailurePolicyEnum, resolve: (b) => b.onFailure }),
    currentStage: t.exposeInt('currentStage', { description: 'The stage released last.' }),
    stageCount: t.exposeInt('stageCount'),
    submittedAt: t.expose('submittedAt', { type: 'DateTime' }),
    finishedAt: t.expose('finishedAt', { type: 'DateTime', nullable: true }),
    submittedBy: t.exposeString('submittedBy', { nullable: true }),
    stages: t.field({ type: [BatchStageRef], resolve: (b) => b.stages }),
    total: t.int({ resolve: (b) => sum(b, 'total') }),
    succeeded: t.int({ resolve: (b) => sum(b, 'succeeded') }),
    failed: t.int({ resolve: (b) => sum(b, 'failed') }),
    cancelled: t.int({ resolve: (b) => sum(b, 'cancelled') }),
    executions: t.connection(
      {
        type: ExecutionRef,
        description: 'By stage, then in submission order; pages of at most 100 (default 20).',
        resolve: async (b, args, { engine }) => resolveArrayConnection({ args, defaultSize: 20, maxSize: 100 }, await engine.getBatchExecutions(b.id)),
      },
      { name: 'BatchExecutionConnection' },
      { name: 'BatchExecutionEdge' },
    ),
  }),
});

builder.objectFields(ExecutionRef, (t) => ({
  stage: t.exposeInt('stage', { nullable: true, description: 'Its stage in its batch, 1-based.' }),
  batch: t.field({
    type: BatchRef,
    nullable: true,
    resolve: (e, _args, { loaders }) => (e.batchId ? loaders.batch.load(e.batchId) : null),
  }),
}));

const SubmitBatchInput = builder.inputType('SubmitBatchInput', {
  fields: (t) => ({
    stages: t.field({
      type: t.listRef(t.listRef(InvokeInput, { required: true }), { required: true }),
      required: true,
      description: 'Stage 1 first. The calls of a stage may run in parallel.',
    }),
    onFailure: t.field({ type: BatchFailurePolicyEnum, required: false, defaultValue: 'CANCEL' }),
    idempotencyKey: t.string({
      required: false,
      description:
        "Your key for this batch (1–128 characters), to send it again safely when you cannot tell whether it was submitted: the same key with the same batch returns the batch the first one made, and submits nothing; with another batch it is refused (IDEMPOTENCY_KEY_REUSED); while a request with it is still under way, refused at once (IDEMPOTENCY_KEY_IN_USE: send it again shortly). Per caller, apart from single calls' keys; held as long as the batch is kept.",
    }),
  }),
});

const SubmitBatchPayload = builder.objectRef<{ batch: Batch }>('SubmitBatchPayload').implement({
  fields: (t) => ({
    batch: t.field({ type: BatchRef, resolve: (p) => p.batch }),
    replayed: t.boolean({
      description: 'True when the idempotency key returned the batch an earlier request made: nothing was submitted this time.',
      resolve: (p) => isReplayed(p.batch),
    }),
  }),
});

const CancelBatchPayload = builder.objectRef<{ batch: Batch }>('CancelBatchPayload').implement({
  fields: (t) => ({ batch: t.field({ type: BatchRef, resolve: (p) => p.batch }) }),
});

builder.mutationFields((t) => ({
  cancelBatch: t.field({
    type: CancelBatchPayload,
    description:
      'Every call of the batch not yet started is cancelled (it never starts); running ones are cancelled as cancelExecution does. An ended batch: ALREADY_FINISHED.',
    args: { id: t.arg.id({ required: true, description: 'The batch\'s `id` or `batchId`.' }) },
    resolve: (_root, { id }, { engine, principal, logger }) =>
      withId(String(id), 'Batch', async (batchId) => {
        if (!(await visibleBatch(engine, principal, batchId))) throw new EngineError('NOT_FOUND', `no batch with id ${batchId}`);
        const batch = await engine.cancelBatch(batchId);
        logger.info({ batchId, status: batch.status, by: principal.subject }, 'batch cancelled');
        return { batch };
      }),
  }),
  submitBatch: t.field({
    type: SubmitBatchPayload,
    description: 'Submit a batch of calls in ordered stages, in one transaction: all or none.',
    args: { input: t.arg({ type: SubmitBatchInput, required: true }) },
    resolve: (_root, { input }, context) =>
      guard(async () => {
        checkCallCount(input.stages.reduce((n, stage) => n + stage.length, 0), context);
        const stages = input.stages.map((stage) => stage.map((call) => toCall(call, context)));
        const batch = await context.engine.submitBatch(stages, {
          onFailure: input.onFailure ?? 'CANCEL',
          submittedBy: context.principal.subject,
          idempotencyKey: input.idempotencyKey ?? null,
        });
        // a replay submitted nothing: one line says so, and the members' lines were logged by the request that made them
        if (isReplayed(batch)) {
          context.logger.info({ batchId: batch.id, by: context.principal.subject }, 'batch replayed');
          return { batch };
        }
        context.logger.info({ batchId: batch.id, stages: batch.stageCount, by: context.principal.subject }, 'batch submitted');
        // each member's own line (its token), read after the answer rather than before it
        if (context.logger.isLevelEnabled('info')) {
          void context.engine.getBatchExecutions(batch.id).then(
            (executions) => logSubmitted(executions, context),
            (error) => context.logger.debug({ err: error, batchId: batch.id }, 'could not read the batch for its log lines'),
          );
        }
        return { batch };
      }),
  }),
}));

const RunningExecutionRef = builder.objectRef<RunningExecution>('RunningExecution').implement({
  description: 'An execution running now.',
  fields: (t) => ({
    execution: t.field({ type: ExecutionRef, resolve: (r) => r.execution }),
    elapsedMs: t.int({ description: "How long it has run, by the database's clock.", resolve: (r) => r.elapsedMs }),
  }),
});

builder.queryFields((t) => ({
  batch: t.field({
    type: BatchRef,
    nullable: true,
    args: { id: t.arg.id({ required: true, description: 'The batch\'s `id` or `batchId`.' }) },
    description: "null for an unknown id, and for another caller's batch (plain callers see only their own).",
    resolve: (_root, { id }, { engine, principal }) => withId(String(id), 'Batch', (batchId) => visibleBatch(engine, principal, batchId)),
  }),
  running: t.field({
    type: [RunningExecutionRef],
    description: "What runs now, longest-running first, with the worker or session that runs it (a plain caller's own only).",
    args: {
      queue: t.arg.string({ required: false }),
      first: t.arg.int({ required: false, defaultValue: 100, description: '1–1000.' }),
    },
    resolve: (_root, { queue, first }, { engine, principal }) =>
      guard(async () => {
        const limit = first ?? 100;
        if (limit < 1 || limit > 1000) throw userError('BAD_USER_INPUT', 'first must be between 1 and 1000');
        return engine.listRunning(queue ?? null, limit, ownerFilter(principal));
      }),
  }),
}));

builder.subscriptionFields((t) => ({
  batchCompleted: t.field({
    type: BatchRef,
    description: 'One event when the batch ends (also if it ended before you subscribed), then the stream ends.',
    args: { id: t.arg.id({ required: true, description: 'The batch\'s `id` or `batchId`.' }) },
    subscribe: (_root, { id }, { hub, principal, wanted, waitsForDatabase }) =>
      withId(String(id), 'Batch', (batchId) => hub.batchCompleted(batchId, (batch) => owns(principal, batch.submittedBy), wanted, waitsForDatabase)),
    resolve: (batch) => batch,
  }),
}));
