/**
 * An upgraded database has exactly the objects of a fresh one (SQL Server), when MSSQL_URL
 * names a server (the login must be able to CREATE and DROP DATABASE; sa can):
 *   MSSQL_URL='mssql://sa:…@localhost:1433/asyncproc?trustServerCertificate=true' \
 *     node --import tsx --test test/upgrade.mssql.ts
 *
 * Two scratch databases are made on that server (and dropped after). The first is built as
 * the releases before sql/mssql/procedures/ built it: the migrator of that time applied
 * 0001-0009, each script's GO batches in one transaction, recorded in
 * asyncexec.AsyncExecSchemaVersions, nothing else. The current migrator then upgrades it
 * (0010 and every procedure file, ALTERing the objects 0001-0009 made). The second is
 * migrated fresh. Then everything of ours must be equal: OBJECT_DEFINITION and module
 * settings of every object of schemas asyncexec and dbo, columns, indexes, constraints,
 * queues (activation, readers, poison handling), services, contracts, message types,
 * permissions, and the rows the migrator and 0005 write. The PostgreSQL counterpart is
 * test/upgrade.test.ts.
 */
import assert from 'node:assert/strict';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import sql from 'mssql';
import { splitBatches } from '../src/engines/mssql/batches.js';
import { migrate, MSSQL_SQL_DIR, VERSIONS_TABLE } from '../src/engines/mssql/migrator.js';
import { parseMssqlUrl } from '../src/engines/mssql/url.js';

const url = process.env.MSSQL_URL;

/** The landed scripts the migrator applied before procedure files existed. */
const OLD_LAST_VERSION = 9;

/** Our objects: schemas asyncexec and dbo, not shipped by Microsoft. */
const OURS = `o.is_ms_shipped = 0 AND SCHEMA_NAME(o.schema_id) IN (N'asyncexec', N'dbo')`;

