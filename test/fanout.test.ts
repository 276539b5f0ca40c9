/**
 * Fan-out to many subscribers: a subscriber that stops reading its socket is stopped with
 * SLOW_CONSUMER once the hub holds more than its bound for it, never waited for; the others hear every
 * event meanwhile, and the stalled one, resuming from its last cursor, misses nothing.
 */
import assert from 'node:assert/strict';
import { fork } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
import WebSocket, { WebSocketServer } from 'ws';
import { CompletionHub } from '../src/completionHub.js';
import { EngineError, type ExecutionEvent } from '../src/engine.js';
import { silentLogger } from '../src/logger.js';
import { sleep, startDemoDatabase, waitFor, type DemoDatabase } from './support/database.js';
import { collect, startTestApp, type TestApp } from './support/app.js';

let db: DemoDatabase;
let t: TestApp;
/**
 * Changes a stream may hold for its subscriber: well under the 2,700 changes the stalled one is sent,
 * and room for the healthy ones.
 */
const QUEUE = 1000;

before(async () => {
  db = await startDemoDatabase();
  t = await startTestApp(db.url, { ASYNCPROC_MAX_SUBSCRIBER_QUEUE: String(QUEUE) });
});

/** A graphql-transport-ws socket of our own, past connection_ack; `messages`: every later message it receives. */
async function rawClient(): Promise<{ socket: WebSocket; messages: any[] }> {
  const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
  const messages: any[] = [];
  const acked = new Promise<void>((resolve) =>
    socket.on('message', (data) => {
      const message = JSON.parse(String(data));
      if (message.type === 'connection_ack') resolve();
      else messages.push(message);
    }),
  );
  await new Promise((resolve) => socket.once('open', resolve));
  socket.send(JSON.stringify({ type: 'connection_init' }));
  await acked;
  return { socket, messages };
}

after(async () => {
  await t?.stop();
  await db?.engine.close();
  await db?.sql.end();
  await db?.cluster.stop();
});

const EVENTS = `subscription($f: ExecutionFilter, $after: String) {
  executionEvents(filter: $f, after: $after) { cursor status execution { token status arguments } } }`;

interface Heard {
  /** SUCCEEDED events per token. */
  succeeded: Map<string, number>;
  cursor: string | null;
  errors: { message: string; extensions?: { code?: string } }[];
}

function hear(heard: Heard, event: { cursor: string; status: string; execution: { token: string } }): void {
  if (event.status === 'SUCCEEDED') heard.succeeded.set(event.execution.token, (heard.succeeded.get(event.execution.token) ?? 0) + 1);
  heard.cursor = event.cursor;
}

/** A graphql-transport-ws client by hand, so that the test can stop reading its TCP socket. */
async function rawSubscriber(url: string, variables: Record<string, unknown>) {
  const socket = new WebSocket(url.replace(/^http/, 'ws'), 'graphql-transport-ws');
  const heard: Heard = { succeeded: new Map(), cursor: null, errors: [] };
  let ended = false;
  const acked = new Promise<void>((resolve, reject) => {
    socket.on('error', reject);
    socket.on('message', (data) => {
      const message = JSON.parse(String(data));
      if (message.type === 'connection_ack') resolve();
      else if (message.type === 'next') hear(heard, message.payload.data.executionEvents);
      else if (message.type === 'error') heard.errors.push(...message.payload);
      else if (message.type === 'complete') ended = true;
    });
  });
  await new Promise((resolve) => socket.once('open', resolve));
  socket.send(JSON.stringify({ type: 'connection_init' }));
  await acked;
  socket.send(JSON.stringify({ id: '1', type: 'subscribe', payload: { query: EVENTS, variables } }));
  const tcp = (socket as unknown as { _socket: import('node:net').Socket })._socket;
  return { socket, heard, tcp, ended: () => ended };
}

