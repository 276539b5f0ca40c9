import type { KeyObject } from 'node:crypto';
import { createRemoteJWKSet, errors, jwtVerify, type JWTPayload, type JWTVerifyGetKey, type JWSAlgorithm } from 'jose';
import { ROLE_NAME } from '../engine.js';
import { publicKeyFromPem } from './publicKey.js';
import { textProblem } from '../schema/input.js';

/**
 * Whether a caller's identity (a JWT's `sub`, the development-mode x-asyncproc-user) can be
 * recorded as `submittedBy` as it is: 1–256 characters, no control or invisible format character, no lone
 * surrogate (stored as U+FFFD, the caller would no longer own its own calls).
 */
export function usableSubject(subject: unknown): subject is string {
  // control characters (C0, DEL, C1) and invisible format ones (zero-width, bidi overrides, soft
  // hyphen): "alice\u200b" or "alice\u007f" reads as alice wherever an admin sees `submittedBy`
  return typeof subject === 'string' && subject !== '' && subject.length <= 256 && !/[\p{Cc}\p{Cf}]/u.test(subject) && !textProblem(subject) && !apiKeySubject(subject);
}

/**
 * `apikey:<name>` is the identity of an API key (its calls' `submittedBy`, what ownership compares):
 * no other credential may carry it, or a JWT whose `sub` an identity provider let a user choose
 * would read and cancel that key's calls.
 */
export const apiKeySubject = (subject: string) => subject.toLowerCase().startsWith('apikey:');

export interface JwtSettings {
  /** HS256/384/512 shared secret. */
  secret?: string;
  /** PEM public key (SPKI, PKCS#1) or certificate for RS/PS/ES/EdDSA tokens. */
  publicKey?: string;
  /** JWKS URL for RS/PS/ES/EdDSA tokens (keys fetched and cached by jose). */
  jwksUrl?: string;
  issuer?: string;
  audience?: string;
  /** Claim holding the roles; a dotted path reaches into objects (`realm_access.roles`). */
  rolesClaim: string;
  /**
   * Refuse a token without `exp`: one that never expires stays good for ever once leaked (a JWT
   * cannot be revoked here; an API key can). @default true
   */
  requireExpiry?: boolean;
}

export interface VerifiedToken {
  subject: string;
  roles: string[];
  expiresAt: Date | null;
}

/** Why a token was refused, in words safe to give the caller. */
export class TokenError extends Error {
  override name = 'TokenError';
}

const HMAC: JWSAlgorithm[] = ['HS256', 'HS384', 'HS512'];
const ASYMMETRIC: JWSAlgorithm[] = ['RS256', 'RS384', 'RS512', 'PS256', 'PS384', 'PS512', 'ES256', 'ES384', 'ES512', 'EdDSA', 'Ed25519'];

/** The roles a claim value carries: an array of names, or one string of names separated by spaces or commas. */
export function rolesFrom(payload: JWTPayload, claim: string): string[] {
  let value: unknown = payload;
  for (const part of claim.split('.')) value = value !== null && typeof value === 'object' ? (value as Record<string, unknown>)[part] : undefined;
  const names = Array.isArray(value) ? value : typeof value === 'string' ? value.split(/[\s,]+/) : [];
  return [...new Set(names.filter((name): name is string => typeof name === 'string' && ROLE_NAME.test(name)))];
}

/**
 * Verifies JWTs by the configured key: a shared secret for HS*, a public key or a JWKS
 * for the asymmetric algorithms. `alg: none` and algorithms without a configured key
 * are refused; issuer and audience are checked when configured; expired tokens refused, and
 * (unless requireExpiry is false) tokens that never expire.
 */
export class JwtVerifier {
  private readonly secret?: Uint8Array;
  private readonly publicKey?: KeyObject;
  private readonly jwks?: JWTVerifyGetKey;

  constructor(private readonly settings: JwtSettings) {
    if (settings.secret) this.secret = new TextEncoder().encode(settings.secret);
    if (settings.publicKey) this.publicKey = publicKeyFromPem(settings.publicKey);
    if (settings.jwksUrl) this.jwks = createRemoteJWKSet(new URL(settings.jwksUrl), { cacheMaxAge: 10 * 60_000, cooldownDuration: 30_000 });
  }

