import { createHash, randomBytes } from 'node:crypto';
import { EngineError, ROLE_NAME, type ApiKey, type ApiKeySecret, type Engine } from '../engine.js';

/** Every secret starts so: a reader tells it from a JWT (which starts `eyJ` and has dots) at a glance. */
export const API_KEY_PREFIX = 'apk_';
const SECRET = /^apk_[A-Za-z0-9_-]{43}$/;

export function isApiKeySecret(text: string): boolean {
  return SECRET.test(text);
}

/** Lower-case hex SHA-256: what the database keeps instead of the secret (256 random bits need no slow hash). */
export function hashApiKey(secret: string): string {
  return createHash('sha256').update(secret).digest('hex');
}

export function checkRoles(roles: readonly string[]): string[] {
  for (const role of roles) {
    if (!ROLE_NAME.test(role)) throw new EngineError('BAD_USER_INPUT', `bad role name "${role}": 1–64 of A-Z a-z 0-9 _ . : -`);
  }
  return [...new Set(roles)];
}

/** A new secret (256 random bits), and what is stored of it. */
function newSecret(createdBy: string | null): { secret: string; stored: ApiKeySecret } {
  const secret = API_KEY_PREFIX + randomBytes(32).toString('base64url');
  return { secret, stored: { secretHash: hashApiKey(secret), prefix: secret.slice(0, API_KEY_PREFIX.length + 4), createdBy } };
}

/** Create a key: the secret is returned here, once, and never stored. */
export async function createApiKey(
  engine: Engine,
  input: { name: string; roles: readonly string[]; createdBy: string | null },
): Promise<{ key: ApiKey; secret: string }> {
  const { secret, stored } = newSecret(input.createdBy);
  const key = await engine.createApiKey({ name: input.name, roles: checkRoles(input.roles), ...stored });
  return { key, secret };
}

/** How long a rotated key goes on working beside its successor, unless told: one hour. */
export const DEFAULT_ROTATION_OVERLAP_SECONDS = 3600;

/**
 * Rotate a key: a successor with its name and roles, whose secret is returned here, once; the
 * old key goes on working for `overlapSeconds`, then stops (as if revoked then).
 */
export async function rotateApiKey(
  engine: Engine,
  input: { id: string; overlapSeconds?: number | null; createdBy: string | null },
): Promise<{ key: ApiKey; previous: ApiKey; secret: string }> {
  const { secret, stored } = newSecret(input.createdBy);
  const rotated = await engine.rotateApiKey(input.id, stored, input.overlapSeconds ?? DEFAULT_ROTATION_OVERLAP_SECONDS);
  return { ...rotated, secret };
}