describe('a stalled executionEvents subscriber', () => {
  it('is stopped with SLOW_CONSUMER past its queue bound while the others hear every event; resuming from its last cursor it misses nothing', async () => {
    const filter = { procedure: 'demo.record' };
    const start = (await t.gql(`{ changeCursor }`)).body.data.changeCursor;
    const streams = t.app.hub!.size;
    // three healthy subscribers in a process of their own (the fan-out bench's): in this one they would
    // share the server's core, and under a loaded full-suite run one fell past the bound (1,000 changes)
    const others = fork(fileURLToPath(new URL('../bench/fanoutClients.mjs', import.meta.url)), [
      JSON.stringify({ url: t.url, subscribers: 3, after: start, timeoutMs: 120_000 }),
    ]);
    const answers: any[] = [];
    others.on('message', (message) => answers.push(message));
    await waitFor(async () => answers.length > 0 || null, 15_000, 'the subscribers\' process to start');
    const stalled = await rawSubscriber(t.url, { f: filter, after: start });
    await waitFor(async () => t.app.hub!.size === streams + 4, 15_000, 'four subscriptions');
    // the stalled client stops reading: what the server sends it piles up in the kernel, then in the server
    stalled.tcp.pause();

    // each event carries ~8 KB of arguments: 900 calls × 3 events is far more than the kernel's socket buffers
    const total = 900;
    const tokens: string[] = [];
    const tag = 'x'.repeat(8000);
    for (let n = 0; n < total; n += 50) {
      const inputs = Array.from({ length: 50 }, (_, i) => ({ procedure: 'demo.record', arguments: { tag: `${n + i}-${tag}` } }));
      const { body } = await t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, { i: inputs });
      assert.equal(body.errors, undefined, JSON.stringify(body.errors));
      tokens.push(...body.data.invokeMany.executions.map((e: { token: string }) => e.token));
    }

    // while it is stalled: its subscription ends on the server, and the others hear every completion once
    await waitFor(async () => t.app.hub!.size === streams + 3, 120_000, 'the stalled subscription to be stopped');
    others.send({ expect: tokens });
    await waitFor(async () => answers.length > 1 || null, 120_000, 'the others to hear every completion');
    assert.ok(stalled.tcp.isPaused(), 'the stalled client was still stalled');
    for (const [i, other] of (answers[1].results as { missing: number; repeats: number; errors: string[] }[]).entries()) {
      assert.deepEqual([other.missing, other.repeats, other.errors], [0, 0, []], `subscriber ${i}`);
    }

    // reading again, it gets what was sent before the bound was passed, then SLOW_CONSUMER
    stalled.tcp.resume();
    await waitFor(async () => stalled.heard.errors.length > 0, 30_000, 'the SLOW_CONSUMER error');
    assert.equal(stalled.heard.errors[0].extensions?.code, 'SLOW_CONSUMER', JSON.stringify(stalled.heard.errors));
    assert.ok(stalled.heard.succeeded.size < total, `the stalled client heard ${stalled.heard.succeeded.size} of ${total} before it was stopped`);
    stalled.socket.close();

    // from its last cursor it gets everything it missed: every completion heard, a repeat only where
    // the cursor fell between two changes of one transaction (at most one for one resume)
    const resumed = t.ws().iterate({ query: EVENTS, variables: { f: { ...filter, status: ['SUCCEEDED'] }, after: stalled.heard.cursor ?? start } });
    const missing = tokens.filter((token) => !stalled.heard.succeeded.has(token)).length;
    for (const result of await collect(resumed as AsyncIterableIterator<any>, missing, 60_000)) {
      assert.equal(result.errors, undefined, JSON.stringify(result.errors));
      hear(stalled.heard, result.data.executionEvents);
    }
    await waitFor(async () => tokens.every((token) => stalled.heard.succeeded.has(token)), 30_000, 'the resumed client to hear every completion');
    const repeats = [...stalled.heard.succeeded.values()].reduce((sum, n) => sum + n - 1, 0);
    assert.ok(repeats <= 1, `${repeats} completions heard twice across one resume`);
  });
});

