import {
  getDirectiveValues,
  getOperationAST,
  getVariableValues,
  GraphQLIncludeDirective,
  GraphQLSkipDirective,
  Kind,
  type DocumentNode,
  type FragmentDefinitionNode,
  type GraphQLSchema,
  type OperationDefinitionNode,
  type SelectionSetNode,
} from 'graphql';
import type { Plugin } from 'graphql-yoga';
import { userError } from '../schema/errors.js';

/**
 * Root mutation fields whose result cannot be asked for again: a submission's tokens, a new API
 * key's secret. Each commits in a transaction of its own, and their payloads are non-null: in an
 * operation with another root field that then fails, the response's `data` is null and what the
 * committed one returned is lost (its calls run, nobody holds their tokens).
 */
export const UNREPEATABLE_MUTATIONS: ReadonlySet<string> = new Set(['invoke', 'invokeMany', 'submitBatch', 'createApiKey']);

/**
 * The root fields the operation will execute, by field name, once per alias, @skip and @include
 * applied with the variables as execution reads them: a variable not sent takes its declared
 * default (read raw, `@include(if: $i)` with `$i: Boolean! = true` not sent was refused as "not
 * provided a runtime value"). Null when the variables do not coerce: execution refuses them itself.
 */
export function rootFields(schema: GraphQLSchema, document: DocumentNode, operation: OperationDefinitionNode, raw: Record<string, unknown> | null | undefined): string[] | null {
  const { coerced } = getVariableValues(schema, operation.variableDefinitions ?? [], raw ?? {}, { maxErrors: 1 });
  if (!coerced) return null;
  const fragments = new Map<string, FragmentDefinitionNode>();
  for (const definition of document.definitions) if (definition.kind === Kind.FRAGMENT_DEFINITION) fragments.set(definition.name.value, definition);
  const names: string[] = [];
  const visit = (set: SelectionSetNode, seen: ReadonlySet<string>) => {
    for (const selection of set.selections) {
      if (getDirectiveValues(GraphQLSkipDirective, selection, coerced)?.if === true) continue;
      if (getDirectiveValues(GraphQLIncludeDirective, selection, coerced)?.if === false) continue;
      if (selection.kind === Kind.FIELD) names.push(selection.name.value);
      else if (selection.kind === Kind.INLINE_FRAGMENT) visit(selection.selectionSet, seen);
      else {
        const fragment = fragments.get(selection.name.value);
        // validation refuses unknown and cyclic fragments before execution; guarded all the same
        if (fragment && !seen.has(fragment.name.value)) visit(fragment.selectionSet, new Set([...seen, fragment.name.value]));
      }
    }
  };
  visit(operation.selectionSet, new Set());
  return names;
}

/**
 * A mutation operation with a submitting field (UNREPEATABLE_MUTATIONS) has no other root field:
 * refused with BAD_USER_INPUT before anything runs, on every transport. So a client never loses the
 * tokens of calls that were committed, and ASYNCPROC_MAX_CALLS bounds the calls of one operation
 * (aliases of invokeMany no longer multiply it). Other mutations may still share an operation.
 */
export function useOneSubmissionPerOperation(): Plugin {
  return {
    onExecute({ args, setResultAndStopExecution }) {
      const operation = getOperationAST(args.document, args.operationName ?? undefined);
      if (operation?.operation !== 'mutation') return;
      const [only, ...others] = operation.selectionSet.selections;
      // the usual case, one field and no fragment: nothing to walk
      if (!others.length && only?.kind === Kind.FIELD) return;
      const fields = rootFields(args.schema, args.document, operation, args.variableValues as Record<string, unknown> | undefined);
      if (!fields) return;
      const submitting = fields.filter((name) => UNREPEATABLE_MUTATIONS.has(name));
      if (fields.length > 1 && submitting.length) {
        setResultAndStopExecution({
          errors: [
            userError(
              'BAD_USER_INPUT',
              `${submitting.join(', ')} must be the only field of its mutation operation (this one has ${fields.length}): each field commits alone, and a failure of another would hide what it returned. Send one per operation; invokeMany submits many calls in one transaction`,
            ),
          ],
        });
      }
    },
  };
}