  async verify(token: string): Promise<VerifiedToken> {
    const options = {
      issuer: this.settings.issuer,
      audience: this.settings.audience,
      clockTolerance: 5,
      requiredClaims: this.settings.requireExpiry === false ? [] : ['exp'],
    };
    let payload: JWTPayload;
    try {
      const alg = algorithmOf(token);
      if (HMAC.includes(alg)) {
        if (!this.secret) throw new TokenError(`${alg} tokens are not accepted (no ASYNCPROC_JWT_SECRET)`);
        ({ payload } = await jwtVerify(token, this.secret, { ...options, algorithms: HMAC }));
      } else if (ASYMMETRIC.includes(alg)) {
        if (this.publicKey) ({ payload } = await jwtVerify(token, this.publicKey, { ...options, algorithms: ASYMMETRIC }));
        else if (this.jwks) ({ payload } = await jwtVerify(token, this.jwks, { ...options, algorithms: ASYMMETRIC }));
        else throw new TokenError(`${alg} tokens are not accepted (no ASYNCPROC_JWT_PUBLIC_KEY or ASYNCPROC_JWKS_URL)`);
      } else {
        throw new TokenError(`tokens signed with "${alg}" are not accepted`);
      }
    } catch (error) {
      throw toTokenError(error);
    }
    // the clock tolerance is for "nbf" and "iat" (an issuer whose clock runs ahead): past its "exp",
    // a token is refused at once, as its open sockets and streams are ended then (stillValid)
    if (typeof payload.exp === 'number' && payload.exp * 1000 <= Date.now()) throw new TokenError('the token has expired');
    // an "exp" no date can hold (1e300) never comes: a token that never expires, which requireExpiry refuses
    if (typeof payload.exp === 'number' && !Number.isFinite(new Date(payload.exp * 1000).getTime())) {
      throw new TokenError('the token\'s "exp" is past any date: a token that never expires is not accepted');
    }
    // jose checks "iat" only against a maximum age: one ahead of this clock by more than the
    // tolerance was issued by a clock that is wrong, or made to last longer than its issuer meant
    if (typeof payload.iat === 'number' && payload.iat * 1000 > Date.now() + options.clockTolerance * 1000) {
      throw new TokenError('the token\'s "iat" is in the future');
    }
    if (typeof payload.sub === 'string' && apiKeySubject(payload.sub)) {
      throw new TokenError('the token\'s "sub" may not start with "apikey:", the identities of API keys');
    }
    if (!usableSubject(payload.sub)) {
      throw new TokenError('the token has no usable "sub" claim (the caller\'s identity)');
    }
    return {
      subject: payload.sub,
      roles: rolesFrom(payload, this.settings.rolesClaim),
      expiresAt: typeof payload.exp === 'number' ? new Date(payload.exp * 1000) : null,
    };
  }
}

function algorithmOf(token: string): JWSAlgorithm {
  const header = token.split('.')[0] ?? '';
  try {
    const alg = (JSON.parse(Buffer.from(header, 'base64url').toString('utf8')) as { alg?: unknown }).alg;
    if (typeof alg === 'string') return alg as JWSAlgorithm;
  } catch {
    // reported below
  }
  throw new TokenError('malformed token');
}

function toTokenError(error: unknown): TokenError {
  if (error instanceof TokenError) return error;
  if (error instanceof errors.JWTExpired) return new TokenError('the token has expired');
  if (error instanceof errors.JWTClaimValidationFailed && error.claim === 'exp' && error.reason === 'missing') {
    return new TokenError('the token has no "exp" claim: a token that never expires is not accepted');
  }
  if (error instanceof errors.JWTClaimValidationFailed) return new TokenError(`the token was refused: ${error.message}`);
  if (error instanceof errors.JWKSNoMatchingKey) return new TokenError('no key of the key set matches the token');
  if (error instanceof errors.JWKSTimeout || !(error instanceof errors.JOSEError)) {
    return new TokenError('the token could not be verified (key set unavailable)');
  }
  return new TokenError('the token signature or format is invalid');
}
