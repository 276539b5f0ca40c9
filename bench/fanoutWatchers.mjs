// The executionCompleted watchers of the fan-out bench, in their own process: one graphql-ws
// socket per token, each subscribed to `executionCompleted(token)`. Plain JavaScript.
//
// Its first IPC message: { url, tokens, timeoutMs }. Sends { subscribed } once every socket acknowledged its
// subscription, then { arrivals: { token: ms } } once every watcher heard its call end (or the deadline).
import { createClient } from 'graphql-ws';
import WebSocket from 'ws';

const { url, tokens, timeoutMs } = await new Promise((resolve) => process.once('message', resolve));
const COMPLETED = `subscription($token: ID!) { executionCompleted(token: $token) { token status } }`;
const arrivals = {};
const errors = [];
let left = tokens.length;
let done;
const all = new Promise((resolve) => (done = resolve));
const clients = [];
let acknowledged = 0;
for (const token of tokens) {
  const client = createClient({
    url: url.replace(/^http/, 'ws'),
    webSocketImpl: WebSocket,
    retryAttempts: 0,
    lazy: false,
    on: { connected: () => ++acknowledged === tokens.length && process.send({ connected: true }) },
  });
  clients.push(client);
  client.subscribe(
    { query: COMPLETED, variables: { token } },
    {
      next: (result) => {
        if (result.errors) errors.push(JSON.stringify(result.errors));
        else if (!(token in arrivals)) arrivals[token] = Date.now();
      },
      error: (error) => {
        errors.push(error instanceof Error ? error.message : String(error));
        if (--left === 0) done();
      },
      complete: () => --left === 0 && done(),
    },
  );
}
await Promise.race([all, new Promise((resolve) => setTimeout(resolve, timeoutMs))]);
process.send({ arrivals, errors: errors.slice(0, 5) }, async () => {
  for (const client of clients) await client.dispose();
  process.exit(0);
});
