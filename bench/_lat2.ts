import { completionLatencies, startService } from './edge.js';
import { startDemoDatabase } from '../test/support/database.js';
const db = await startDemoDatabase();
const app = await startService(db.url);
const q = (l: number[], p: number) => l[Math.min(l.length - 1, Math.floor((l.length * p) / 100))].toFixed(2);
for (let round = 0; round < 2; round++) {
  for (const reconnect of [false, true] as const) {
    const l = await completionLatencies(app.endpoint, 500, reconnect);
    console.log(reconnect ? 'separate' : 'in-process', 'p50', q(l, 50), 'p99', q(l, 99));
  }
}
process.exit(0);