describe('an event stream whose subscriber does not pull (any transport)', () => {
  it('holds at most its bound of queued changes, then ends with SLOW_CONSUMER after what it holds', async () => {
    const hub = new CompletionHub(db.engine, silentLogger, { pollMs: 50, maxQueued: 100 });
    await hub.start();
    try {
      const iterator = hub.events({ status: null, procedure: 'demo.noop', queue: null, submittedBy: null }, null);
      await waitFor(async () => hub.size === 1, 5000, 'the stream to join');
      await t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, {
        i: Array.from({ length: 300 }, () => ({ procedure: 'demo.noop' })),
      });
      // nobody pulls: past the bound the stream leaves the hub, holding what it had
      await waitFor(async () => hub.size === 0, 30_000, 'the stream to be stopped');
      const events: ExecutionEvent[] = [];
      let error: unknown;
      try {
        for await (const event of iterator) events.push(event);
      } catch (caught) {
        error = caught;
      }
      assert.ok(error instanceof EngineError && error.code === 'SLOW_CONSUMER', String(error));
      assert.ok(events.length > 0 && events.length <= 100 + 300, `${events.length} events held`);
    } finally {
      await hub.close();
    }
  });

  it('one stopped during its replay leaves the hub too, and lets go of what it buffered', async () => {
    const cursor = (await t.gql(`{ changeCursor }`)).body.data.changeCursor as string;
    const calls = (n: number) =>
      t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, { i: Array.from({ length: n }, () => ({ procedure: 'demo.noop' })) });
    // more than two replay pages (500 each) of changes behind the cursor (a replay reads each call's latest state), all ended
    for (let i = 0; i < 12; i++) await calls(100);
    await waitFor(async () => (await t.gql(`{ executions(filter: { status: [PENDING, RUNNING, WAITING] }) { totalCount } }`)).body.data.executions.totalCount === 0, 30_000, 'the calls to end');
    const hub = new CompletionHub(db.engine, silentLogger, { pollMs: 50, maxQueued: 100 });
    await hub.start();
    try {
      // resumed from before them, and never pulled: the replay waits for room its subscriber never makes
      const iterator = hub.events({ status: null, procedure: 'demo.noop', queue: null, submittedBy: null }, cursor);
      await waitFor(async () => hub.size === 1, 5000, 'the stream to join');
      await new Promise((resolve) => setTimeout(resolve, 500));
      // live changes meanwhile: past its bound it is stopped with SLOW_CONSUMER, and leaves
      await calls(50);
      await waitFor(async () => hub.size === 0, 15_000, `the stream stopped during its replay to leave the hub (it holds ${hub.size})`);
      let error: unknown;
      try {
        for await (const _event of iterator) void _event;
      } catch (caught) {
        error = caught;
      }
      assert.ok(error instanceof EngineError && error.code === 'SLOW_CONSUMER', String(error));
    } finally {
      await hub.close();
    }
  });
});

describe('executionCompleted subscribers', () => {
  const COMPLETED = `subscription($token: ID!) { executionCompleted(token: $token) { token status } }`;
  const invoke = async (input: Record<string, unknown>) => {
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: input });
    assert.equal(body.errors, undefined, JSON.stringify(body.errors));
    return body.data.invoke.execution.token as string;
  };

  it('hear the end once, then the stream completes; one that leaves first lets go of its watch', async () => {
    const streams = t.app.hub!.size;
    // a call due in an hour: its subscriber leaves before it ends
    const later = await invoke({ procedure: 'demo.noop', runAt: new Date(Date.now() + 3_600_000).toISOString() });
    const leaving = t.ws().iterate({ query: COMPLETED, variables: { token: later } });
    const first = leaving.next();
    await waitFor(async () => t.app.hub!.size === streams + 1, 5000, 'the waiting subscription to join');
    await leaving.return?.();
    await first;
    await waitFor(async () => t.app.hub!.size === streams, 5000, 'the left subscription to let go of its watch');

    const soon = await invoke({ procedure: 'demo.sleep', arguments: { seconds: 0.3 } });
    const staying = t.ws().iterate({ query: COMPLETED, variables: { token: soon } });
    const results = await collect(staying as AsyncIterableIterator<any>, Infinity, 30_000);
    assert.deepEqual(results.map((r) => r.data?.executionCompleted), [{ token: soon, status: 'SUCCEEDED' }]);
    await waitFor(async () => t.app.hub!.size === streams, 5000, 'the ended subscription to let go of its watch');
  });
});

