import type pg from 'pg';
import { EngineError, isUuid, type ApiKey, type ApiKeySecret, type NewApiKey } from '../../engine.js';
import { API_KEY_COLUMNS, checkApiKeySecret, checkNewApiKey, checkOverlap, noSuchApiKey, notRotated, toApiKey, type ApiKeyRow } from '../identity.js';

const COLUMNS = API_KEY_COLUMNS.map((c) => `k.${c}`).join(', ');
type Row = ApiKeyRow<string[]>;
const toKey = (row: Row) => toApiKey(row, row.roles);

/** Store a key's hash; a name is unique among the keys not revoked (api_keys_live_name). */
export async function createApiKey(pool: pg.Pool, key: NewApiKey): Promise<ApiKey> {
  const { name, roles, secretHash, prefix, createdBy } = checkNewApiKey(key);
  try {
    const { rows } = await pool.query<Row>(
      `insert into asyncproc.api_keys as k (name, roles, secret_hash, prefix, created_by) values ($1, $2, $3, $4, $5)
       returning ${COLUMNS}`,
      [name, roles, secretHash, prefix, createdBy],
    );
    return toKey(rows[0]);
  } catch (error) {
    const { code, constraint } = error as { code?: string; constraint?: string };
    if (code === '23505') {
      const what = constraint === 'api_keys_live_name' ? `an API key named "${name}" exists already` : 'this secret is in use already';
      throw new EngineError('BAD_USER_INPUT', what, { cause: error });
    }
    throw error;
  }
}

/** Every key, revoked ones too, newest first. */
export async function listApiKeys(pool: pg.Pool): Promise<ApiKey[]> {
  const { rows } = await pool.query<Row>(`select ${COLUMNS} from asyncproc.api_keys k order by k.created_at desc, k.id`);
  return rows.map(toKey);
}

/**
 * Revoke once (a second revoke keeps the first time; a rotated key's overlap ends now);
 * NOT_FOUND for an id no key has.
 */
export async function revokeApiKey(pool: pg.Pool, id: string): Promise<ApiKey> {
  const { rows } = isUuid(id)
    ? await pool.query<Row>(
        `update asyncproc.api_keys k set revoked_at = least(coalesce(k.revoked_at, now()), now()) where k.id = $1::uuid returning ${COLUMNS}`,
        [id],
      )
    : { rows: [] };
  if (!rows[0]) throw noSuchApiKey(id);
  return toKey(rows[0]);
}

/**
 * A live key's successor, in one statement: the key's revoked_at set `overlapSeconds` ahead
 * (which also takes it out of api_keys_live_name, so the successor may have its name) and the
 * successor inserted from it. A rotation racing this one waits for the key's row, then finds it
 * no longer live and inserts nothing.
 */
export async function rotateApiKey(pool: pg.Pool, id: string, successor: ApiKeySecret, overlapSeconds: number): Promise<{ key: ApiKey; previous: ApiKey }> {
  const { secretHash, prefix, createdBy } = checkApiKeySecret(successor);
  const overlap = checkOverlap(overlapSeconds);
  if (!isUuid(id)) throw noSuchApiKey(id);
  const { rows } = await pool
    .query<Row & { previous: boolean }>(
      `with previous as (
         update asyncproc.api_keys k set revoked_at = now() + make_interval(secs => $2)
          where k.id = $1::uuid and k.revoked_at is null
         returning ${COLUMNS}
       ), made as (
         insert into asyncproc.api_keys as k (name, roles, secret_hash, prefix, created_by)
         select p.name, p.roles, $3, $4, $5 from previous p
         returning ${COLUMNS}
       )
       select true as previous, * from previous union all select false, * from made`,
      [id, overlap, secretHash, prefix, createdBy],
    )
    .catch((error: unknown) => {
      if ((error as { code?: string }).code === '23505') throw new EngineError('BAD_USER_INPUT', 'this secret is in use already', { cause: error });
      throw error;
    });
  const previous = rows.find((r) => r.previous);
  const made = rows.find((r) => !r.previous);
  if (previous && made) return { key: toKey(made), previous: toKey(previous) };
  const { rows: found } = await pool.query<Row>(`select ${COLUMNS} from asyncproc.api_keys k where k.id = $1::uuid`, [id]);
  throw notRotated(id, found[0] ? toKey(found[0]) : null);
}

/**
 * The live key with this hash, in one round trip. Its use is recorded at most once a
 * minute, so a busy key does not write on every request; the update re-checks
 * last_used_at on the row it locks, so callers at once write it once.
 */
export async function findApiKey(pool: pg.Pool, secretHash: string): Promise<ApiKey | null> {
  if (typeof secretHash !== 'string') return null;
  const { rows } = await pool.query<Row>(
    `with k as (select * from asyncproc.api_keys k where k.secret_hash = $1 and (k.revoked_at is null or k.revoked_at > now())),
          used as (update asyncproc.api_keys u set last_used_at = now()
                     from k
                    where u.id = k.id and (u.last_used_at is null or u.last_used_at < now() - interval '1 minute')
                   returning u.id, u.last_used_at)
     select k.id, k.name, k.roles, k.prefix, k.created_at, k.created_by,
            coalesce(used.last_used_at, k.last_used_at) as last_used_at, k.revoked_at
       from k left join used on used.id = k.id`,
    [secretHash],
  );
  return rows[0] ? toKey(rows[0]) : null;
}
