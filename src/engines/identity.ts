/**
 * Checks of identity input shared by both engines, made before the database is asked:
 * role names, a caller's roles, a new API key. The databases repeat what guards data.
 */
import { apiKeyActive, EngineError, MAX_ROTATION_OVERLAP_SECONDS, ROLE_NAME, type ApiKey, type ApiKeySecret, type NewApiKey } from '../engine.js';

const badInput = (message: string) => new EngineError('BAD_USER_INPUT', message);

/** Text a database keeps exactly: no control characters (NUL included) and no lone surrogates. */
const plainText = (value: string) => !/[\p{Cc}\p{Cs}]/u.test(value);

/** Roles a procedure or key is given: each a ROLE_NAME, duplicates dropped (BAD_USER_INPUT otherwise). */
export function checkRoles(roles: readonly string[] | null | undefined): string[] {
  if (roles == null) return [];
  if (!Array.isArray(roles)) throw badInput('roles must be a list of role names');
  for (const role of roles) {
    if (typeof role !== 'string' || !ROLE_NAME.test(role)) {
      throw badInput(`bad role name "${String(role)}": 1–64 characters of A-Z a-z 0-9 _ . : -`);
    }
  }
  return [...new Set(roles)];
}

/**
 * A caller's roles as the database compares them: a name that is no ROLE_NAME can match no
 * registration and is left out (so SQL Server's blank-padded comparison never sees `admin `).
 * null/absent stays null: not checked.
 */
export function callerRoles(roles: readonly string[] | null | undefined): string[] | null {
  if (roles == null) return null;
  return [...new Set(roles.filter((role) => typeof role === 'string' && ROLE_NAME.test(role)))];
}

const SECRET_HASH = /^[0-9a-f]{64}$/;
const PREFIX = /^[\x21-\x7e]{1,32}$/;

/** A new API key as both engines store it; BAD_USER_INPUT for anything they would not. */
export function checkNewApiKey(key: NewApiKey): NewApiKey & { roles: string[] } {
  const { name } = key;
  if (typeof name !== 'string' || name.length < 1 || name.length > 128 || !plainText(name) || name.trim() !== name) {
    throw badInput('an API key name is 1–128 characters, without control characters or blanks at either end');
  }
  return { name, ...checkApiKeySecret(key), roles: checkRoles(key.roles) };
}

/** A rotation's overlap: whole seconds, 0–MAX_ROTATION_OVERLAP_SECONDS (BAD_USER_INPUT otherwise). */
export function checkOverlap(overlapSeconds: number): number {
  if (!Number.isInteger(overlapSeconds) || overlapSeconds < 0 || overlapSeconds > MAX_ROTATION_OVERLAP_SECONDS) {
    throw badInput(`overlapSeconds is a whole number of seconds from 0 to ${MAX_ROTATION_OVERLAP_SECONDS} (30 days)`);
  }
  return overlapSeconds;
}

/** A key's secret (its hash and prefix) and maker as both engines store them. */
export function checkApiKeySecret(key: ApiKeySecret): ApiKeySecret {
  const { secretHash, prefix, createdBy } = key;
  if (typeof secretHash !== 'string' || !SECRET_HASH.test(secretHash)) {
    throw badInput('secretHash must be a SHA-256 in lower-case hex (64 characters)');
  }
  if (typeof prefix !== 'string' || !PREFIX.test(prefix)) throw badInput('an API key prefix is 1–32 printable ASCII characters');
  if (createdBy != null && (typeof createdBy !== 'string' || createdBy.length > 256 || !plainText(createdBy))) {
    throw badInput('createdBy is at most 256 characters, without control characters');
  }
  return { secretHash, prefix, createdBy: createdBy ?? null };
}

/** An API key row as both engines select it (roles as each engine stores them). */
export interface ApiKeyRow<Roles> {
  id: string;
  name: string;
  roles: Roles;
  prefix: string;
  created_at: Date;
  created_by: string | null;
  last_used_at: Date | null;
  revoked_at: Date | null;
}

export const API_KEY_COLUMNS = ['id', 'name', 'roles', 'prefix', 'created_at', 'created_by', 'last_used_at', 'revoked_at'];

/** ids in lower case (SQL Server spells uniqueidentifiers in capitals). */
export function toApiKey(row: ApiKeyRow<unknown>, roles: string[]): ApiKey {
  return {
    id: row.id.toLowerCase(),
    name: row.name,
    roles,
    prefix: row.prefix,
    createdAt: row.created_at,
    createdBy: row.created_by,
    lastUsedAt: row.last_used_at,
    revokedAt: row.revoked_at,
  };
}

/** NOT_FOUND for an API key id no key has (or no id at all). */
export function noSuchApiKey(id: unknown): EngineError {
  return new EngineError('NOT_FOUND', `no API key has the id "${String(id)}"`);
}

/** Why a key was not rotated: NOT_FOUND (no such key), or BAD_USER_INPUT (revoked, or rotated already). */
export function notRotated(id: string, key: ApiKey | null): EngineError {
  if (!key) return noSuchApiKey(id);
  // not live, yet working: its revokedAt lies ahead, set by a rotation
  if (key.revokedAt && apiKeyActive(key)) {
    return badInput(`the API key "${key.name}" (${id}) was rotated already and stops at ${key.revokedAt.toISOString()}: rotate its successor`);
  }
  return badInput(`the API key "${key.name}" (${id}) is revoked`);
}
