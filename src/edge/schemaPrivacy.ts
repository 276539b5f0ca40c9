import { GraphQLError, NoSchemaIntrospectionCustomRule } from 'graphql';
import type { Plugin } from 'graphql-yoga';

export interface SchemaPrivacy {
  /** `__schema` and `__type` queries. */
  introspection: boolean;
  /** "Did you mean …?" in error messages, which name fields, arguments, types and enum values. */
  suggestions: boolean;
}

/** Drop "Did you mean …?" from an error's message, in place (a new error would be logged as masked). */
export function hideSuggestions<E>(error: E): E {
  if (error instanceof GraphQLError) error.message = error.message.replace(/ *Did you mean [^?]*\?/g, '').trim();
  return error;
}

/**
 * Introspection refused by validation when off; suggestions cut from validation errors here and from
 * execution errors (variables that do not fit their type) by the server's maskError.
 */
export function useSchemaPrivacy({ introspection, suggestions }: SchemaPrivacy): Plugin {
  return {
    onValidate({ addValidationRule }) {
      if (!introspection) addValidationRule(NoSchemaIntrospectionCustomRule);
      if (suggestions) return;
      return ({ valid, result, setResult }) => {
        if (!valid) setResult(result.map(hideSuggestions));
      };
    },
  };
}
