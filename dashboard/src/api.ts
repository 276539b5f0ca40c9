/**
 * Talking to the service: queries and mutations over HTTP, subscriptions over graphql-ws, both on
 * /graphql of the origin that served the page, both carrying the credential the person typed in.
 */
import { createClient, type Client, type SubscribePayload } from 'graphql-ws';
import { Store } from './store';

const CREDENTIAL = 'asyncproc.authorization';

/** Why the person is looking at the sign-in form (null: they have not been signed out). */
export const signedOut = new Store<string | null>(null);
/** The credential in use: `Bearer <JWT>` / `ApiKey <key>`, or null (anonymous, development mode). */
export const credential = new Store<string | null>(sessionStorage.getItem(CREDENTIAL));
/** Whether the graphql-ws socket is up. */
export const connected = new Store<boolean>(false);

/** What a person pastes (a JWT, an API key, or either with its scheme) as an Authorization value. */
export function authorizationValue(typed: string): string {
  const text = typed.trim();
  if (/^(Bearer|ApiKey)\s+\S+$/i.test(text)) return text;
  return text.startsWith('apk_') ? `ApiKey ${text}` : `Bearer ${text}`;
}

export function signIn(typed: string) {
  const value = authorizationValue(typed);
  sessionStorage.setItem(CREDENTIAL, value);
  resetSocket();
  credential.set(value);
  signedOut.set(null);
}

/**
 * The service refused the credentials sent, or asked for some: "Signed out: why" to someone who
 * was signed in, the service's request to someone who never was.
 */
function refusedCredentials(why: string) {
  signOut(credential.get() ? `Signed out: ${why}` : 'This service asks for a JWT or an API key.');
}

/** Back to the sign-in form, saying why. */
export function signOut(reason: string) {
  sessionStorage.removeItem(CREDENTIAL);
  resetSocket();
  credential.set(null);
  signedOut.set(reason);
}

export class ApiError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

interface GraphQLResponse<T> {
  data?: T | null;
  errors?: { message: string; extensions?: { code?: string } }[];
}

function failure(errors: NonNullable<GraphQLResponse<unknown>['errors']>): ApiError {
  const first = errors[0]!;
  const code = first.extensions?.code ?? 'ERROR';
  if (code === 'UNAUTHENTICATED') refusedCredentials(first.message);
  return new ApiError(code, first.message);
}

/** A query or mutation over HTTP; GraphQL errors are thrown as ApiError (UNAUTHENTICATED also signs out). */
export async function gql<T>(query: string, variables?: Record<string, unknown>): Promise<T> {
  const headers: Record<string, string> = { 'content-type': 'application/json', accept: 'application/graphql-response+json, application/json' };
  const authorization = credential.get();
  if (authorization) headers.authorization = authorization;
  let response: Response;
  try {
    response = await fetch('/graphql', { method: 'POST', headers, body: JSON.stringify({ query, variables }) });
  } catch (error) {
    throw new ApiError('NETWORK', `the service cannot be reached (${(error as Error).message})`);
  }
  const body = (await response.json().catch(() => ({}))) as GraphQLResponse<T>;
  if (body.errors?.length) throw failure(body.errors);
  if (response.status === 401) {
    refusedCredentials('the service asks for credentials');
    throw new ApiError('UNAUTHENTICATED', 'authentication required');
  }
  if (!response.ok || !body.data) throw new ApiError('HTTP', `the service answered ${response.status}`);
  return body.data;
}

let client: Client | null = null;

const isClose = (value: unknown): value is CloseEvent => typeof value === 'object' && value !== null && 'code' in value && 'reason' in value;
/** 4401: no credentials; 4403: credentials refused (src/server.ts). */
const refused = (value: unknown) => isClose(value) && (value.code === 4401 || value.code === 4403);

function socket(): Client {
  return (client ??= createClient({
    url: `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/graphql`,
    connectionParams: () => {
      const authorization = credential.get();
      return authorization ? { Authorization: authorization } : {};
    },
    lazy: true,
    keepAlive: 15_000,
    retryAttempts: Infinity,
    shouldRetry: (event) => !refused(event),
    on: {
      connected: () => connected.set(true),
      closed: (event) => {
        connected.set(false);
        if (refused(event)) refusedCredentials((event as CloseEvent).reason || 'the service refused the credentials');
      },
    },
  }));
}

function resetSocket() {
  const old = client;
  client = null;
  connected.set(false);
  void old?.dispose();
}

export interface Subscription<T> {
  /** Called with each result's data. */
  next(data: T): void;
  /** The stream failed (its GraphQL errors, or the socket refused); it will not resume by itself. */
  error?(error: ApiError): void;
  /** The stream ended (executionCompleted after its one event, say). */
  complete?(): void;
}

/**
 * A subscription over graphql-ws. A dropped socket is reconnected and the operation sent again with
 * this same `payload` object: change its variables (a resume cursor) and the new values are what is sent.
 */
export function subscribe<T>(payload: SubscribePayload, sink: Subscription<T>): () => void {
  return socket().subscribe<T>(payload, {
    next: (result) => {
      if (result.errors?.length) sink.error?.(failure(result.errors as NonNullable<GraphQLResponse<T>['errors']>));
      else if (result.data) sink.next(result.data as T);
    },
    error: (error) => sink.error?.(error instanceof ApiError ? error : new ApiError('SOCKET', isClose(error) ? `socket closed (${error.code})` : String(error))),
    complete: () => sink.complete?.(),
  });
}
