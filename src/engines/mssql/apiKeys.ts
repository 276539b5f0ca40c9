import sql from 'mssql';
import { EngineError, type ApiKey, type NewApiKey } from '../../engine.js';
import { API_KEY_COLUMNS, checkNewApiKey, toApiKey, type ApiKeyRow } from '../identity.js';
import { errorNumber } from './errors.js';
import { isToken } from './types.js';

/** asyncexec.AsyncExecApiKeys (0009_identity.sql); the secret's hash is binary(32) there, roles a JSON array. */
const columns = (alias: string) => API_KEY_COLUMNS.map((c) => `${alias}.${c}`).join(', ');
type Row = ApiKeyRow<string>;
const toKey = (row: Row) => toApiKey(row, JSON.parse(row.roles) as string[]);

const hashBytes = (secretHash: string) => Buffer.from(secretHash, 'hex');

/** Store a key's hash; a name is unique among the keys not revoked (UX_AsyncExecApiKeys_live_name). */
export async function createApiKey(pool: sql.ConnectionPool, key: NewApiKey): Promise<ApiKey> {
  const { name, roles, secretHash, prefix, createdBy } = checkNewApiKey(key);
  try {
    const result = await pool
      .request()
      .input('name', sql.NVarChar(128), name)
      .input('roles', sql.NVarChar(sql.MAX), JSON.stringify(roles))
      .input('secretHash', sql.VarBinary(32), hashBytes(secretHash))
      .input('prefix', sql.NVarChar(32), prefix)
      .input('createdBy', sql.NVarChar(256), createdBy)
      .query<Row>(
        `INSERT asyncexec.AsyncExecApiKeys (name, roles, secret_hash, prefix, created_by)
         OUTPUT ${columns('inserted')}
         VALUES (@name, @roles, @secretHash, @prefix, @createdBy);`,
      );
    return toKey(result.recordset[0]);
  } catch (error) {
    // 2601: a duplicate key in a unique index; 2627: in a UNIQUE constraint
    const number = errorNumber(error);
    if (number === 2601) throw new EngineError('BAD_USER_INPUT', `an API key named "${name}" exists already`, { cause: error });
    if (number === 2627) throw new EngineError('BAD_USER_INPUT', 'this secret is in use already', { cause: error });
    throw error;
  }
}

/** Every key, revoked ones too, newest first. */
export async function listApiKeys(pool: sql.ConnectionPool): Promise<ApiKey[]> {
  const result = await pool.request().query<Row>(`SELECT ${columns('k')} FROM asyncexec.AsyncExecApiKeys AS k ORDER BY k.created_at DESC, k.id`);
  return result.recordset.map(toKey);
}

/** Revoke once (a second revoke keeps the first time); NOT_FOUND for an id no key has. */
export async function revokeApiKey(pool: sql.ConnectionPool, id: string): Promise<ApiKey> {
  if (typeof id !== 'string' || !isToken(id)) throw new EngineError('NOT_FOUND', `no API key has the id "${String(id)}"`);
  const result = await pool
    .request()
    .input('id', sql.UniqueIdentifier, id)
    .query<Row>(
      `UPDATE k SET revoked_at = COALESCE(k.revoked_at, SYSUTCDATETIME())
       OUTPUT ${columns('inserted')}
       FROM asyncexec.AsyncExecApiKeys AS k WHERE k.id = @id;`,
    );
  if (!result.recordset[0]) throw new EngineError('NOT_FOUND', `no API key has the id "${id}"`);
  return toKey(result.recordset[0]);
}

/**
 * The live key with this hash. Its use is recorded at most once a minute, so a busy key
 * does not write on every request: the UPDATE's WHERE reads last_used_at on the row it
 * locks, so callers at once write it once; the SELECT then reads the row as it is.
 */
export async function findApiKey(pool: sql.ConnectionPool, secretHash: string): Promise<ApiKey | null> {
  if (typeof secretHash !== 'string' || !/^[0-9a-f]{64}$/.test(secretHash)) return null;
  const result = await pool
    .request()
    .input('secretHash', sql.VarBinary(32), hashBytes(secretHash))
    .query<Row>(
      `UPDATE asyncexec.AsyncExecApiKeys SET last_used_at = SYSUTCDATETIME()
        WHERE secret_hash = @secretHash AND revoked_at IS NULL
          AND (last_used_at IS NULL OR last_used_at < DATEADD(minute, -1, SYSUTCDATETIME()));
       SELECT ${columns('k')} FROM asyncexec.AsyncExecApiKeys AS k WHERE k.secret_hash = @secretHash AND k.revoked_at IS NULL;`,
    );
  return result.recordset[0] ? toKey(result.recordset[0]) : null;
}