describe('subscribers that leave at once', () => {
  it('a `complete` sent with the `subscribe`, or a socket closed right after it, leaves no stream or watch behind and gets no event', async () => {
    const streams = t.app.hub!.size;
    const { body } = await t.gql(`mutation { invoke(input: { procedure: "demo.noop", runAt: "${new Date(Date.now() + 3_600_000).toISOString()}" }) { execution { token } } }`);
    const token = body.data.invoke.execution.token as string;
    const operations = [
      { query: `subscription { executionEvents { status } }` },
      { query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: token } },
    ];
    const sockets = await Promise.all(
      Array.from({ length: 40 }, async (_, i) => {
        const { socket, messages: after } = await rawClient();
        const operation = operations[i % 2];
        // half complete in the same breath as they subscribe; the others close the socket at once
        socket.send(JSON.stringify({ id: 's', type: 'subscribe', payload: operation }));
        if (i % 4 < 2) socket.send(JSON.stringify({ id: 's', type: 'complete' }));
        else socket.close();
        return { socket, after, closing: i % 4 >= 2 };
      }),
    );
    // the subscriptions resolve after the complete (their first read), and must then let go
    await waitFor(async () => t.app.hub!.size === streams, 10_000, 'every left subscription to let go of its stream or watch');
    // an event after they left reaches none of them
    await t.gql(`mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }`);
    await new Promise((resolve) => setTimeout(resolve, 500));
    for (const { socket, after, closing } of sockets) {
      if (!closing) assert.deepEqual(after.filter((m) => m.type === 'next'), [], 'no event after its complete');
      socket.close();
    }
    assert.equal(t.app.hub!.size, streams);
  });
});

describe('fields an event reads afresh', () => {
  it("each event of a long-lived subscription reads its execution's history as of that event, not as of the first", async () => {
    await db.sql.query(`create schema if not exists fantest;
      create or replace procedure fantest.fail_once_more(message text) language plpgsql as $$
      begin raise exception '%', message using errcode = '22023'; end $$`);
    await db.engine.registerProcedure('fantest.fail_once_more', { maxAttempts: 2 });
    const streams = t.app.hub!.size;
    const stream = t.ws().iterate({
      query: `subscription($f: ExecutionFilter) { executionEvents(filter: $f) { status execution { history { status } } } }`,
      variables: { f: { procedure: 'fantest.fail_once_more' } },
    }) as AsyncIterableIterator<any>;
    const first = stream.next();
    await waitFor(async () => t.app.hub!.size === streams + 1, 5000, 'the subscription to join');
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, {
      i: { procedure: 'fantest.fail_once_more', arguments: { message: 'not yet' } },
    });
    assert.equal(body.errors, undefined, JSON.stringify(body.errors));
    // PENDING, RUNNING, WAITING (the first attempt failed), PENDING, RUNNING, FAILED
    // the first event loads the history as it is then; the end must be read as it is at the end
    const events: { status: string; execution: { history: { status: string }[] } }[] = [];
    for (let step = await first; !step.done; step = await stream.next()) {
      assert.equal(step.value.errors, undefined, JSON.stringify(step.value.errors));
      events.push(step.value.data.executionEvents);
      if (events.at(-1)!.status === 'FAILED') break;
    }
    await stream.return?.();
    assert.ok(events.length >= 2, JSON.stringify(events));
    assert.ok(events[0].execution.history.length <= 1, JSON.stringify(events[0]));
    assert.deepEqual(events.at(-1)!.execution.history.map((a) => a.status), ['FAILED', 'FAILED'], 'both attempts, as of the last event');
  });
});

