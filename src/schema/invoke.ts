import { callerRoles, owns } from '../auth/principal.js';
import { EngineError, isReplayed, type Execution, type InvokeCall } from '../engine.js';
import { builder, type Context } from './builder.js';
import { guard, userError } from './errors.js';
import { ExecutionRef } from './execution.js';
import { withId } from './ids.js';
import { checkRunAt } from './input.js';

export const InvokeInput = builder.inputType('InvokeInput', {
  fields: (t) => ({
    procedure: t.string({ required: true, description: 'Registered name, e.g. `demo.add`.' }),
    arguments: t.field({
      type: 'JSON',
      required: false,
      description:
        'Arguments keyed by parameter name. Send bigint values beyond ±(2^53−1) and numerics with more digits than a double keeps as strings (`"9007199254740993"`): a JSON number that large in the variables reaches the service already rounded, and one written in the query is refused (BAD_USER_INPUT). Relative dates and times ("today", "now", …) are resolved when the call is submitted (PostgreSQL; SQL Server takes ISO 8601 dates and times only).',
    }),
    queue: t.string({ required: false, description: "Defaults to the procedure's queue." }),
    runAt: t.field({ type: 'DateTime', required: false, description: 'Not started before this instant.' }),
    maxAttempts: t.int({ required: false, description: "Defaults to the procedure's registration." }),
    idempotencyKey: t.string({
      required: false,
      description:
        "Your key for this call (1–128 characters), to send it again safely when you cannot tell whether it was submitted (a timeout, a 503, a lost connection): the same key with the same call returns the execution the first one made, and submits nothing; with another call it is refused (IDEMPOTENCY_KEY_REUSED); while a request with it is still under way, refused at once (IDEMPOTENCY_KEY_IN_USE: send it again shortly). Keys are per caller, and held as long as the execution's history is kept. Not taken in a batch's calls: the batch takes one (SubmitBatchInput.idempotencyKey).",
    }),
  }),
});

export type InvokeInputShape = {
  procedure: string;
  arguments?: unknown;
  queue?: string | null;
  runAt?: Date | null;
  maxAttempts?: number | null;
  idempotencyKey?: string | null;
};

/** Arguments are at most ASYNCPROC_MAX_ARGUMENT_BYTES as JSON (a call's, and a schedule's, which each firing submits). */
export function checkArgumentBytes(args: unknown, context: Pick<Context, 'limits'>): void {
  if (Buffer.byteLength(JSON.stringify(args)) > context.limits.maxArgumentBytes) {
    throw userError('PAYLOAD_TOO_LARGE', `arguments exceed ${context.limits.maxArgumentBytes} bytes`);
  }
}

/** Edge checks that need no database: shape and size. */
export function toCall(input: InvokeInputShape, context: Context): InvokeCall {
  const args = input.arguments ?? {};
  if (typeof args !== 'object' || args === null || Array.isArray(args)) {
    throw userError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
  checkArgumentBytes(args, context);
  return {
    procedure: input.procedure,
    arguments: args as Record<string, unknown>,
    queue: input.queue ?? null,
    runAt: checkRunAt(input.runAt),
    maxAttempts: input.maxAttempts ?? null,
    submittedBy: context.principal.subject,
    callerRoles: callerRoles(context.principal),
    idempotencyKey: input.idempotencyKey ?? null,
  };
}

/** A request may carry at most `limits.maxCalls` calls. */
export function checkCallCount(count: number, context: Context): void {
  if (count > context.limits.maxCalls) {
    throw userError('PAYLOAD_TOO_LARGE', `at most ${context.limits.maxCalls} calls per request`);
  }
}

/** Submit every call in one transaction: all or none. */
export async function submitAll(inputs: readonly InvokeInputShape[], context: Context): Promise<Execution[]> {
  checkCallCount(inputs.length, context);
  const calls = inputs.map((input) => toCall(input, context));
  const { engine } = context;
  const executions = await (engine.submit
    ? guard(() => engine.submit!(calls))
    : guard(() =>
        engine.withTransaction(async (tx) => {
          const executions: Execution[] = [];
          // one request at a time on a transaction (required by both drivers)
          for (const call of calls) executions.push(await engine.invoke(tx, call));
          return executions;
        }),
      ));
  logSubmitted(executions, context);
  return executions;
}

/** One line per submitted execution, after the commit; a replay's says so (nothing was submitted). */
export function logSubmitted(executions: readonly Execution[], context: Context): void {
  for (const execution of executions) {
    const { token, procedure, queue, status, batchId, stage, runAt } = execution;
    context.logger.info(
      { token, procedure, queue, status, runAt, batchId, stage, by: context.principal.subject },
      isReplayed(execution) ? 'execution replayed' : 'execution submitted',
    );
  }
}

const REPLAYED = 'True when the idempotency key returned the execution an earlier request made: nothing was submitted this time.';

const InvokePayload = builder.objectRef<{ execution: Execution }>('InvokePayload').implement({
  fields: (t) => ({
    execution: t.field({ type: ExecutionRef, resolve: (p) => p.execution }),
    replayed: t.boolean({ description: REPLAYED, resolve: (p) => isReplayed(p.execution) }),
  }),
});
const CancelExecutionPayload = builder.objectRef<{ execution: Execution }>('CancelExecutionPayload').implement({
  fields: (t) => ({ execution: t.field({ type: ExecutionRef, resolve: (p) => p.execution }) }),
});

const InvokeManyPayload = builder.objectRef<{ executions: Execution[] }>('InvokeManyPayload').implement({
  fields: (t) => ({
    executions: t.field({ type: [ExecutionRef], resolve: (p) => p.executions }),
    replayed: t.booleanList({ description: `One per execution, in order. ${REPLAYED}`, resolve: (p) => p.executions.map((e) => isReplayed(e)) }),
  }),
});

builder.mutationFields((t) => ({
  invoke: t.field({
    type: InvokePayload,
    description: 'Submit one call; the token comes back at once, the call runs later.',
    args: { input: t.arg({ type: InvokeInput, required: true }) },
    resolve: async (_root, { input }, context) => ({ execution: (await submitAll([input], context))[0] }),
  }),
  invokeMany: t.field({
    type: InvokeManyPayload,
    description: 'Submit several calls in one transaction: all or none.',
    args: { inputs: t.arg({ type: [InvokeInput], required: true }) },
    resolve: async (_root, { inputs }, context) => ({ executions: await submitAll(inputs, context) }),
  }),
  cancelExecution: t.field({
    type: CancelExecutionPayload,
    description:
      'WAITING/PENDING: cancelled, it never starts. RUNNING: its statement is cancelled in the database and its writes roll back. Finished: ALREADY_FINISHED.',
    args: { token: t.arg.id({ required: true }) },
    resolve: (_root, { token }, { engine, principal, logger }) =>
      withId(String(token), 'Execution', async (id) => {
        const execution = await engine.getExecution(id);
        // another caller's execution is refused as an unknown one is: its existence does not leak
        if (!execution || !owns(principal, execution.submittedBy)) throw new EngineError('NOT_FOUND', `no execution with token ${id}`);
        const cancelled = await engine.cancelExecution(id);
        logger.info({ token: id, procedure: cancelled.procedure, status: cancelled.status, by: principal.subject }, 'execution cancelled');
        return { execution: cancelled };
      }),
  }),
}));
