import { EnvelopArmorPlugin } from '@escape.tech/graphql-armor';
import { GraphQLError, type ValidationContext } from 'graphql';
import type { Plugin } from 'graphql-yoga';

export interface OperationLimits {
  /** Deepest selection (introspection's `__schema` excluded). @default 12 */
  maxDepth: number;
  /** Aliased fields per operation (`__typename` excluded). @default 50 */
  maxAliases: number;
  /** Lexical tokens per document, counted while parsing. @default 5000 */
  maxTokens: number;
  /** Directives per operation. @default 20 */
  maxDirectives: number;
  /** graphql-armor's cost (objects 2, scalars 1, ×1.5 per level, × a literal `first`/`last`). @default 50000 */
  maxCost: number;
  /**
   * Brackets (`{`, `[`, `(`) open at once anywhere in the document's text, checked before it is
   * parsed: graphql-js's parser recurses once per level, and a few thousand levels (within the
   * token limit) overflow its stack. Above every legitimate document: selections nest at most
   * maxDepth (introspection a little deeper), values at most MAX_JSON_DEPTH (100). @default 150
   */
  maxNesting: number;
}

export const DEFAULT_OPERATION_LIMITS: OperationLimits = { maxDepth: 12, maxAliases: 50, maxTokens: 5000, maxDirectives: 20, maxCost: 50_000, maxNesting: 150 };

/** The code every refused operation carries; `extensions.limit` names the limit it broke. */
export const QUERY_TOO_COMPLEX = 'QUERY_TOO_COMPLEX';

type Limit = 'depth' | 'aliases' | 'tokens' | 'directives' | 'cost' | 'nesting';

function refusal(limit: Limit, error: GraphQLError): GraphQLError {
  // armor words its refusals as "Syntax Error: …"; the query is well-formed, only too large
  return new GraphQLError(error.message.replace(/^Syntax Error: /, ''), {
    extensions: { code: QUERY_TOO_COMPLEX, limit, http: { status: 400 } },
  });
}

/** Report in the validation result (a 400 with every broken limit), or throw while parsing (tokens: no context yet). */
function onReject(limit: Limit) {
  return {
    propagateOnRejection: false,
    onReject: [
      (context: ValidationContext | null, error: GraphQLError) => {
        if (!context) throw refusal(limit, error);
        context.reportError(refusal(limit, error));
      },
    ],
  };
}

/**
 * The deepest nesting of brackets in a GraphQL document's text, past strings, block strings and
 * comments (one pass, no recursion); stops counting once past `limit`.
 */
export function bracketNesting(text: string, limit = Infinity): number {
  const BLOCK = '"'.repeat(3);
  let depth = 0;
  let deepest = 0;
  for (let i = 0; i < text.length && deepest <= limit; i++) {
    const c = text[i];
    if (c === '#') {
      while (i < text.length && text[i] !== '\n' && text[i] !== '\r') i++;
    } else if (c === '"') {
      if (text.startsWith(BLOCK, i)) {
        // a block string ends at the next three quotes not escaped by a backslash
        for (i += 3; i < text.length && !text.startsWith(BLOCK, i); i++) if (text[i] === '\\' && text.startsWith(BLOCK, i + 1)) i += 3;
        i += 2;
      } else {
        // a string ends at its closing quote (or, malformed, at the line's end)
        for (i++; i < text.length && text[i] !== '"' && text[i] !== '\n'; i++) if (text[i] === '\\') i++;
      }
    } else if (c === '{' || c === '[' || c === '(') {
      if (++depth > deepest) deepest = depth;
    } else if (c === '}' || c === ']' || c === ')') {
      depth--;
    }
  }
  return deepest;
}

/** Refuses, before the parser sees it, a document whose brackets nest deeper than `maxNesting`. */
function useNestingLimit(maxNesting: number): Plugin {
  return {
    onParse({ params }) {
      const text = typeof params.source === 'string' ? params.source : params.source.body;
      if (bracketNesting(text, maxNesting) > maxNesting) {
        throw refusal('nesting', new GraphQLError(`the document nests brackets deeper than ${maxNesting} levels`));
      }
    },
  };
}

/**
 * Depth, alias, token, directive, cost and nesting limits on every operation (HTTP, SSE and graphql-ws
 * alike: they all parse and validate through yoga's envelop), refused before anything executes.
 */
export function useOperationLimits(limits: OperationLimits): Plugin {
  return {
    onPluginInit({ addPlugin }) {
      addPlugin(useNestingLimit(limits.maxNesting));
      addPlugin(armor(limits));
    },
  };
}

function armor(limits: OperationLimits): Plugin {
  return EnvelopArmorPlugin({
    maxTokens: { n: limits.maxTokens, ...onReject('tokens') },
    maxDepth: { n: limits.maxDepth, ...onReject('depth') },
    maxAliases: { n: limits.maxAliases, ...onReject('aliases') },
    maxDirectives: { n: limits.maxDirectives, ...onReject('directives') },
    costLimit: { maxCost: limits.maxCost, ...onReject('cost') },
    // field suggestions are useSchemaPrivacy's (they depend on the configuration)
    blockFieldSuggestion: { enabled: false },
  }) as Plugin;
}
