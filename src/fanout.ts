/**
 * Fan-out: one event, many subscribers, without paying per subscriber for what they share. An
 * event's selection set is executed once per distinct (document, operation, variables, viewer)
 * and the result object is handed to every subscriber that shares them; the hub hands
 * subscribers that are in step the same event object, so sharing needs no copy.
 */
import { createSourceEventStream, execute, print, type DocumentNode, type ExecutionArgs, type ExecutionResult } from 'graphql';
import type { Plugin } from 'graphql-yoga';
import { callerRoles, isAdmin, ownerFilter, type Principal } from './auth/principal.js';

/** What a subscriber may see of an event: subscribers with equal viewers may share one result. */
function viewerOf(context: unknown): string | null {
  const principal = (context as { principal?: Principal } | null)?.principal;
  if (!principal) return null;
  // every input a resolver may decide by: who may see everything, whose work, which roles
  return JSON.stringify([isAdmin(principal), ownerFilter(principal), [...(callerRoles(principal) ?? [])].sort()]);
}

function isAsyncIterable(value: unknown): value is AsyncIterable<unknown> {
  return typeof value === 'object' && value !== null && Symbol.asyncIterator in value;
}

/** `source` with each value mapped; `return` reaches the source at once, also while a `next` waits. */
function mapEvents<T, U>(source: AsyncIterable<T>, map: (value: T) => U | Promise<U>): AsyncGenerator<U> {
  const iterator = source[Symbol.asyncIterator]();
  const close = async () => (await iterator.return?.()) ?? { done: true as const, value: undefined };
  const mapped: AsyncGenerator<U> = {
    [Symbol.asyncIterator]: () => mapped,
    async next() {
      const step = await iterator.next();
      if (step.done) return { done: true, value: undefined };
      try {
        return { done: false, value: await map(step.value) };
      } catch (error) {
        await close();
        throw error;
      }
    },
    return: async () => (await close(), { done: true, value: undefined }),
    throw: async (error) => {
      await close();
      throw error;
    },
  };
  return mapped;
}

/**
 * Subscriptions execute each event once per (document, operation, variables, viewer): a
 * subscriber whose event object another subscriber of the same shape already executed gets that
 * result. Results are kept with the event object (a WeakMap), so they live as long as it does.
 */
export function useSharedEventExecution(): Plugin {
  const printed = new WeakMap<DocumentNode, string>();
  const results = new WeakMap<object, Map<string, Promise<ExecutionResult> | ExecutionResult>>();
  const shapeOf = (args: ExecutionArgs): string | null => {
    const viewer = viewerOf(args.contextValue);
    if (viewer === null) return null;
    let text = printed.get(args.document);
    if (text === undefined) printed.set(args.document, (text = print(args.document)));
    return JSON.stringify([viewer, args.operationName ?? null, args.variableValues ?? null, text]);
  };
  return {
    onSubscribe({ setSubscribeFn }) {
      setSubscribeFn(async (args: ExecutionArgs) => {
        const source = await createSourceEventStream(args);
        if (!isAsyncIterable(source)) return source;
        const shape = shapeOf(args);
        return mapEvents(source, (event) => {
          const run = () => execute({ ...args, rootValue: event });
          if (shape === null || typeof event !== 'object' || event === null) return run();
          let byShape = results.get(event);
          if (!byShape) results.set(event, (byShape = new Map()));
          let result = byShape.get(shape);
          if (result === undefined) byShape.set(shape, (result = run()));
          return result;
        });
      });
    },
  };
}
