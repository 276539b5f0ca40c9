/**
 * The shared conformance suite against SQL Server, when MSSQL_URL names a database
 * with Service Broker enabled (docker compose up mssql gives one; see docs/mssql.md):
 *   MSSQL_URL='mssql://sa:…@localhost:1433/asyncproc?trustServerCertificate=true' \
 *     node --import tsx --test test/conformance.mssql.ts
 */
import { describe, it } from 'node:test';
import sql from 'mssql';
import { createMssqlEngine } from '../src/engines/mssql/index.js';
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
} else {
  describe('conformance: mssql', () => {
    it('runs against SQL Server', { skip: 'set MSSQL_URL to a database with Service Broker enabled' }, () => undefined);
  });
}