/** Named catalog queries; each orders its rows, and names no id that differs between databases. */
const CATALOG: Record<string, string> = {
  triggers: `
    SELECT OBJECT_NAME(t.parent_id) AS [table], t.name, t.is_disabled, t.is_instead_of_trigger, t.is_not_for_replication,
           (SELECT STRING_AGG(e.type_desc, N', ') WITHIN GROUP (ORDER BY e.type_desc) FROM sys.trigger_events AS e WHERE e.object_id = t.object_id) AS events
      FROM sys.triggers AS t
     WHERE t.parent_class = 1 AND OBJECT_SCHEMA_NAME(t.parent_id) IN (N'asyncexec', N'dbo')
     ORDER BY 1, 2`,
  routinesRevision: `SELECT only_row, revision FROM asyncexec.AsyncExecRoutinesRevision`,
  objects: `
    SELECT SCHEMA_NAME(o.schema_id) AS [schema], o.name, o.type, OBJECT_NAME(o.parent_object_id) AS parent,
           OBJECT_DEFINITION(o.object_id) AS definition,
           m.uses_ansi_nulls, m.uses_quoted_identifier, m.is_schema_bound,
           USER_NAME(m.execute_as_principal_id) AS execute_as, USER_NAME(OBJECTPROPERTY(o.object_id, 'OwnerId')) AS owner
      FROM sys.objects AS o LEFT JOIN sys.sql_modules AS m ON m.object_id = o.object_id
     WHERE ${OURS} AND o.type <> 'IT'
     ORDER BY [schema], o.name`,
  columns: `
    SELECT OBJECT_NAME(c.object_id) AS [table], c.column_id, c.name, TYPE_NAME(c.user_type_id) AS type, c.max_length,
           c.precision, c.scale, c.is_nullable, c.is_identity, c.is_rowguidcol, c.is_computed, c.collation_name,
           OBJECT_NAME(c.default_object_id) AS [default], dc.definition AS default_definition
      FROM sys.columns AS c
      JOIN sys.objects AS o ON o.object_id = c.object_id
      LEFT JOIN sys.default_constraints AS dc ON dc.object_id = c.default_object_id
     WHERE ${OURS} AND o.type IN ('U', 'V')
     ORDER BY [table], c.column_id`,
  indexes: `
    SELECT OBJECT_NAME(i.object_id) AS [table], i.name, i.type_desc, i.is_unique, i.is_primary_key, i.is_unique_constraint,
           i.has_filter, i.filter_definition, i.ignore_dup_key, i.fill_factor,
           (SELECT STRING_AGG(CONCAT(COL_NAME(ic.object_id, ic.column_id), CASE WHEN ic.is_descending_key = 1 THEN N' DESC' END,
                                     CASE WHEN ic.is_included_column = 1 THEN N' (included)' END), N', ')
                   WITHIN GROUP (ORDER BY ic.is_included_column, ic.key_ordinal, ic.column_id)
              FROM sys.index_columns AS ic WHERE ic.object_id = i.object_id AND ic.index_id = i.index_id) AS columns
      FROM sys.indexes AS i JOIN sys.objects AS o ON o.object_id = i.object_id
     WHERE ${OURS} AND o.type = 'U' AND i.type > 0
     ORDER BY [table], i.name`,
  checks: `
    SELECT OBJECT_NAME(k.parent_object_id) AS [table], k.name, k.definition, k.is_disabled, k.is_not_trusted
      FROM sys.check_constraints AS k JOIN sys.objects AS o ON o.object_id = k.object_id
     WHERE ${OURS}
     ORDER BY [table], k.name`,
  foreignKeys: `
    SELECT OBJECT_NAME(f.parent_object_id) AS [table], f.name, OBJECT_NAME(f.referenced_object_id) AS referenced,
           f.delete_referential_action_desc, f.update_referential_action_desc, f.is_disabled, f.is_not_trusted,
           (SELECT STRING_AGG(CONCAT(COL_NAME(fc.parent_object_id, fc.parent_column_id), N'->',
                                     COL_NAME(fc.referenced_object_id, fc.referenced_column_id)), N', ')
                   WITHIN GROUP (ORDER BY fc.constraint_column_id)
              FROM sys.foreign_key_columns AS fc WHERE fc.constraint_object_id = f.object_id) AS columns
      FROM sys.foreign_keys AS f JOIN sys.objects AS o ON o.object_id = f.object_id
     WHERE ${OURS}
     ORDER BY [table], f.name`,
  queues: `
    SELECT q.name, q.max_readers,
           -- sys.service_queues names the procedure with its database: keep schema.procedure
           PARSENAME(q.activation_procedure, 2) + N'.' + PARSENAME(q.activation_procedure, 1) AS activation_procedure, USER_NAME(q.execute_as_principal_id) AS execute_as,
           q.is_activation_enabled, q.is_receive_enabled, q.is_enqueue_enabled, q.is_retention_enabled,
           q.is_poison_message_handling_enabled
      FROM sys.service_queues AS q JOIN sys.objects AS o ON o.object_id = q.object_id
     WHERE ${OURS}
     ORDER BY q.name`,
  services: `
    SELECT s.name, OBJECT_NAME(s.service_queue_id) AS queue, USER_NAME(s.principal_id) AS owner,
           (SELECT STRING_AGG(c.name, N', ') WITHIN GROUP (ORDER BY c.name)
              FROM sys.service_contract_usages AS u JOIN sys.service_contracts AS c ON c.service_contract_id = u.service_contract_id
             WHERE u.service_id = s.service_id) AS contracts
      FROM sys.services AS s WHERE s.name NOT LIKE N'http://schemas.microsoft.com/%'
     ORDER BY s.name`,
  contracts: `
    SELECT c.name, m.name AS message_type, u.is_sent_by_initiator, u.is_sent_by_target
      FROM sys.service_contracts AS c
      JOIN sys.service_contract_message_usages AS u ON u.service_contract_id = c.service_contract_id
      JOIN sys.service_message_types AS m ON m.message_type_id = u.message_type_id
     WHERE c.name NOT LIKE N'http://schemas.microsoft.com/%'
     ORDER BY c.name, m.name`,
  messageTypes: `
    SELECT name, validation_desc FROM sys.service_message_types
     WHERE name NOT LIKE N'http://schemas.microsoft.com/%' ORDER BY name`,
  permissions: `
    SELECT p.class_desc, CASE p.class WHEN 1 THEN OBJECT_SCHEMA_NAME(p.major_id) + N'.' + OBJECT_NAME(p.major_id)
                                      WHEN 3 THEN SCHEMA_NAME(p.major_id) END AS securable,
           COL_NAME(p.major_id, p.minor_id) AS [column], USER_NAME(p.grantee_principal_id) AS grantee,
           p.permission_name, p.state_desc
      FROM sys.database_permissions AS p
     WHERE (p.class = 1 AND OBJECT_SCHEMA_NAME(p.major_id) IN (N'asyncexec', N'dbo'))
        OR (p.class = 3 AND SCHEMA_NAME(p.major_id) IN (N'asyncexec', N'dbo'))
     ORDER BY 1, 2, 3, 4, 5`,
  signatures: `
    SELECT OBJECT_NAME(cp.major_id) AS object, cp.crypt_type_desc
      FROM sys.crypt_properties AS cp WHERE cp.class = 1 ORDER BY 1, 2`,
  schemas: `
    SELECT name, USER_NAME(principal_id) AS owner FROM sys.schemas WHERE name IN (N'asyncexec', N'dbo') ORDER BY name`,
  versions: `SELECT version, name FROM asyncexec.AsyncExecSchemaVersions ORDER BY version`,
  procedureFiles: `SELECT name, sha256 FROM asyncexec.AsyncExecRoutines ORDER BY name`,
  queueRows: `SELECT name, concurrency, queue_object, service_name, activation_procedure FROM asyncexec.AsyncExecQueues ORDER BY name`,
};

