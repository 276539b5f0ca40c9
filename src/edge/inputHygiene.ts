import { GraphQLError, Kind, visit, type DocumentNode, type ExecutionResult } from 'graphql';
import { isAsyncIterable, type Plugin } from 'graphql-yoga';
import { userError } from '../schema/errors.js';
import { MAX_JSON_DEPTH, checkJsonValue, checkText } from '../schema/input.js';
import { isExactNumber } from '../engines/exactJson.js';

/** Every string literal of the document, and the nesting of its object and list literals. */
function checkDocument(document: DocumentNode): void {
  let depth = 0;
  visit(document, {
    StringValue: (node) => void checkText(node.value, 'a string in the query'),
    // a literal beyond a double (1e400, or 400 digits) would be Infinity, stored as null without a word;
    // one a double holds only rounded (9007199254740993) would reach the procedure changed
    FloatValue: (node) => void exact(node.value),
    IntValue: (node) => void exact(node.value),
    ObjectValue: { enter: () => void nest(++depth), leave: () => void depth-- },
    ListValue: { enter: () => void nest(++depth), leave: () => void depth-- },
  });
}

function exact(literal: string): void {
  const shown = `${literal.slice(0, 40)}${literal.length > 40 ? '…' : ''}`;
  if (!Number.isFinite(Number(literal))) throw userError('BAD_USER_INPUT', `the number ${shown} in the query is beyond what a double can hold`);
  if (!isExactNumber(literal)) {
    throw userError('BAD_USER_INPUT', `the number ${shown} in the query would be rounded (a double holds it only approximately): send it as a string, "${shown}"`);
  }
}

function nest(depth: number): void {
  if (depth > MAX_JSON_DEPTH) throw userError('BAD_USER_INPUT', `a value in the query is nested deeper than ${MAX_JSON_DEPTH} levels`);
}

/**
 * graphql-js refuses a variable that does not coerce to its type (`Variable "$n" got invalid value
 * …`, `… of required type "ID!" was not provided`) before executing, with no code: such errors
 * get BAD_USER_INPUT, as every other refusal of input has a code.
 */
function withVariableCodes(result: ExecutionResult): ExecutionResult | null {
  if (!result.errors?.some(isVariableError)) return null;
  return {
    ...result,
    errors: result.errors.map((error) =>
      isVariableError(error)
        ? new GraphQLError(error.message, { nodes: error.nodes, source: error.source, positions: error.positions, path: error.path, originalError: error.originalError, extensions: { ...error.extensions, code: 'BAD_USER_INPUT' } })
        : error,
    ),
  };
}

const isVariableError = (error: GraphQLError) => error.path === undefined && !error.extensions?.code && error.message.startsWith('Variable "$');

function refusal(error: unknown): { errors: GraphQLError[] } {
  if (error instanceof GraphQLError) return { errors: [error] };
  throw error;
}

/**
 * Odd input is bad input, for every argument of every operation on every transport, checked once before it
 * executes: no string (variable or literal, key or value, at any depth) may hold a NUL or a lone surrogate,
 * no number may be beyond a double (Infinity), no number literal may be one a double holds only rounded, and no value may nest deeper than MAX_JSON_DEPTH. A refused operation gets BAD_USER_INPUT and runs nothing.
 * Checks that need a field's meaning (runAt's range, a page cursor's) stay with the field, in schema/input.ts.
 */
export function useInputHygiene(): Plugin {
  // yoga's parser cache hands the same document object to every request with the same text: walk it once
  const passed = new WeakSet<DocumentNode>();
  const check = (document: DocumentNode, variables: unknown) => {
    checkJsonValue(variables ?? {}, 'variables');
    if (passed.has(document)) return;
    checkDocument(document);
    passed.add(document);
  };
  /** Checks the operation; null when it was refused (its result set), else the hook that codes variable errors. */
  const checked = (args: { document: DocumentNode; variableValues?: unknown }, refuse: (result: ExecutionResult) => void) => {
    try {
      check(args.document, args.variableValues);
    } catch (error) {
      refuse(refusal(error));
      return null;
    }
    return ({ result, setResult }: { result: ExecutionResult | AsyncIterable<unknown>; setResult: (result: ExecutionResult) => void }) => {
      if (isAsyncIterable(result)) return;
      const coded = withVariableCodes(result);
      if (coded) setResult(coded);
    };
  };
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const done = checked(args, setResultAndStopExecution);
      return done ? { onExecuteDone: done } : undefined;
    },
    onSubscribe({ args, setResultAndStopExecution }) {
      const done = checked(args, setResultAndStopExecution);
      return done ? { onSubscribeResult: done } : undefined;
    },
  };
}
