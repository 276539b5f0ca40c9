import { callerRoles, ownerFilter, seesEverything, type Principal } from '../auth/principal.js';
import type { Schedule, ScheduleChange } from '../engine.js';
import { builder, type Context } from './builder.js';
import { guard, requireAdmin, userError } from './errors.js';
import { ExecutionConnectionRef, ExecutionRef, executionPage } from './execution.js';
import { checkJsonValue } from './input.js';
import { checkArgumentBytes } from './invoke.js';

const ScheduleOverlapEnum = builder.enumType('ScheduleOverlap', {
  description: 'ALLOW: fire on time regardless. SKIP: no fire while the previous execution of the schedule has not ended (that instant is passed over).',
  values: ['ALLOW', 'SKIP'] as const,
});

const ScheduleCatchUpEnum = builder.enumType('ScheduleCatchUp', {
  description: 'Instants missed while nothing ran (the service was down): ONCE fires once on the next start, SKIP fires none. Never one fire per missed instant.',
  values: ['ONCE', 'SKIP'] as const,
});

const ScheduleRef = builder.objectRef<Schedule>('Schedule').implement({
  description: 'A procedure started at the instants of a cron expression, each instant exactly once however many service processes run.',
  fields: (t) => ({
    name: t.exposeString('name'),
    procedure: t.exposeString('procedure'),
    arguments: t.field({ type: 'JSON', resolve: (s) => s.arguments }),
    cron: t.exposeString('cron', { description: 'Five fields (minute hour day-of-month month day-of-week), or six with seconds first.' }),
    timezone: t.exposeString('timezone', { description: 'The IANA time zone the cron expression is read in; daylight-saving changes are followed.' }),
    queue: t.exposeString('queue', { nullable: true, description: "null: the procedure's registered queue." }),
    maxAttempts: t.exposeInt('maxAttempts', { nullable: true, description: "null: the procedure's registration." }),
    overlap: t.field({ type: ScheduleOverlapEnum, resolve: (s) => s.overlap }),
    catchUp: t.field({ type: ScheduleCatchUpEnum, resolve: (s) => s.catchUp }),
    paused: t.exposeBoolean('paused'),
    nextRunAt: t.expose('nextRunAt', { type: 'DateTime', nullable: true, description: 'The next instant it fires at; null while paused.' }),
    lastRunAt: t.expose('lastRunAt', { type: 'DateTime', nullable: true, description: 'When it last fired.' }),
    createdAt: t.expose('createdAt', { type: 'DateTime' }),
    createdBy: t.exposeString('createdBy', { nullable: true, description: 'Its fires are submitted by this subject.' }),
    executions: t.connection(
      {
        type: ExecutionRef,
        description: 'The executions it started, newest first (`runAt`: the instant each stands for). A plain caller sees only its own.',
        resolve: (schedule, args, context) => guard(() => executionPage(context, { schedule: schedule.name, submittedBy: ownerFilter(context.principal) }, args)),
      },
      ExecutionConnectionRef,
    ),
  }),
});

const CreateScheduleInput = builder.inputType('CreateScheduleInput', {
  fields: (t) => ({
    name: t.string({ required: true, description: '1–128 characters of A-Z a-z 0-9 _ . : -' }),
    procedure: t.string({ required: true, description: 'A registered procedure; the arguments are checked against its signature as invoke checks them.' }),
    arguments: t.field({ type: 'JSON', required: false, description: 'Keyed by parameter name, as for invoke. @default {}' }),
    cron: t.string({ required: true, description: 'Five fields (minute hour day-of-month month day-of-week), or six with seconds first; at most 200 characters.' }),
    timezone: t.string({ required: false, description: 'An IANA time zone (`Europe/Berlin`). @default "UTC"' }),
    queue: t.string({ required: false, description: "@default the procedure's registered queue" }),
    maxAttempts: t.int({ required: false, description: "1–100. @default the procedure's registration" }),
    overlap: t.field({ type: ScheduleOverlapEnum, required: false, description: '@default ALLOW' }),
    catchUp: t.field({ type: ScheduleCatchUpEnum, required: false, description: '@default ONCE' }),
  }),
});

const UpdateScheduleInput = builder.inputType('UpdateScheduleInput', {
  description: 'What to change; a field left out keeps its value. A new cron or time zone computes the next run again.',
  fields: (t) => ({
    procedure: t.string({ required: false }),
    arguments: t.field({ type: 'JSON', required: false }),
    cron: t.string({ required: false }),
    timezone: t.string({ required: false }),
    queue: t.string({ required: false, description: "null: the procedure's registered queue" }),
    maxAttempts: t.int({ required: false, description: "null: the procedure's registration" }),
    overlap: t.field({ type: ScheduleOverlapEnum, required: false }),
    catchUp: t.field({ type: ScheduleCatchUpEnum, required: false }),
  }),
});

