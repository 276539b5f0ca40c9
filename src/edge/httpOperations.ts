import {
  getNamedType,
  GraphQLError,
  isCompositeType,
  Kind,
  type DocumentNode,
  type FragmentDefinitionNode,
  type GraphQLCompositeType,
  type GraphQLSchema,
  type SelectionSetNode,
  type ValueNode,
} from 'graphql';
import type { Plugin } from 'graphql-yoga';
import type { Principal } from '../auth/principal.js';
import { QUERY_TOO_COMPLEX } from './operationLimits.js';

/** A list field's page when `first`/`last` is left out (the resolvers' default). */
const DEFAULT_PAGE = 20;

const badRequest = (message: string) =>
  new Response(JSON.stringify({ errors: [{ message, extensions: { code: 'BAD_REQUEST' } }] }), {
    status: 400,
    headers: { 'content-type': 'application/json; charset=utf-8' },
  });

/**
 * A GET whose `variables` or `extensions` is not JSON gets 400 BAD_REQUEST, as the same
 * mistake in a POST body does: yoga's GET parser threw the JSON.parse error, which took the
 * unexpected-error path (500, a stack in the log), before any credential was checked.
 */
export function useGetParameterCheck(): Plugin {
  return {
    onRequest({ request, url, endResponse }) {
      if (request.method !== 'GET') return;
      for (const name of ['variables', 'extensions']) {
        const value = url.searchParams.get(name);
        if (value === null || value === '') continue;
        try {
          JSON.parse(value);
        } catch {
          endResponse(badRequest(`the ${name} parameter is not valid JSON`));
          return;
        }
      }
    },
  };
}

/**
 * The nodes an operation may ask for: each list field that pages (`first`/`last`) counts its page
 * times the pages of the lists around it, with the page as the request gives it — a literal, a
 * variable's value, or the default when left out. graphql-armor's cost (useOperationLimits) is
 * counted before the variables are known and multiplies by a literal `first`/`last` only: the
 * same four-level nesting of executions and batches it refused with `first: 20` ran with
 * `first: $n` (n = 30) for 39 s and 750 MB.
 */
export function estimateNodes(schema: GraphQLSchema, document: DocumentNode, operationName: string | null | undefined, variables: Record<string, unknown> | null | undefined): number {
  const fragments = new Map<string, FragmentDefinitionNode>();
  const operations = [];
  for (const definition of document.definitions) {
    if (definition.kind === Kind.FRAGMENT_DEFINITION) fragments.set(definition.name.value, definition);
    else if (definition.kind === Kind.OPERATION_DEFINITION) operations.push(definition);
  }
  const operation = operationName ? operations.find((o) => o.name?.value === operationName) : operations[0];
  if (!operation) return 0;
  const root = schema.getRootType(operation.operation);
  if (!root) return 0;
  /** The page a `first`/`last` argument asks for: a literal, a variable's value; undefined when not given. */
  const given = (value: ValueNode | undefined): number | undefined => {
    const n = value?.kind === Kind.INT ? Number(value.value) : value?.kind === Kind.VARIABLE ? variables?.[value.name.value] : undefined;
    return typeof n === 'number' && Number.isFinite(n) ? Math.max(n, 0) : undefined;
  };
  const walk = (type: GraphQLCompositeType, selections: SelectionSetNode, around: number, seen: Set<string>): number => {
    let nodes = 0;
    for (const selection of selections.selections) {
      if (selection.kind === Kind.FIELD) {
        if (!('getFields' in type)) continue;
        const field = type.getFields()[selection.name.value];
        if (!field) continue;
        const paging = field.args.filter((a) => a.name === 'first' || a.name === 'last');
        let here = around;
        if (paging.length) {
          const asked = paging.map((a) => given(selection.arguments?.find((arg) => arg.name.value === a.name)?.value)).filter((n) => n !== undefined);
          // both given: the larger; neither: the field's default (the schema's, or the resolvers' DEFAULT_PAGE)
          const fallback = paging.map((a) => a.defaultValue).find((d): d is number => typeof d === 'number') ?? DEFAULT_PAGE;
          here = around * (asked.length ? Math.max(...asked) : fallback);
          nodes += here;
        }
        const inner = getNamedType(field.type);
        if (selection.selectionSet && isCompositeType(inner)) nodes += walk(inner, selection.selectionSet, here, seen);
      } else if (selection.kind === Kind.INLINE_FRAGMENT) {
        const condition = selection.typeCondition ? schema.getType(selection.typeCondition.name.value) : type;
        nodes += walk(condition && isCompositeType(condition) ? condition : type, selection.selectionSet, around, seen);
      } else {
        const fragment = fragments.get(selection.name.value);
        // validation refused cycles; a spread seen on this path already adds nothing new
        if (!fragment || seen.has(fragment.name.value)) continue;
        const condition = schema.getType(fragment.typeCondition.name.value);
        nodes += walk(condition && isCompositeType(condition) ? condition : type, fragment.selectionSet, around, new Set([...seen, fragment.name.value]));
      }
      if (nodes > Number.MAX_SAFE_INTEGER) return nodes;
    }
    return nodes;
  };
  return walk(root, operation.selectionSet, 1, new Set());
}

function tooManyNodes(nodes: number, maxNodes: number): GraphQLError {
  return new GraphQLError(`the operation asks for up to ${Math.round(nodes)} list items (pages times the pages around them), more than ${maxNodes}: ask for smaller pages`, {
    extensions: { code: QUERY_TOO_COMPLEX, limit: 'nodes', http: { status: 400 } },
  });
}

