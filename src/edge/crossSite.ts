import { useCSRFPrevention } from '@graphql-yoga/plugin-csrf-prevention';
import { createGraphQLError, type Plugin, type YogaServerOptions } from 'graphql-yoga';
import { isIP } from 'node:net';

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
 * CORS: the listed origins (`*`: any, without credentials); with none listed, closed — no CORS
 * headers, so a browser page of another origin can neither preflight nor read an answer —
 * whether or not authentication is on (with it off, every caller is an administrator: a page
 * of any site the user visits would otherwise drive the service). Decided per request: an
 * origin not listed gets no CORS headers at all (a list given to yoga as is answers an unlisted
 * origin with `Access-Control-Allow-Origin: null` and credentials, which a sandboxed or
 * data: document, whose origin is `null`, matches).
 */
export function corsOptions(origins: readonly string[] | undefined): YogaServerOptions<object, object>['cors'] {
  if (!origins?.length) return false;
  const any = origins.includes('*');
  const listed = new Set(origins);
  const answer = { methods: ['GET', 'POST'], allowedHeaders: ['content-type', 'accept', 'authorization', 'x-asyncproc-csrf', 'last-event-id'], maxAge: 600 };
  return (request: Request) => {
    const origin = request.headers.get('origin');
    if (any) return { ...answer, origin: '*', credentials: false };
    if (origin === null || !listed.has(origin)) return false;
    return { ...answer, origin: [origin], credentials: true };
  };
}

/**
 * Whether a browser page of `origin` may open a graphql-ws socket (browsers send Origin on
 * every WebSocket upgrade, and no CORS applies to it): none (not a browser), the service's own
 * origin (the Host the request names, or the X-Forwarded-Host a proxy in front adds), or one of
 * ASYNCPROC_CORS_ORIGINS (`*`: any). A page of another site is refused even without
 * credentials of its own: behind a proxy that turns a cookie into an Authorization header, or
 * with authentication off, the socket would act for the user.
 */
export function webSocketOriginAllowed(origin: string | undefined, hosts: readonly (string | undefined)[], origins: readonly string[] | undefined): boolean {
  if (origin === undefined) return true;
  if (origins?.includes('*') || origins?.includes(origin)) return true;
  let host: string;
  try {
    host = new URL(origin).host;
  } catch {
    return false;
  }
  return hosts.some((candidate) => candidate !== undefined && candidate.split(',')[0].trim().toLowerCase() === host.toLowerCase());
}

/**
 * Whether a request naming `host` (its Host header) may be served while authentication is off,
 * when every caller is an administrator. A page of any site can make its own name resolve to
 * this machine (DNS rebinding): the browser then takes the service for that site's origin, and
 * neither CORS nor the origin checks above stop the page from driving it. So the name must be
 * one no other site controls: an IP address, `localhost` (and `*.localhost`), or one of
 * `allowed` (ASYNCPROC_ALLOWED_HOSTS; `*`: any). No Host at all (not a browser): served.
 */
export function hostAllowed(host: string | undefined, allowed: readonly string[] | undefined): boolean {
  if (host === undefined || allowed?.includes('*')) return true;
  let name: string;
  try {
    name = new URL(`http://${host}`).hostname.toLowerCase();
  } catch {
    return false;
  }
  if (isIP(name.replace(/^\[(.*)\]$/, '$1')) !== 0) return true;
  if (name === 'localhost' || name.endsWith('.localhost')) return true;
  return allowed?.some((candidate) => candidate.toLowerCase() === name) ?? false;
}

/** The answer to a request hostAllowed refused: 403, as a GraphQL error (HOST_NOT_ALLOWED). */
export const HOST_REFUSED = {
  status: 403,
  message:
    'this host name may not reach the service while authentication is off (a page of another site could make its name point here): ' +
    'use localhost or an IP address, list the name in ASYNCPROC_ALLOWED_HOSTS, or turn authentication on',
};
