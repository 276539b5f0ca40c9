import { EngineError, isUuid } from '../engine.js';
import { toGraphQLError, userError } from './errors.js';

/** The types with a global `id` (`Execution:<token>`, `Batch:<batch id>`): each is found by the UUID inside it. */
export type NodeType = 'Execution' | 'Batch';

const NAMES: Record<NodeType, string> = { Execution: 'token', Batch: 'batch id' };

/** A global id: base64url (no `/`, `+` or `=`), so an app can put it in a URL path or a hash route as it is. */
export function encodeNodeId(typename: string, id: string | number | bigint): string {
  return Buffer.from(`${typename}:${id}`).toString('base64url');
}

/** The type and UUID a global id names; null for anything that is not one of ours. */
export function decodeNodeId(globalId: string): { typename: NodeType; uuid: string } | null {
  const [typename, uuid, ...rest] = Buffer.from(globalId, 'base64url').toString().split(':');
  if (rest.length || !Object.hasOwn(NAMES, typename) || !isUuid(uuid ?? '')) return null;
  return { typename: typename as NodeType, uuid: uuid.toLowerCase() };
}

/**
 * A token or batch id as a client sends it — the UUID, or the object's global `id` (what a
 * normalised cache holds) — as the UUID; anything else is BAD_USER_INPUT.
 */
export function checkId(given: string, typename: NodeType): string {
  if (isUuid(given)) return given.toLowerCase();
  const decoded = decodeNodeId(given);
  if (decoded?.typename !== typename) {
    throw userError('BAD_USER_INPUT', `malformed ${NAMES[typename]} "${given.slice(0, 100)}": expected a UUID or ${typename === 'Execution' ? 'an' : 'a'} ${typename} id`);
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