describe('an event shared by subscribers of one shape', () => {
  it('is written as JSON once, and reaches each subscriber under the id it chose, whatever that id holds', async () => {
    const query = `subscription($f: ExecutionFilter) { executionEvents(filter: $f) { status execution { token arguments } } }`;
    const variables = { f: { procedure: 'demo.add' } };
    // ids a client may choose: plain, the text the server marks a payload with, and one that ends as a marked message does
    const ids = ['1', '\u0000asyncproc:payload', 'x","type":"next","payload":"\u0000asyncproc:payload"}'];
    const clients = await Promise.all(
      ids.map(async (id) => {
        const { socket, messages } = await rawClient();
        socket.send(JSON.stringify({ id, type: 'subscribe', payload: { query, variables } }));
        return { id, socket, messages };
      }),
    );
    const invoke = async (a: number) => {
      const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: { procedure: 'demo.add', arguments: { a, b: 1 } } });
      return body.data.invoke.execution.token as string;
    };
    const ended = (c: (typeof clients)[number], tokens: string[]) =>
      tokens.every((token) => c.messages.some((m) => m.payload?.data?.executionEvents?.status === 'SUCCEEDED' && m.payload.data.executionEvents.execution.token === token));
    // every subscription is in once each has heard a first call end
    const first = [await invoke(0)];
    await waitFor(async () => clients.every((c) => ended(c, first)), 15_000, 'every subscriber to hear a first end');
    for (const c of clients) c.messages.length = 0;
    // the payloads graphql-ws would write, counted as they are turned into JSON (the server runs in this process)
    const stringify = JSON.stringify;
    let payloadsWritten = 0;
    JSON.stringify = function (value: any, ...rest: any[]) {
      if (value?.data?.executionEvents || value?.payload?.data?.executionEvents) payloadsWritten++;
      return stringify.call(JSON, value, ...rest);
    } as typeof JSON.stringify;
    try {
      const tokens = [await invoke(1), await invoke(2)];
      await waitFor(async () => clients.every((c) => ended(c, tokens)), 15_000, 'every subscriber to hear both ends');
    } finally {
      JSON.stringify = stringify;
      for (const c of clients) c.socket.close();
    }
    for (const c of clients) {
      assert.ok(c.messages.every((m) => m.type === 'next' && m.id === c.id), JSON.stringify(c.messages.slice(0, 3)));
      assert.deepEqual(c.messages.map((m) => m.payload), clients[0].messages.map((m) => m.payload), 'every subscriber is sent the same events');
    }
    const events = clients[0].messages.length;
    assert.ok(events >= 2, 'both ends at least');
    assert.ok(clients[0].messages.every((m) => m.payload.data.executionEvents.execution.arguments.b === 1));
    assert.equal(payloadsWritten, events, 'each event written once, not once per subscriber');
  });
});

