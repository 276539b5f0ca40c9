import sql from 'mssql';
import { EngineError, type ApiKey, type ApiKeySecret, type NewApiKey } from '../../engine.js';
import { API_KEY_COLUMNS, checkApiKeySecret, checkNewApiKey, checkOverlap, noSuchApiKey, notRotated, toApiKey, type ApiKeyRow } from '../identity.js';
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

/**
 * Revoke once (a second revoke keeps the first time; a rotated key's overlap ends now);
 * NOT_FOUND for an id no key has.
 */
export async function revokeApiKey(pool: sql.ConnectionPool, id: string): Promise<ApiKey> {
  if (typeof id !== 'string' || !isToken(id)) throw noSuchApiKey(id);
  const result = await pool
    .request()
    .input('id', sql.UniqueIdentifier, id)
    .query<Row>(
      `UPDATE k SET revoked_at = CASE WHEN k.revoked_at IS NULL OR k.revoked_at > CAST(SYSUTCDATETIME() AS datetime2(3)) THEN SYSUTCDATETIME() ELSE k.revoked_at END
       OUTPUT ${columns('inserted')}
       FROM asyncexec.AsyncExecApiKeys AS k WHERE k.id = @id;`,
    );
  if (!result.recordset[0]) throw noSuchApiKey(id);
  return toKey(result.recordset[0]);
}

/**
 * A live key's successor, in one transaction: the key's revoked_at set `overlapSeconds` ahead
 * (which also takes it out of the filtered index UX_AsyncExecApiKeys_live_name, so the successor
 * may have its name) and the successor inserted from it. A rotation racing this one waits for
 * the key's row (the UPDATE's exclusive lock, held to the commit), then finds it no longer live
 * and inserts nothing. The table variable keeps the old row for the answer; XACT_ABORT stays as
 * the connection has it (OFF): the CATCH rolls back whatever failed and rethrows.
 */
export async function rotateApiKey(pool: sql.ConnectionPool, id: string, successor: ApiKeySecret, overlapSeconds: number): Promise<{ key: ApiKey; previous: ApiKey }> {
  const { secretHash, prefix, createdBy } = checkApiKeySecret(successor);
  const overlap = checkOverlap(overlapSeconds);
  if (typeof id !== 'string' || !isToken(id)) throw noSuchApiKey(id);
  const result = await pool
    .request()
    .input('id', sql.UniqueIdentifier, id)
    .input('overlap', sql.Int, overlap)
    .input('secretHash', sql.VarBinary(32), hashBytes(secretHash))
    .input('prefix', sql.NVarChar(32), prefix)
    .input('createdBy', sql.NVarChar(256), createdBy)
    .query<Row>(
      `SET NOCOUNT ON;
       DECLARE @previous TABLE (id uniqueidentifier, name nvarchar(128) COLLATE Latin1_General_BIN2, roles nvarchar(max), prefix nvarchar(32),
                                created_at datetime2(3), created_by nvarchar(256), last_used_at datetime2(3), revoked_at datetime2(3));
       BEGIN TRY
         BEGIN TRANSACTION;
         UPDATE k SET revoked_at = DATEADD(second, @overlap, SYSUTCDATETIME())
         OUTPUT ${columns('inserted')} INTO @previous
         FROM asyncexec.AsyncExecApiKeys AS k WHERE k.id = @id AND k.revoked_at IS NULL;
         INSERT asyncexec.AsyncExecApiKeys (name, roles, secret_hash, prefix, created_by)
         OUTPUT ${columns('inserted')}
         SELECT p.name, p.roles, @secretHash, @prefix, @createdBy FROM @previous AS p;
         COMMIT TRANSACTION;
       END TRY
       BEGIN CATCH
         IF XACT_STATE() <> 0
           ROLLBACK TRANSACTION;
         THROW;
       END CATCH;
       SELECT ${columns('p')} FROM @previous AS p;`,
    )
    .catch((error: unknown) => {
      if (errorNumber(error) === 2627) throw new EngineError('BAD_USER_INPUT', 'this secret is in use already', { cause: error });
      throw error;
    });
  const recordsets = result.recordsets as Row[][];
  const [made] = recordsets[0] ?? [];
  const [previous] = recordsets[1] ?? [];
  if (made && previous) return { key: toKey(made), previous: toKey(previous) };
  const found = await pool.request().input('id', sql.UniqueIdentifier, id).query<Row>(`SELECT ${columns('k')} FROM asyncexec.AsyncExecApiKeys AS k WHERE k.id = @id;`);
  throw notRotated(id, found.recordset[0] ? toKey(found.recordset[0]) : null);
}

/**
 * The live key with this hash. Its revoked_at is compared with the clock at the column's
 * precision (as in revokeApiKey): SYSUTCDATETIME() is datetime2(7), stored in datetime2(3) it is
 * rounded, up by as much as half a millisecond, and a key revoked "now" compared with the
 * unrounded clock went on working for that long. Its use is recorded at most once a minute, so a busy key
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
        WHERE secret_hash = @secretHash AND (revoked_at IS NULL OR revoked_at > CAST(SYSUTCDATETIME() AS datetime2(3)))
          AND (last_used_at IS NULL OR last_used_at < DATEADD(minute, -1, SYSUTCDATETIME()));
       SELECT ${columns('k')} FROM asyncexec.AsyncExecApiKeys AS k
        WHERE k.secret_hash = @secretHash AND (k.revoked_at IS NULL OR k.revoked_at > CAST(SYSUTCDATETIME() AS datetime2(3)));`,
    );
  return result.recordset[0] ? toKey(result.recordset[0]) : null;
}
