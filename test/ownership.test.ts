/**
 * The completion hub filters live events by submittedBy as the engine's reads do: a plain
 * caller's event stream carries its own executions only (the engine-level filters are in
 * the conformance suite).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { CompletionHub } from '../src/completionHub.js';
import { isTerminal, type Closeable, type ExecutionEvent } from '../src/engine.js';
import { silentLogger } from '../src/logger.js';
import { startDemoDatabase, type DemoDatabase } from './support/database.js';

describe('ownership: event streams', () => {
  let db: DemoDatabase;
  let hub: CompletionHub;
  let listener: Closeable;
  let activator: Closeable;

  before(async () => {
    db = await startDemoDatabase();
    hub = new CompletionHub(db.engine, silentLogger);
    await hub.start();
    listener = await db.engine.startListener(hub);
    activator = await db.engine.startActivator({ workerId: 'ownership' });
  });
  after(async () => {
    await activator?.close();
    await listener?.close();
    await hub?.close();
    await db?.engine.close();
    await db?.sql.end();
    await db?.cluster.stop();
  });

  it("a stream filtered by submittedBy carries that subject's executions only, exactly", async () => {
    const stream = hub.events({ submittedBy: 'alice' }, null);
    const seen: ExecutionEvent[] = [];
    const { engine } = db;
    const [mine] = await engine.withTransaction(async (tx) => [
      await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 1 }, submittedBy: 'alice' }),
      await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 2 }, submittedBy: 'bob' }),
      await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 3 }, submittedBy: 'Alice' }),
      await engine.invoke(tx, { procedure: 'demo.add', arguments: { a: 1, b: 4 } }),
    ]);
    for await (const event of stream) {
      seen.push(event);
      if (event.execution.token === mine.token && isTerminal(event.status)) break;
    }
    // the others ran in the same transaction's wake: give their events time to arrive, wrongly
    const late = hub.events({ submittedBy: 'alice' }, seen[0].cursor);
    const timer = setTimeout(() => void late.return?.(), 1500);
    for await (const event of late) seen.push(event);
    clearTimeout(timer);
    assert.ok(seen.some((e) => e.execution.token === mine.token));
    assert.deepEqual([...new Set(seen.map((e) => e.execution.submittedBy))], ['alice']);
  });
});
