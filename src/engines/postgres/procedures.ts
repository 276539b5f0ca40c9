import type pg from 'pg';
import { checkRegisterRanges, EngineError, type ParameterMode, type Procedure, type RegisterOptions } from '../../engine.js';
import { checkRoles } from '../identity.js';
import { mapDatabaseError } from './errors.js';

interface ProcedureRow {
  name: string;
  queue: string;
  max_attempts: number;
  timeout_ms: number | null;
  roles: string[];
  transactional: boolean;
  parameters: { name: string; type: string; mode: ParameterMode; hasDefault: boolean; position: number }[];
}

/** Registered procedures (or only the one named), by name. */
export async function listProcedures(pool: pg.Pool, only: string | null = null): Promise<Procedure[]> {
  const { rows } = await pool.query<ProcedureRow>(
    `select r.name, r.queue, r.max_attempts, r.timeout_ms, r.roles, r.transactional,
            coalesce((select jsonb_agg(jsonb_build_object('name', p.name, 'type', p.type_name, 'mode', p.mode,
                                                          'hasDefault', p.has_default, 'position', p.position)
                                       order by p.position)
                        from asyncproc.parameters p
                       where p.proc = asyncproc.current_routine(r.proc, r.signature) and p.mode <> 'TABLE'), '[]') as parameters
       from asyncproc.procedures r
      where r.unregistered_at is null and ($1::text is null or r.name = $1)
      order by r.name`,
    [only],
  );
  return rows.map((r) => ({
    name: r.name,
    queue: r.queue,
    maxAttempts: r.max_attempts,
    timeoutMs: r.timeout_ms,
    roles: r.roles,
    transactional: r.transactional,
    parameters: r.parameters,
  }));
}

/** Register a routine; `name` is a signature (`demo.add(integer, integer, integer)`) or an unambiguous name. */
/**
 * SQLSTATEs of a name that is no routine name at all, from resolving it (to_regprocedure and
 * parse_ident in asyncproc.resolve_routine): not a valid identifier (22023), a syntax error in
 * a signature (42601), an unknown type in one (42704), a name with too many dots (42601, 3F000).
 */
const MALFORMED_NAME = new Set(['22023', '42601', '42602', '42704', '3F000']);

export async function registerProcedure(pool: pg.Pool, name: string, options: RegisterOptions = {}): Promise<Procedure> {
  checkRegisterRanges(options);
  const roles = checkRoles(options.roles);
  let registered: string;
  try {
    // by name or signature, resolved in the database (asyncproc.resolve_routine), so SQL callers get the same rules
    const { rows } = await pool.query<{ name: string }>(
      `select asyncproc.register($1::text, $2, $3, $4, $5::text[], $6) as name`,
      [name, options.queue ?? 'default', options.maxAttempts ?? 1, options.timeoutMs ?? null, roles, options.transactional ?? true],
    );
    registered = rows[0]?.name;
  } catch (error) {
    const code = (error as { code?: string }).code;
    if (code === '23503') {
      throw new EngineError('UNKNOWN_QUEUE', `queue "${options.queue}" does not exist`, { cause: error });
    }
    if (code && MALFORMED_NAME.has(code)) {
      throw new EngineError('BAD_USER_INPUT', `"${name.slice(0, 200)}" is not a routine name or signature: ${(error as Error).message}`, { cause: error });
    }
    throw mapDatabaseError(error);
  }
  if (!registered) throw new EngineError('UNKNOWN_PROCEDURE', `no routine "${name}" in the database`);
  const [found] = await listProcedures(pool, registered);
  if (!found) throw new EngineError('UNKNOWN_PROCEDURE', `no routine "${name}" in the database`);
  return found;
}

/** Withdraw a registration by its registered name; returns it as it was. NOT_FOUND when not registered. */
export async function unregisterProcedure(pool: pg.Pool, name: string): Promise<Procedure> {
  const [found] = await listProcedures(pool, name);
  try {
    await pool.query('select asyncproc.unregister($1)', [name]);
  } catch (error) {
    throw mapDatabaseError(error);
  }
  if (!found) throw new EngineError('NOT_FOUND', `procedure "${name}" is not registered`);
  return found;
}
