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
}

export const DEFAULT_OPERATION_LIMITS: OperationLimits = { maxDepth: 12, maxAliases: 50, maxTokens: 5000, maxDirectives: 20, maxCost: 50_000 };

/** The code every refused operation carries; `extensions.limit` names the limit it broke. */
export const QUERY_TOO_COMPLEX = 'QUERY_TOO_COMPLEX';

type Limit = 'depth' | 'aliases' | 'tokens' | 'directives' | 'cost';

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
 * Depth, alias, token, directive and cost limits on every operation (HTTP, SSE and graphql-ws alike: they all
 * parse and validate through yoga's envelop), refused before anything executes.
 */
export function useOperationLimits(limits: OperationLimits): Plugin {
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