describe('an event whose fields fail', () => {
  it('reaches every subscriber masked ("Unexpected error.", no SQL text) over graphql-ws and SSE, and the stream goes on', async () => {
    await db.sql.query(`create schema if not exists fantest;
      create or replace procedure fantest.quiet() language plpgsql as $$ begin end $$`);
    await db.engine.registerProcedure('fantest.quiet');
    const query = `subscription($f: ExecutionFilter) { executionEvents(filter: $f) { status execution { token history { status } } } }`;
    const variables = { f: { procedure: 'fantest.quiet' } };
    // two subscribers of one shape (one shared result per event), and one over SSE
    const ws = t.ws();
    const streams = [ws.iterate({ query, variables }), t.ws().iterate({ query, variables }), t.sse().iterate({ query, variables })] as AsyncIterableIterator<any>[];
    const results: any[][] = streams.map(() => []);
    const reading = streams.map(async (stream, i) => {
      for await (const result of stream) results[i].push(result);
    });
    const invoke = async () =>
      (await t.gql(`mutation { invoke(input: { procedure: "fantest.quiet" }) { execution { token } } }`)).body.data.invoke.execution.token as string;
    // calls until each stream has heard one end: all three are subscribed (a count of the hub's
    // streams taken before them also counted an earlier test's, which could end meanwhile)
    await waitFor(
      async () => {
        await invoke();
        await sleep(200);
        return results.every((r) => r.some((result) => result.data?.executionEvents?.status === 'SUCCEEDED'));
      },
      20_000,
      'the three subscriptions to hear a first end',
    );
    // every read of a call's history now fails, as an unexpected database error does
    await db.sql.query('alter table asyncproc.attempts rename to attempts_away');
    try {
      await invoke();
      await waitFor(async () => results.every((r) => r.some((result) => result.errors)), 15_000, 'every subscriber to hear a failed event');
    } finally {
      await db.sql.query('alter table asyncproc.attempts_away rename to attempts');
    }
    for (const [i, r] of results.entries()) {
      const errors = r.flatMap((result) => result.errors ?? []);
      assert.ok(errors.length > 0, `subscriber ${i}`);
      for (const error of errors) {
        assert.equal(error.message, 'Unexpected error.', `subscriber ${i}: ${JSON.stringify(error)}`);
        assert.equal(error.extensions?.code, 'INTERNAL_SERVER_ERROR');
      }
      assert.doesNotMatch(JSON.stringify(r), /attempts|relation|does not exist/, `subscriber ${i} was shown nothing of the database's error`);
    }
    // the same streams go on: the next call's end reaches each of them whole (the first call's
    // end may come whole too, read once its history is back)
    const token = await invoke();
    const ended = (r: any[]) => r.find((result) => result.data?.executionEvents?.execution?.token === token && result.data.executionEvents.status === 'SUCCEEDED');
    await waitFor(async () => results.every(ended), 15_000, "every subscriber to hear the next call's end");
    for (const r of results) {
      const last = ended(r);
      assert.equal(last.errors, undefined, JSON.stringify(last.errors));
      assert.deepEqual(last.data.executionEvents.execution, { token, history: [{ status: 'SUCCEEDED' }] });
    }
    await Promise.all(streams.map((stream) => stream.return?.()));
    await Promise.all(reading);
    await ws.dispose();
  });
});

describe('an event shared by SSE subscribers of one shape', () => {
  it('is turned into JSON once for all of them, and each gets the same events', async () => {
    const query = `subscription($f: ExecutionFilter) { executionEvents(filter: $f) { status execution { token arguments } } }`;
    const variables = { f: { procedure: 'demo.add' } };
    const received: any[][] = [[], [], []];
    const clients = received.map(() => t.sse());
    const unsubscribes = clients.map((client, i) =>
      client.subscribe({ query, variables }, { next: (result) => received[i].push(result), error: () => undefined, complete: () => undefined }),
    );
    const invoke = async (a: number) =>
      (await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: { procedure: 'demo.add', arguments: { a, b: 2 } } })).body.data.invoke.execution
        .token as string;
    const ended = (r: any[], token: string) => r.some((result) => result.data?.executionEvents?.status === 'SUCCEEDED' && result.data.executionEvents.execution.token === token);
    // the streams are in once each has heard a call end (the hub's count is shared with the file's other subscribers)
    await waitFor(
      async () => {
        const first = await invoke(0);
        await new Promise((resolve) => setTimeout(resolve, 300));
        return received.every((r) => ended(r, first));
      },
      15_000,
      'every subscriber to hear a first end',
    );
    // events of the warm-up calls still on their way are let through before counting starts
    await new Promise((resolve) => setTimeout(resolve, 300));
    for (const r of received) r.length = 0;
    const stringify = JSON.stringify;
    let written = 0;
    JSON.stringify = function (value: any, ...rest: any[]) {
      if (value?.data?.executionEvents) written++;
      return stringify.call(JSON, value, ...rest);
    } as typeof JSON.stringify;
    let token: string;
    try {
      token = await invoke(1);
      await waitFor(async () => received.every((r) => ended(r, token)), 15_000, 'every subscriber to hear the end');
    } finally {
      JSON.stringify = stringify;
      unsubscribes.forEach((unsubscribe) => unsubscribe());
    }
    for (const r of received) assert.deepEqual(r, received[0], 'every subscriber is sent the same events');
    assert.ok(received[0].length >= 1 && received[0].every((result) => result.data.executionEvents.execution.arguments.b === 2));
    // the client's own parsing is not counted: only the server's writing of an event's result
    assert.equal(written, received[0].length, 'each event written once, not once per subscriber');
  });
});