const SchedulePayload = builder.objectRef<{ schedule: Schedule }>('SchedulePayload').implement({
  fields: (t) => ({ schedule: t.field({ type: ScheduleRef, resolve: (p) => p.schedule }) }),
});

function checkedArguments(value: unknown, context: Context): Record<string, unknown> {
  checkJsonValue(value, 'arguments');
  // each firing submits them: the size an invoke may have, or every firing would be refused
  checkArgumentBytes(value, context);
  return value as Record<string, unknown>;
}

/** An admin-only mutation on one schedule, logged. */
function adminAction(what: string, context: Context, fn: () => Promise<Schedule>) {
  return guard(async () => {
    requireAdmin(context.principal, what);
    const schedule = await fn();
    context.logger.info({ schedule: schedule.name, by: context.principal.subject }, what);
    return { schedule };
  });
}

builder.mutationFields((t) => ({
  createSchedule: t.field({
    type: SchedulePayload,
    description: 'Start a procedure at the instants of a cron expression. Admins only. Nothing is created when anything is refused.',
    args: { input: t.arg({ type: CreateScheduleInput, required: true }) },
    resolve: (_root, { input }, context) =>
      adminAction('createSchedule', context, () =>
        context.engine.createSchedule({
          name: input.name,
          procedure: input.procedure,
          arguments: checkedArguments(input.arguments ?? {}, context),
          cron: input.cron,
          timezone: input.timezone,
          queue: input.queue,
          maxAttempts: input.maxAttempts,
          overlap: input.overlap,
          catchUp: input.catchUp,
          createdBy: context.principal.subject,
          callerRoles: callerRoles(context.principal),
        }),
      ),
  }),
  updateSchedule: t.field({
    type: SchedulePayload,
    description: 'Change a schedule, checked as at create. Admins only.',
    args: { name: t.arg.string({ required: true }), input: t.arg({ type: UpdateScheduleInput, required: true }) },
    resolve: (_root, { name, input }, context) => {
      const change: ScheduleChange = { callerRoles: callerRoles(context.principal) };
      if (input.procedure != null) change.procedure = input.procedure;
      if (input.arguments != null) change.arguments = checkedArguments(input.arguments, context);
      if (input.cron != null) change.cron = input.cron;
      if (input.timezone != null) change.timezone = input.timezone;
      // explicit null: back to the procedure's registration
      if (input.queue !== undefined) change.queue = input.queue;
      if (input.maxAttempts !== undefined) change.maxAttempts = input.maxAttempts;
      if (input.overlap != null) change.overlap = input.overlap;
      if (input.catchUp != null) change.catchUp = input.catchUp;
      return adminAction('updateSchedule', context, () => context.engine.updateSchedule(name, change));
    },
  }),
  pauseSchedule: t.field({
    type: SchedulePayload,
    description: 'Stop firing; instants that pass while paused never fire. Admins only.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, context) => adminAction('pauseSchedule', context, () => context.engine.pauseSchedule(name)),
  }),
  resumeSchedule: t.field({
    type: SchedulePayload,
    description: 'Fire again, from the next instant after now. Admins only.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, context) => adminAction('resumeSchedule', context, () => context.engine.resumeSchedule(name)),
  }),
  deleteSchedule: t.field({
    type: SchedulePayload,
    description: 'Remove a schedule; the executions it started stay. Admins only.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, context) => adminAction('deleteSchedule', context, () => context.engine.deleteSchedule(name)),
  }),
}));

/** Schedules hold an admin's arguments: admins and operators read them, as they read everyone's executions. */
function requireOperator(principal: Principal): void {
  if (!seesEverything(principal)) throw userError('FORBIDDEN', 'reading schedules needs the admin or operator role');
}

builder.queryFields((t) => ({
  schedules: t.field({
    type: [ScheduleRef],
    description: 'Every schedule, by name. Admins and operators only.',
    resolve: (_root, _args, { engine, principal }) =>
      guard(async () => {
        requireOperator(principal);
        return engine.listSchedules();
      }),
  }),
  schedule: t.field({
    type: ScheduleRef,
    nullable: true,
    description: 'null for an unknown name. Admins and operators only.',
    args: { name: t.arg.string({ required: true }) },
    resolve: (_root, { name }, { engine, principal }) =>
      guard(async () => {
        requireOperator(principal);
        return engine.getSchedule(name);
      }),
  }),
}));