export interface HttpOperationOptions {
  /** List items an operation may ask for (estimateNodes). @default 10000 */
  maxNodes?: number;
  /** Open SSE subscriptions a caller may hold at once (authentication required only: anonymous callers are one). @default 100 */
  maxSseStreamsPerCaller?: number;
  /** Whether callers are told apart (authentication required). */
  countCallers: boolean;
}

/**
 * Whether yoga will answer a subscription with an SSE stream: one of the Accept header's media
 * types is exactly `text/event-stream`, in UTF-8 (no charset said, or utf-8), read as yoga reads
 * it (blanks dropped, case ignored). `text/event-stream; charset=latin1` or `x-text/event-stream`
 * passed a plain search for the words: the subscription was made, then yoga answered 406 and
 * never ended it (it stayed in the hub, and held a slot of its caller's SSE limit, for good).
 */
export function acceptsEventStream(accept: string | null): boolean {
  return (accept ?? '')
    .replace(/\s/g, '')
    .toLowerCase()
    .split(',')
    .some((range) => {
      const [type, ...parameters] = range.split(';');
      const charset = parameters.find((parameter) => parameter.includes('charset='));
      return type === 'text/event-stream' && (charset === undefined || charset === 'charset=utf-8');
    });
}

/**
 * What an operation asks for, checked with its variables before it runs (estimateNodes), on every
 * transport; and subscriptions over HTTP: refused unless the request accepts a stream (SSE), so
 * nothing subscribes for a response yoga then refuses with 406 (the subscription stayed in the
 * completion hub for ever), and counted per caller (graphql-ws has its own limits per socket).
 */
export function useHttpOperations(options: HttpOperationOptions): Plugin {
  const maxNodes = options.maxNodes ?? 10_000;
  const maxStreams = options.maxSseStreamsPerCaller ?? 100;
  const open = new Map<string, number>();
  const checkNodes = (args: { schema: GraphQLSchema; document: DocumentNode; operationName?: string | null; variableValues?: Record<string, unknown> | null }) => {
    const nodes = estimateNodes(args.schema, args.document, args.operationName, args.variableValues);
    return nodes > maxNodes ? tooManyNodes(nodes, maxNodes) : null;
  };
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const refused = checkNodes(args);
      if (refused) setResultAndStopExecution({ errors: [refused] });
    },
    onSubscribe({ args, setResultAndStopExecution }) {
      const refused = checkNodes(args);
      if (refused) {
        setResultAndStopExecution({ errors: [refused] });
        return;
      }
      const context = args.contextValue as { request?: Request; principal?: Principal };
      const request = context.request;
      // graphql-ws: the socket's own limits (connections per caller, subscriptions per socket)
      if (!request) return;
      if (!acceptsEventStream(request.headers.get('accept'))) {
        setResultAndStopExecution({
          errors: [
            new GraphQLError('a subscription over HTTP needs `Accept: text/event-stream` (SSE); or subscribe over graphql-ws', {
              extensions: { code: 'BAD_REQUEST', http: { status: 406 } },
            }),
          ],
        });
        return;
      }
      // this caller's place in its SSE limit (with sign-in on), given back once, however the stream ends
      let release = () => {};
      if (options.countCallers) {
        const caller = context.principal?.subject ?? '';
        const held = open.get(caller) ?? 0;
        if (held >= maxStreams) {
          setResultAndStopExecution({
            errors: [new GraphQLError(`at most ${maxStreams} open subscriptions over SSE per caller`, { extensions: { code: 'TOO_MANY_SUBSCRIPTIONS', http: { status: 429 } } })],
          });
          return;
        }
        open.set(caller, held + 1);
        let released = false;
        release = () => {
          if (released) return;
          released = true;
          const left = (open.get(caller) ?? 1) - 1;
          if (left > 0) open.set(caller, left);
          else open.delete(caller);
        };
      }
      // A client that leaves (a tab navigating away) while its stream is being made: the stream
      // came after yoga stopped listening, nothing read it, nothing ended it, and it held its place
      // in the hub (and in this caller's SSE limit) for good. Ended here when the request ends first.
      const { signal } = request;
      return {
        onSubscribeResult({ result }) {
          // an error instead of a stream: nothing stays open
          if (!(Symbol.asyncIterator in Object(result))) {
            release();
            return;
          }
          const stream = result as AsyncGenerator<unknown>;
          const left = () => {
            void stream.return?.(undefined);
            release();
          };
          if (signal.aborted) left();
          else signal.addEventListener('abort', left, { once: true });
          return {
            onEnd: () => {
              signal.removeEventListener('abort', left);
              release();
            },
          };
        },
        onSubscribeError: () => release(),
      };
    },
  };
}

/**
 * `extensions.originalError` of the request parser's errors cut to 120 characters: yoga puts
 * JSON.parse's own error there for a body that is not JSON, and its message quotes the body back
 * (60 KB sent, 60 KB answered). The error's own message and code say what was wrong.
 */
export function useShortParserErrors(): Plugin {
  return {
    onRequestParse({ requestParser, setRequestParser }) {
      if (!requestParser) return;
      setRequestParser(async (request) => {
        try {
          return await requestParser(request);
        } catch (error) {
          // cut, not removed: yoga answers 400 rather than 200 by its presence
          const original = (error as { extensions?: { originalError?: { message?: unknown } } })?.extensions?.originalError;
          if (original && typeof original.message === 'string' && original.message.length > 120) original.message = `${original.message.slice(0, 120)}…`;
          throw error;
        }
      });
    },
  };
}
