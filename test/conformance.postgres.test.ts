import { after } from 'node:test';
import { createPostgresEngine } from '../src/engines/postgres/index.js';
import { runConformance } from './conformance.js';
import { startTestCluster, type TestCluster } from './support/database.js';

let cluster: TestCluster | undefined;
after(() => cluster?.stop());

runConformance('postgres', async () => {
  cluster = await startTestCluster();
  const url = await cluster.createDatabase();
  const engine = createPostgresEngine({ connectionString: url });
  await engine.migrate();
  await engine.installDemo();
  return {
    engine,
    ledgerCount: async (tag) =>
      Number((await engine.pool.query<{ n: string }>('select count(*) as n from demo.ledger where tag = $1', [tag])).rows[0].n),
    close: () => engine.close(),
  };
});
