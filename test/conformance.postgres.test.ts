import { after } from 'node:test';
import { createPostgresEngine } from '../src/engines/postgres/index.js';
import { runConformance } from './conformance.js';
import { startDemoDatabase, type DemoDatabase } from './support/database.js';

let db: DemoDatabase | undefined;
after(async () => {
  await db?.sql.end();
  await db?.cluster.stop();
});

runConformance('postgres', async () => {
  db = await startDemoDatabase();
  const { engine, sql } = db;
  return {
    engine,
    ledgerCount: async (tag) => Number((await sql.query<{ n: string }>('select count(*) as n from demo.ledger where tag = $1', [tag])).rows[0].n),
    second: async () => createPostgresEngine({ connectionString: db!.url }),
    close: () => engine.close(),
  };
});