describe('an error that ends a shared stream', () => {
  it('is masked unless it is an aborted request (a DOMException): a plain error named AbortError is not let through', async () => {
    const { envelop, useEngine, useSchema } = await import('@envelop/core');
    const graphql = await import('graphql');
    const { useSharedEventExecution } = await import('../src/fanout.js');
    const failing = (error: unknown) =>
      new graphql.GraphQLSchema({
        query: new graphql.GraphQLObjectType({ name: 'Query', fields: { ok: { type: graphql.GraphQLBoolean } } }),
        subscription: new graphql.GraphQLObjectType({
          name: 'Subscription',
          fields: {
            ended: {
              type: graphql.GraphQLBoolean,
              subscribe: async function* () {
                yield { ended: true };
                throw error;
              },
            },
          },
        }),
      });
    const maskError = (error: unknown) => new graphql.GraphQLError(error instanceof graphql.GraphQLError && !error.originalError ? error.message : 'Unexpected error.');
    const ends = async (error: unknown) => {
      const getEnveloped = envelop({ plugins: [useEngine(graphql), useSchema(failing(error)), useSharedEventExecution({ maskError })] });
      const { subscribe, schema, contextFactory } = getEnveloped();
      const stream = (await subscribe({ schema, document: graphql.parse('subscription { ended }'), contextValue: await contextFactory() })) as AsyncIterator<unknown>;
      assert.deepEqual(JSON.parse(JSON.stringify(await stream.next())), { done: false, value: { data: { ended: true } } });
      return stream.next().then(
        () => assert.fail('the stream should end with an error'),
        (thrown: Error) => thrown,
      );
    };
    const named = Object.assign(new Error('secret abort text'), { name: 'AbortError' });
    assert.equal((await ends(named)).message, 'Unexpected error.', 'a plain error named AbortError is masked');
    assert.equal((await ends(new Error('select * from secret'))).message, 'Unexpected error.');
    const aborted = new DOMException('The operation was aborted', 'AbortError');
    assert.equal(await ends(aborted), aborted, 'an aborted request stays as it is, as yoga lets it through');
  });
});

describe("a socket's writes", () => {
  it("send a turn's first message at once, and the turn's later ones together when the turn ends", async () => {
    const { coalescingWrites } = await import('../src/fanout.js');
    const { spawn } = await import('node:child_process');
    const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', WebSocket: coalescingWrites(WebSocket) });
    await new Promise((resolve) => wss.once('listening', resolve));
    const port = (wss.address() as import('node:net').AddressInfo).port;
    // the client in a process of its own: it hears what reaches it while this one is busy
    const client = spawn(process.execPath, ['-e', `
      const ws = new (require('ws'))('ws://127.0.0.1:${port}');
      ws.on('message', (data) => process.stdout.write(Date.now() + ' ' + data + '\\n'));`], { cwd: process.cwd() });
    let heard = '';
    client.stdout.on('data', (chunk) => (heard += chunk));
    try {
      const socket = await new Promise<WebSocket>((resolve) => wss.once('connection', resolve));
      const raw = (socket as unknown as { _socket: import('node:net').Socket & { _write: Function; _writev: Function } })._socket;
      let writes = 0;
      for (const method of ['_write', '_writev'] as const) {
        const original = raw[method];
        raw[method] = function (this: unknown, ...args: unknown[]) {
          writes++;
          return original.apply(this, args);
        };
      }
      // one turn: a message, then this process busy for 300 ms, then two more
      socket.send('first');
      const busyUntil = Date.now() + 300;
      while (Date.now() < busyUntil);
      socket.send('second');
      socket.send('third');
      assert.equal(writes, 1, 'only the first has been written during the turn');
      await waitFor(async () => heard.trim().split('\n').length === 3 || null, 10_000, 'the client to hear all three');
      assert.equal(writes, 2, 'the second and third left in one write');
      const at = Object.fromEntries(heard.trim().split('\n').map((line) => line.split(' ').reverse()));
      assert.ok(Number(at.second) - Number(at.first) >= 200, `the first arrived while this process was busy: ${heard}`);
      assert.ok(Math.abs(Number(at.third) - Number(at.second)) <= 20, heard);
    } finally {
      client.kill();
      wss.close();
    }
  });
});

