/**
 * The client of the latency bench: `n` calls one after another, each an `invoke` mutation and
 * then a graphql-ws subscription to its `executionCompleted`; the time from the mutation's
 * response to the event (ms, in call order). The socket stays open between calls, as a page's
 * does (graphql-ws's lazy default would open one per call).
 */
import { createClient } from 'graphql-ws';
import WebSocket from 'ws';
import { INVOKE_NOOP, poster, tokenOf } from './httpPost.js';

export async function measureLatencies(url: string, n: number, warmup: number): Promise<number[]> {
  const post = poster(url, INVOKE_NOOP, 1);
  const ws = createClient({ url: url.replace(/^http/, 'ws'), webSocketImpl: WebSocket, lazy: false });
  const latencies: number[] = [];
  try {
    for (let i = 0; i < warmup + n; i++) {
      const token = tokenOf(await post());
      if (!token) throw new Error('invoke failed');
      const start = performance.now();
      let heard = false;
      for await (const _event of ws.iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: token } })) {
        heard = true;
        break;
      }
      if (!heard) throw new Error(`no executionCompleted for ${token}`);
      if (i >= warmup) latencies.push(performance.now() - start);
    }
  } finally {
    await ws.dispose();
  }
  return latencies;
}
