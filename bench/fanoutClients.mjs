// The subscribers of the fan-out bench, in their own process so that their parsing does not
// share the service's core: N graphql-ws clients, one socket each, every one subscribed to
// `executionEvents` (no filter) from the cursor it is given. Plain JavaScript: no loader needed.
//
// argv: { url, subscribers, after, timeoutMs, transport }: transport 'sse' for graphql-sse clients (one
// HTTP stream each) instead of graphql-ws. The parent sends { expect: [...tokens] } over IPC once
// submission is over; the child answers { results } when every subscriber heard every token finish
// (or the deadline passed).
import { createClient as createSseClient } from 'graphql-sse';
import { createClient } from 'graphql-ws';
import WebSocket from 'ws';

const { url, subscribers, after, timeoutMs, transport = 'ws' } = JSON.parse(process.argv[2]);
const EVENTS = `subscription($after: String) { executionEvents(after: $after) { cursor status execution { token status } } }`;
const TERMINAL = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED']);

const states = Array.from({ length: subscribers }, () => ({ events: 0, finished: new Map(), last: 0, errors: [] }));
let expected = null;
let done = null;
const check = () => {
  if (!expected || !done) return;
  if (states.every((s) => s.finished.size >= expected.size || s.errors.length)) done();
};
const clients = states.map((state) => {
  const client =
    transport === 'sse'
      ? createSseClient({ url, retryAttempts: 0 })
      : createClient({ url: url.replace(/^http/, 'ws'), webSocketImpl: WebSocket, retryAttempts: 0, lazy: false });
  client.subscribe(
    { query: EVENTS, variables: { after } },
    {
      next: (result) => {
        state.last = Date.now();
        state.events++;
        if (result.errors) {
          state.errors.push(result.errors);
          return;
        }
        const execution = result.data.executionEvents.execution;
        if (TERMINAL.has(execution.status)) state.finished.set(execution.token, (state.finished.get(execution.token) ?? 0) + 1);
        if (expected && state.finished.size >= expected.size) check();
      },
      error: (error) => {
        state.errors.push(error instanceof Error ? error.message : error);
        check();
      },
      complete: () => undefined,
    },
  );
  return client;
});

process.on('message', async (message) => {
  if (message.expect) {
    expected = new Set(message.expect);
    const cpuBefore = process.cpuUsage();
    const all = new Promise((resolve) => (done = resolve));
    check();
    await Promise.race([all, new Promise((resolve) => setTimeout(resolve, timeoutMs))]);
    const results = states.map((s) => {
      let repeats = 0;
      let missing = 0;
      for (const token of expected) {
        const n = s.finished.get(token) ?? 0;
        if (n === 0) missing++;
        else repeats += n - 1;
      }
      return { events: s.events, last: s.last, missing, repeats, errors: s.errors.slice(0, 3).map(String) };
    });
    const cpu = process.cpuUsage(cpuBefore);
    for (const client of clients) await client.dispose();
    process.send({ results, cpuMs: (cpu.user + cpu.system) / 1000 }, () => process.exit(0));
  }
});
process.send({ ready: true });