describe('a feed that fell behind the retention (a stalled process, a partition)', () => {
  // last in this file: it purges every ended call of its database
  it('ends its streams with CURSOR_EXPIRED and its watches with NOT_FOUND when ends it had not read were purged, never skipping them in silence', async () => {
    // this hub reads the feed only when told to (no listener, a poll an hour): it falls behind at will
    const hub = new CompletionHub(db.engine, silentLogger, { pollMs: 3_600_000 });
    await hub.start();
    try {
      const runAt = new Date(Date.now() + 3_600_000); // no worker starts them
      const [call] = await db.engine.submit([{ procedure: 'demo.noop', arguments: {}, runAt }]);
      const batch = await db.engine.submitBatch([[{ procedure: 'demo.noop', arguments: {}, runAt }]]);
      const stream = hub.events({ status: null, procedure: null, queue: null, submittedBy: null }, null);
      const completed = await hub.completed(call.token);
      const batchEnded = await hub.batchCompleted(batch.id);
      await waitFor(async () => hub.size === 3, 5000, 'the stream and the two watches');
      // both end, and retention purges them, before this hub reads the feed
      await db.engine.cancelExecution(call.token);
      await db.engine.cancelBatch(batch.id);
      assert.ok((await db.engine.purge(0)) >= 2, "retention purged them");
      assert.equal(await db.engine.getExecution(call.token), null, 'the call was purged');
      // a subscriber that resumes from a cursor taken after the purge was owed none of what went: it goes on
      const { formatSnapshot } = await import('../src/changeCursor.js');
      const joined = hub.events({ status: null, procedure: null, queue: null, submittedBy: null }, formatSnapshot(await db.engine.currentPosition()));
      await waitFor(async () => hub.size === 4, 5000, 'the later stream');
      hub.onChange();
      const outcome = async (iterable: AsyncIterable<unknown>) => {
        const values: unknown[] = [];
        try {
          for await (const value of iterable) values.push(value);
          return { values, code: null };
        } catch (error) {
          return { values, code: (error as EngineError).code };
        }
      };
      const timeout = new Promise<never>((_, reject) => setTimeout(() => reject(new Error('a subscriber was left waiting, told nothing')), 10_000).unref());
      const [onStream, onCompleted, onBatch] = await Promise.race([Promise.all([outcome(stream), outcome(completed), outcome(batchEnded)]), timeout]);
      assert.deepEqual(onStream, { values: [], code: 'CURSOR_EXPIRED' }, 'the stream');
      assert.deepEqual(onCompleted, { values: [], code: 'NOT_FOUND' }, 'executionCompleted');
      assert.deepEqual(onBatch, { values: [], code: 'NOT_FOUND' }, 'batchCompleted');
      assert.equal(hub.size, 1, 'the later stream alone is left');
      const [later] = await db.engine.submit([{ procedure: 'demo.noop', arguments: {}, runAt }]);
      await db.engine.cancelExecution(later.token);
      hub.onChange();
      const seen: string[] = [];
      for await (const event of joined) {
        seen.push(event.execution.token);
        if (event.execution.token === later.token && event.status === 'CANCELLED') break;
      }
      assert.ok(seen.every((token) => token === later.token), `it heard the later call only: ${seen}`);
    } finally {
      await hub.close();
    }
  });
});