async function withPool<T>(config: sql.config, fn: (pool: sql.ConnectionPool) => Promise<T>): Promise<T> {
  const pool = new sql.ConnectionPool({ ...config, pool: { min: 0, max: 1 } });
  await pool.connect();
  try {
    return await fn(pool);
  } finally {
    await pool.close();
  }
}

async function catalog(config: sql.config): Promise<Record<string, unknown[]>> {
  return withPool(config, async (pool) => {
    const result: Record<string, unknown[]> = {};
    for (const [name, query] of Object.entries(CATALOG)) result[name] = (await pool.request().query(query)).recordset;
    return result;
  });
}

/** What the migrator did before sql/mssql/procedures/ existed, with the scripts it had (0001-0009). */
async function migrateAsBeforeProcedureFiles(config: sql.config): Promise<void> {
  const files = (await readdir(MSSQL_SQL_DIR)).filter((f) => /^\d{4}_.+\.sql$/.test(f) && Number(f.slice(0, 4)) <= OLD_LAST_VERSION).sort();
  assert.equal(files.length, OLD_LAST_VERSION);
  await withPool({ ...config, requestTimeout: 0 }, async (pool) => {
    await pool.request().batch(VERSIONS_TABLE);
    for (const file of files) {
      const text = await readFile(path.join(MSSQL_SQL_DIR, file), 'utf8');
      const tx = new sql.Transaction(pool);
      await tx.begin();
      try {
        for (const batch of splitBatches(text)) {
          for (let i = 0; i < batch.repeat; i++) await new sql.Request(tx).batch(batch.text);
        }
        await new sql.Request(tx)
          .input('version', sql.Int, Number(file.slice(0, 4)))
          .input('name', sql.NVarChar(260), file)
          .query('INSERT asyncexec.AsyncExecSchemaVersions (version, name) VALUES (@version, @name)');
        await tx.commit();
      } catch (error) {
        await tx.rollback().catch(() => undefined);
        throw new Error(`${file}: ${(error as Error).message}`, { cause: error });
      }
    }
  });
}

