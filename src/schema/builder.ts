import SchemaBuilder from '@pothos/core';
import RelayPlugin from '@pothos/plugin-relay';
import { DateTimeResolver, JSONResolver } from 'graphql-scalars';
import { GraphQLError, GraphQLScalarType, Kind, type ValueNode } from 'graphql';
import type { Principal } from '../auth/principal.js';
import type { CompletionHub } from '../completionHub.js';
import type { Engine } from '../engine.js';
import type { Logger } from '../logger.js';
import { encodeNodeId } from './ids.js';
import type { Loaders } from './loaders.js';

export interface Limits {
  /** Calls one mutation may submit. @default 1000 */
  maxCalls: number;
  /** Serialized arguments of one call, in bytes. @default 65536 */
  maxArgumentBytes: number;
}

export interface Context {
  engine: Engine;
  hub: CompletionHub;
  limits: Limits;
  /** Who is asking, verified (or, with auth off, as the caller says); its subject is recorded as `submittedBy`. */
  principal: Principal;
  /** Per-request batching of the reads resolvers make per row. */
  loaders: Loaders;
  /** Lines about one execution carry its token and procedure (grep a token for its story). */
  logger: Logger;
  /**
   * Whether the caller still waits for this operation (false once a subscriber completed it or
   * went away): a subscription that waits for the database stops waiting then.
   */
  wanted: () => boolean;
  /**
   * Whether a subscription waits for a database out of reach (graphql-ws: its socket stays up,
   * with its keep-alive) or is answered 503 at once (SSE: its response starts only once it has subscribed).
   */
  waitsForDatabase: boolean;
  /** After a revocation here: API keys are looked up afresh at their next check (open sockets, running streams). */
  credentialsChanged?: () => void;
}

export const builder = new SchemaBuilder<{
  Context: Context;
  Scalars: {
    JSON: { Input: unknown; Output: unknown };
    DateTime: { Input: Date; Output: Date };
  };
  DefaultFieldNullability: false;
}>({
  plugins: [RelayPlugin],
  defaultFieldNullability: false,
  // `nodes` beside `edges`: a page's rows without the edge wrapper; node(id) and nodes(ids) are our own (node.ts):
  // a malformed id answers null there, as an unknown one does, where the plugin's would fail the query
  relay: {
    nodeQueryOptions: false,
    nodesQueryOptions: false,
    nodesOnConnection: {},
    encodeGlobalID: encodeNodeId,
    nodeTypeOptions: { description: 'An object with a global `id`: `node(id)` reads it again, and client caches (Relay, Apollo, urql) key it by `id`.' },
  },
});

/** Whether a literal holds a bare word (an enum literal) anywhere: no JSON value is one. */
function holdsEnum(ast: ValueNode): boolean {
  if (ast.kind === Kind.ENUM) return true;
  if (ast.kind === Kind.LIST) return ast.values.some(holdsEnum);
  if (ast.kind === Kind.OBJECT) return ast.fields.some((field) => holdsEnum(field.value));
  return false;
}

/**
 * graphql-scalars' JSON, refusing a literal with a bare word in it (`arguments: { tag: FOO }`):
 * it dropped the key without a word, and the call was refused for a missing argument instead.
 */
const JSONScalar = new GraphQLScalarType({
  ...JSONResolver.toConfig(),
  parseLiteral(ast, variables) {
    if (holdsEnum(ast)) throw new GraphQLError('a bare word is not a JSON value: quote it ("FOO")');
    return JSONResolver.parseLiteral(ast, variables);
  },
});

builder.addScalarType('JSON', JSONScalar);
builder.addScalarType('DateTime', DateTimeResolver);

builder.queryType({ description: 'Read executions, procedures and queues.' });
builder.mutationType({ description: 'Submit calls. Each mutation is one transaction: all of its calls or none.' });
builder.subscriptionType({ description: 'Completion events, over graphql-ws (WebSocket) or SSE.' });
