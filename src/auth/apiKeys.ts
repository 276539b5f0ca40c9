import { createHash, randomBytes } from 'node:crypto';
import { EngineError, ROLE_NAME, type ApiKey, type Engine } from '../engine.js';

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

/** Create a key: the secret is returned here, once, and never stored. */
export async function createApiKey(
  engine: Engine,
  input: { name: string; roles: readonly string[]; createdBy: string | null },
): Promise<{ key: ApiKey; secret: string }> {
  const secret = API_KEY_PREFIX + randomBytes(32).toString('base64url');
  const key = await engine.createApiKey({
    name: input.name,
    roles: checkRoles(input.roles),
    secretHash: hashApiKey(secret),
    prefix: secret.slice(0, API_KEY_PREFIX.length + 4),
    createdBy: input.createdBy,
  });
  return { key, secret };
}
