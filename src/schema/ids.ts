import { decodeGlobalID } from '@pothos/plugin-relay';
import { EngineError, isUuid } from '../engine.js';
import { toGraphQLError, userError } from './errors.js';

/** The types with a global `id` (base64 of `Execution:<token>`, `Batch:<batch id>`): each is found by the UUID inside it. */
export type NodeType = 'Execution' | 'Batch';

const NAMES: Record<NodeType, string> = { Execution: 'token', Batch: 'batch id' };

/** The type and UUID a global id names; null for anything that is not one of ours. */
export function decodeNodeId(globalId: string): { typename: NodeType; uuid: string } | null {
  let decoded: { typename: string; id: string };
  try {
    decoded = decodeGlobalID(globalId);
  } catch {
    return null;
  }
  if (!(decoded.typename in NAMES) || !isUuid(decoded.id)) return null;
  return { typename: decoded.typename as NodeType, uuid: decoded.id.toLowerCase() };
}

/**
 * A token or batch id as a client sends it — the UUID, or the object's global `id` (what a
 * normalised cache holds) — as the UUID; anything else is BAD_USER_INPUT.
 */
export function checkId(given: string, typename: NodeType): string {
  if (isUuid(given)) return given.toLowerCase();
  const decoded = decodeNodeId(given);
  if (decoded?.typename !== typename) {
    throw userError('BAD_USER_INPUT', `malformed ${NAMES[typename]} "${given.slice(0, 100)}": expected a UUID or a ${typename} id`);
  }
  return decoded.uuid;
}

/**
 * A resolver body on the UUID a token or batch id argument names; expected failures become coded
 * GraphQL errors quoting the id as the client sent it (a global id stays opaque).
 */
export async function withId<T>(given: string, typename: NodeType, fn: (uuid: string) => Promise<T>): Promise<T> {
  const uuid = checkId(given, typename);
  try {
    return await fn(uuid);
  } catch (error) {
    const quoted = error instanceof EngineError && uuid !== given ? new EngineError(error.code, error.message.replaceAll(uuid, given)) : error;
    throw toGraphQLError(quoted);
  }
}