if (url) {
  const { config } = parseMssqlUrl(url);
  const scratch = [`asyncproc_upgrade_${process.pid}_old`, `asyncproc_upgrade_${process.pid}_new`];
  const on = (database: string): sql.config => ({ ...config, database });

  before(async () => {
    await withPool({ ...config, requestTimeout: 120_000 }, async (pool) => {
      for (const name of scratch) {
        await pool.request().batch(`CREATE DATABASE ${quote(name)};`);
        await pool.request().batch(`ALTER DATABASE ${quote(name)} SET ENABLE_BROKER WITH ROLLBACK IMMEDIATE;`);
      }
    });
  });
  after(async () => {
    await withPool({ ...config, requestTimeout: 120_000 }, async (pool) => {
      for (const name of scratch) {
        await pool
          .request()
          .batch(`IF DB_ID(N'${name}') IS NOT NULL BEGIN
                    ALTER DATABASE ${quote(name)} SET SINGLE_USER WITH ROLLBACK IMMEDIATE;
                    DROP DATABASE ${quote(name)};
                  END;`)
          .catch(() => undefined);
      }
    });
  });

  describe('upgrade (SQL Server)', () => {
    it('gives a database built before procedure files exactly the objects of a fresh one', async () => {
      const [upgraded, fresh] = scratch.map(on);
      await migrateAsBeforeProcedureFiles(upgraded);
      const result = await migrate(upgraded);
      assert.deepEqual(result.versions.filter((v) => v <= OLD_LAST_VERSION), [], 'the landed scripts are not applied again');
      assert.ok(result.procedures.length > 0, 'the procedure files ALTER what 0001-0009 made');
      const again = await migrate(upgraded);
      assert.deepEqual(again, { versions: [], procedures: [] }, 'a second run applies nothing');

      await migrate(fresh);
      const [a, b] = await Promise.all([catalog(upgraded), catalog(fresh)]);
      assert.ok(b.objects.some((o) => (o as { definition: string | null }).definition?.includes('usp_AsyncExecActivated')), 'the comparison sees the modules');
      for (const part of Object.keys(CATALOG)) {
        assert.deepEqual(a[part], b[part], `${part}: upgraded (left) and fresh (right) differ`);
      }
    });

    it("a service of an older release started after the upgrade refuses to start, and ALTERs no procedure", async () => {
      const [, database] = scratch.map(on);
      await migrate(database);
      await withPool(database, async (pool) => {
        const definition = async () => (await pool.request().query(`SELECT OBJECT_DEFINITION(OBJECT_ID(N'asyncexec.usp_AsyncExecPurge')) AS d`)).recordset[0].d;
        const before = await definition();
        // the previous release's migrator: no revision said, its older file applied and recorded, in one transaction
        const tx = new sql.Transaction(pool);
        await tx.begin();
        await new sql.Request(tx).batch(`CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPurge @olderThanSeconds int AS SELECT 0 AS deleted, 0 AS more;`);
        await assert.rejects(
          new sql.Request(tx).query(`UPDATE asyncexec.AsyncExecRoutines SET sha256 = REPLICATE('0', 64) WHERE name = N'usp_AsyncExecPurge.sql'`),
          (e: any) => e.number === 50046 && /newer asyncproc/.test(e.message),
        );
        await tx.rollback().catch(() => undefined); // the trigger's THROW may have rolled it back already
        assert.equal(await definition(), before, 'the newer definition stays');
        // one that knows revisions, older than the database's: refused before anything is applied
        await pool.request().query(`UPDATE asyncexec.AsyncExecRoutinesRevision SET revision = revision + 1`);
      });
      await assert.rejects(migrate(database), /installed by a newer asyncproc.*downgrade is not supported/);
    });
  });
} else {
  describe('upgrade (SQL Server)', () => {
    it('gives a database built before procedure files exactly the objects of a fresh one', { skip: 'set MSSQL_URL to a SQL Server whose login may CREATE DATABASE' }, () => undefined);
    it("a service of an older release started after the upgrade refuses to start, and ALTERs no procedure", { skip: 'set MSSQL_URL to a SQL Server whose login may CREATE DATABASE' }, () => undefined);
  });
}

function quote(name: string): string {
  return `[${name.replace(/]/g, ']]')}]`;
}
