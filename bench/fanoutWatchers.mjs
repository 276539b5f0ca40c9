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
// at most OPENING handshakes at once: 10,000 at one instant overflow the server's listen backlog and
// some are reset, which measures the kernel's accept queue rather than the service
const OPENING = 500;
let opening = 0;
let nextToken = 0;
const openMore = () => {
  while (opening < OPENING && nextToken < tokens.length) {
    opening++;
    subscribe(tokens[nextToken++]);
  }
};
function subscribe(token) {
  let counted = false;
  const opened = () => {
    if (counted) return;
    counted = true;
    opening--;
    openMore();
  };
  const client = createClient({
    url: url.replace(/^http/, 'ws'),
    webSocketImpl: WebSocket,
    retryAttempts: 0,
    lazy: false,
    on: {
      connected: () => {
        opened();
        if (++acknowledged === tokens.length) process.send({ connected: true });
      },
      closed: opened,
    },
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
        errors.push(error instanceof Error ? error.message : `closed ${error?.code ?? ''} ${error?.reason ?? String(error)}`);
        if (--left === 0) done();
      },
      complete: () => --left === 0 && done(),
    },
  );
}
openMore();
await Promise.race([all, new Promise((resolve) => setTimeout(resolve, timeoutMs))]);
process.send({ arrivals, errors: errors.slice(0, 5) }, async () => {
  for (const client of clients) await client.dispose();
  process.exit(0);
});
