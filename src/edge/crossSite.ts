import { useCSRFPrevention } from '@graphql-yoga/plugin-csrf-prevention';
import { createGraphQLError, type Plugin, type YogaServerOptions } from 'graphql-yoga';

/**
 * Headers a browser sends cross-site only after a CORS preflight; any one of them (or a JSON content type)
 * lets a request through. `authorization` is here because every authenticated call carries it.
 */
export const CSRF_HEADERS = ['x-asyncproc-csrf', 'x-graphql-yoga-csrf', 'authorization'];

/**
 * Yoga's CSRF prevention: a request with no content type or a form/text one (what an HTML form on another
 * site can send without a preflight) is refused with 403 `CSRF_HEADER_REQUIRED` before it is parsed, unless it
 * carries one of CSRF_HEADERS. JSON POSTs (our clients, GraphiQL, graphql-sse) pass.
 */
export function useCrossSiteRequestPrevention(): Plugin {
  const { onRequestParse } = useCSRFPrevention({ requestHeaders: CSRF_HEADERS }) as Required<Pick<Plugin, 'onRequestParse'>>;
  return {
    onRequestParse(payload) {
      try {
        return onRequestParse(payload);
      } catch {
        throw createGraphQLError(`a request must be sent as application/json or carry one of the headers ${CSRF_HEADERS.join(', ')}`, {
          extensions: { code: 'CSRF_HEADER_REQUIRED', http: { status: 403 } },
        });
      }
    },
  };
}

/**
 * CORS: the listed origins (`*`: any); with none listed, closed (no CORS headers, so a browser on another
 * origin can neither preflight nor read an answer) once authentication is required, yoga's default otherwise.
 */
export function corsOptions(origins: readonly string[] | undefined, authRequired: boolean): YogaServerOptions<object, object>['cors'] {
  if (origins === undefined) return authRequired ? false : undefined;
  if (origins.length === 0) return false;
  return {
    origin: origins.includes('*') ? '*' : [...origins],
    methods: ['GET', 'POST'],
    allowedHeaders: ['content-type', 'accept', 'authorization', 'x-asyncproc-csrf', 'last-event-id'],
    credentials: !origins.includes('*'),
    maxAge: 600,
  };
}
