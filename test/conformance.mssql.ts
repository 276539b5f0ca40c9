/**
 * The shared conformance suite against SQL Server, when MSSQL_URL names a database
 * with Service Broker enabled (docker compose up mssql gives one; see docs/mssql.md):
 *   MSSQL_URL='mssql://sa:…@localhost:1433/asyncproc?trustServerCertificate=true' \
 *     node --import tsx --test test/conformance.mssql.ts
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import sql from 'mssql';
import { createMssqlEngine } from '../src/engines/mssql/index.js';
import { ConnectionPool } from '../src/engines/mssql/pool.js';
import { parseMssqlUrl } from '../src/engines/mssql/url.js';
import { runConformance } from './conformance.js';

const url = process.env.MSSQL_URL;

if (url) {
  runConformance('mssql', async () => {
    // allowKill: the shared suite cancels a RUNNING call (the login needs ALTER ANY CONNECTION
    // and VIEW SERVER STATE; sa has both)
    const engine = await createMssqlEngine({ url, allowKill: true });
    try {
      await engine.migrate();
      await engine.installDemo();
    } catch (error) {
      await engine.close();
      throw error;
    }
    return {
      engine,
      ledgerCount: async (tag) => {
        const result = await engine.pool
          .request()
          .input('tag', sql.NVarChar(200), tag)
          .query<{ n: number }>('SELECT COUNT(*) AS n FROM demo.ledger WHERE tag = @tag');
        return Number(result.recordset[0].n);
      },
      second: () => createMssqlEngine({ url, allowKill: true }),
      close: () => engine.close(),
    };
  });

  describe('mssql queues', () => {
    it('configureQueue in another letter case on a case-insensitive database changes that queue and makes no second service', async () => {
      const engine = await createMssqlEngine({ url });
      try {
        const { recordset } = await engine.pool.request().query<{ ci: number }>(
          `SELECT CASE WHEN N'a' = N'A' THEN 1 ELSE 0 END AS ci`,
        );
        await engine.configureQueue('case_queue', 2);
        await engine.configureQueue('Case_Queue', 3);
        const services = await engine.pool
          .request()
          .query<{ n: number }>(`SELECT COUNT(*) AS n FROM sys.services WHERE LOWER(name) = N'asyncexec/service/case_queue'`);
        // a case-sensitive database has two queues, each with its service
        assert.equal(services.recordset[0].n, recordset[0].ci === 1 ? 1 : 2);
      } finally {
        await engine.close();
      }
    });
  });

  describe('mssql pools', () => {
    it('a request cut by its requestTimeout inside a transaction (XACT_ABORT OFF) leaves nothing open for the next request', async () => {
      let closed = 0;
      // one connection: the next request would get the same one back
      const pool = new ConnectionPool({ ...parseMssqlUrl(url).config, requestTimeout: 1000, pool: { min: 0, max: 1 } }, () => closed++);
      await pool.connect();
      try {
        const cut = pool.request().batch("SET XACT_ABORT OFF; BEGIN TRANSACTION; WAITFOR DELAY '00:00:05';");
        await assert.rejects(cut, (error: { code?: string }) => error.code === 'ETIMEOUT');
        const { recordset } = await pool.request().query<{ open: number }>('SELECT @@TRANCOUNT AS [open]');
        assert.equal(recordset[0].open, 0, 'no transaction open on the connection handed out next');
        assert.equal(closed, 1, 'the connection left with the open transaction was closed');
      } finally {
        await pool.close();
      }
    });
  });
} else {
  describe('conformance: mssql', () => {
    it('runs against SQL Server', { skip: 'set MSSQL_URL to a database with Service Broker enabled' }, () => undefined);
  });
}
