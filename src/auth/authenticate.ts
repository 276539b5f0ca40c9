import type { Engine } from '../engine.js';
import type { Logger } from '../logger.js';
import { hashApiKey, isApiKeySecret } from './apiKeys.js';
import { JwtVerifier, TokenError, usableSubject, type JwtSettings } from './jwt.js';
import { anonymous, type Principal } from './principal.js';

export interface AuthSettings {
  /** none: anonymous access, `x-asyncproc-user` honoured (development). required: JWT or API key on every operation. */
  mode: 'none' | 'required';
  jwt: JwtSettings | null;
}

/** The header a caller may use to say who it is, honoured only when auth is off. */
export const USER_HEADER = 'x-asyncproc-user';

/** The x-asyncproc-user a caller names itself by when auth is off (development), if usable (usableSubject); else refused. */
function developmentUser(user: string | null | undefined): string | null {
  if (typeof user !== 'string' || user === '') return null;
  if (!usableSubject(user)) {
    throw new AuthenticationError('invalid', `${USER_HEADER} must be at most 256 characters of text (no control or invisible format characters)`);
  }
  return user;
}

/** How long a re-check of an API key holds (stillValid): a revoked key stops within this on every instance. */
export const RECHECK_MS = 1000;

/** No credentials (`missing`) or credentials refused (`invalid`): HTTP 401; graphql-ws closes 4401 / 4403. */
export class AuthenticationError extends Error {
  override name = 'AuthenticationError';
  constructor(
    readonly reason: 'missing' | 'invalid',
    message: string,
  ) {
    super(message);
  }
}

/**
 * Turns what a request carries into a Principal: `Authorization: Bearer <JWT>`,
 * `Authorization: ApiKey <secret>` (or `Bearer apk_…`, which no JWT can be).
 * The same credentials arrive as HTTP headers (queries, mutations, SSE) and as
 * graphql-ws `connectionParams` (`{ Authorization: "Bearer …" }` or `{ token: "…" }`).
 */
export class Authenticator {
  private readonly jwt: JwtVerifier | null;
  /** API keys looked up again lately (stillValid), by hash. */
  private readonly keyChecks = new Map<string, { at: number; live: Promise<boolean> }>();

  constructor(
    readonly settings: AuthSettings,
    private readonly engine: Engine,
    private readonly logger: Logger,
  ) {
    this.jwt = settings.jwt ? new JwtVerifier(settings.jwt) : null;
  }

  get required(): boolean {
    return this.settings.mode === 'required';
  }

  /** `authorization`: the header's value (or connectionParams'); `user`: the x-asyncproc-user header. */
  async authenticate(authorization: string | null | undefined, user: string | null | undefined): Promise<Principal> {
    if (!this.required) return anonymous(developmentUser(user));
    if (!authorization) {
      throw new AuthenticationError('missing', 'authentication required: send Authorization: Bearer <JWT> or Authorization: ApiKey <key>');
    }
    const match = /^(Bearer|ApiKey)\s+(\S+)\s*$/i.exec(authorization);
    if (!match) throw new AuthenticationError('invalid', 'malformed Authorization header: expected "Bearer <JWT>" or "ApiKey <key>"');
    const [, scheme, credential] = match;
    if (scheme.toLowerCase() === 'apikey' || isApiKeySecret(credential)) return this.apiKey(credential);
    if (!this.jwt) throw new AuthenticationError('invalid', 'JWTs are not accepted here (no JWT key configured): use an API key');
    try {
      const token = await this.jwt.verify(credential);
      return { subject: token.subject, roles: token.roles, via: 'jwt', expiresAt: token.expiresAt };
    } catch (error) {
      if (error instanceof TokenError) throw new AuthenticationError('invalid', error.message);
      throw error;
    }
  }

  private async apiKey(secret: string): Promise<Principal> {
    const key = isApiKeySecret(secret) ? await this.engine.findApiKey(hashApiKey(secret)) : null;
    if (!key) {
      this.logger.debug('refused an unknown or revoked API key');
      throw new AuthenticationError('invalid', 'unknown or revoked API key');
    }
    return { subject: `apikey:${key.name}`, roles: key.roles, via: 'apiKey', expiresAt: null, keyHash: hashApiKey(secret) };
  }

  /**
   * Whether a principal's credentials still hold, for what outlives one request (a graphql-ws
   * socket, a running subscription over either transport): a JWT until its `exp`, an API key
   * until it is revoked. true (not a promise) when nothing needs reading. An API key is looked up
   * again at most once every RECHECK_MS, one lookup shared by every socket and stream of the key;
   * a lookup that fails (database out of reach) counts as still valid: an outage must not sign
   * everyone out.
   */
  stillValid(principal: Principal): true | Promise<boolean> {
    if (principal.expiresAt && principal.expiresAt.getTime() <= Date.now()) return Promise.resolve(false);
    if (principal.via !== 'apiKey' || !principal.keyHash) return true;
    const now = Date.now();
    let check = this.keyChecks.get(principal.keyHash);
    if (!check || now - check.at >= RECHECK_MS) {
      const live = this.engine.findApiKey(principal.keyHash).then(
        (key) => key !== null,
        () => true,
      );
      this.keyChecks.delete(principal.keyHash);
      this.keyChecks.set(principal.keyHash, (check = { at: now, live }));
      if (this.keyChecks.size > 10_000) this.keyChecks.delete(this.keyChecks.keys().next().value!);
    }
    return check.live;
  }

  /** Forget every API key lookup: a key revoked here is found revoked at its next check. */
  forgetKeyChecks(): void {
    this.keyChecks.clear();
  }
}

/** The credential graphql-ws clients send in connectionParams: `Authorization` (any case) or `token`. */
export function authorizationParam(params: Readonly<Record<string, unknown>> | undefined): string | null {
  if (!params) return null;
  for (const [key, value] of Object.entries(params)) {
    if (key.toLowerCase() === 'authorization' && typeof value === 'string') return value;
  }
  if (typeof params.token === 'string' && params.token !== '') return `Bearer ${params.token}`;
  return null;
}
