import { brandWithType } from '@pothos/core';
import { BatchRef, visibleBatch } from './batch.js';
import { builder, type Context } from './builder.js';
import { userError } from './errors.js';
import { ExecutionRef, visibleExecution } from './execution.js';
import { decodeNodeId } from './ids.js';

/** The object a global id names, if the caller may see it; null for another caller's, an unknown or a malformed id. */
async function loadNode(globalId: string, context: Context): Promise<object | null> {
  const decoded = decodeNodeId(globalId);
  if (!decoded) return null;
  const [found, ref] =
    decoded.typename === 'Execution'
      ? [await visibleExecution(context, decoded.uuid), ExecutionRef]
      : [await visibleBatch(context.engine, context.principal, decoded.uuid), BatchRef];
  // the Node interface resolves its type from the brand
  if (found) brandWithType(found, ref);
  return found;
}

/** ids one `nodes` query may ask for. */
const MAX_NODES = 100;

builder.queryFields((t) => ({
  node: t.field({
    type: builder.nodeInterfaceRef(),
    nullable: true,
    description:
      "The Execution or Batch with this global `id`. null for an unknown or malformed id and for another caller's object (plain callers see only their own).",
    args: { id: t.arg.id({ required: true }) },
    resolve: (_root, { id }, context) => loadNode(String(id), context),
  }),
  nodes: t.field({
    type: [builder.nodeInterfaceRef()],
    nullable: { list: false, items: true },
    description: `node(id) for each id, in order (at most ${MAX_NODES}).`,
    args: { ids: t.arg.idList({ required: true }) },
    resolve: (_root, { ids }, context) => {
      if (ids.length > MAX_NODES) throw userError('BAD_USER_INPUT', `nodes takes at most ${MAX_NODES} ids`);
      return Promise.all(ids.map((id) => loadNode(String(id), context)));
    },
  }),
}));
