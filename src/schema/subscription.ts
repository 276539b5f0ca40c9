import { owns } from '../auth/principal.js';
import { builder } from './builder.js';
import { toGraphQLError } from './errors.js';
import { ExecutionEventRef, ExecutionFilterInput, ExecutionRef, toFilter } from './execution.js';
import { withId } from './ids.js';

builder.subscriptionFields((t) => ({
  executionCompleted: t.field({
    type: ExecutionRef,
    description: 'One event when the execution finishes (also if it finished before you subscribed), then the stream ends.',
    args: { token: t.arg.id({ required: true }) },
    subscribe: (_root, { token }, { hub, principal, wanted, waitsForDatabase }) =>
      // another caller's token answers as an unknown one does
      withId(String(token), 'Execution', (uuid) => hub.completed(uuid, (execution) => owns(principal, execution.submittedBy), wanted, waitsForDatabase)),
    resolve: (execution) => execution,
  }),
  executionProgress: t.field({
    type: ExecutionRef,
    description:
      "Progress reports of a call as it runs (the procedure calls `asyncproc.progress(percent, message)` on PostgreSQL, `asyncexec.usp_AsyncExecProgress @percent, @message` on SQL Server), each event the execution with its `progress`: first the latest report, if any, then each newer one (a few a second at most, the latest winning); the stream ends when the execution ends, its last event the execution as it ended (with its last report, if any). Another caller's token answers as an unknown one does (NOT_FOUND).",
    args: { token: t.arg.id({ required: true }) },
    subscribe: (_root, { token }, { hub, principal, wanted, waitsForDatabase }) =>
      withId(String(token), 'Execution', (uuid) => hub.progress(uuid, (execution) => owns(principal, execution.submittedBy), wanted, waitsForDatabase)),
    resolve: (execution) => execution,
  }),
  executionEvents: t.field({
    type: ExecutionEventRef,
    description:
      'Status changes matching the filter, each event the execution as one commit left it (a state replaced before the service read it may be skipped, never delivered after a newer one). With `after` (an event cursor, or `changeCursor`), first the latest state of everything that changed since, then live: nothing missed, whatever order transactions commit in. A cursor resumes the same filter.',
    args: {
      filter: t.arg({ type: ExecutionFilterInput, required: false }),
      after: t.arg.string({ required: false }),
    },
    subscribe: (_root, { filter, after }, context) => {
      try {
        return context.hub.events(toFilter(filter, context), after ?? null);
      } catch (error) {
        throw toGraphQLError(error);
      }
    },
    resolve: (event) => event,
  }),
}));
