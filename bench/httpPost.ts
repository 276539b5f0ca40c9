/**
 * POSTs over keep-alive connections of node:http, for the bench's load generators (fetch costs
 * a generator about as much CPU per request as the service spends on it, on the same two cores).
 */
import http from 'node:http';

/** A poster of `body` to `url` over at most `sockets` kept-alive connections; each call answers the response's text. */
export function poster(url: string, body: string, sockets: number): () => Promise<string> {
  const payload = Buffer.from(body);
  const agent = new http.Agent({ keepAlive: true, maxSockets: sockets });
  const target = new URL(url);
  return () =>
    new Promise((resolve, reject) => {
      const request = http.request(
        { agent, hostname: target.hostname, port: target.port, path: target.pathname, method: 'POST',
          headers: { 'content-type': 'application/json', 'content-length': payload.length } },
        (response) => {
          const chunks: Buffer[] = [];
          response.on('data', (chunk: Buffer) => chunks.push(chunk));
          response.on('end', () => resolve(Buffer.concat(chunks).toString()));
          response.on('error', reject);
        },
      );
      request.on('error', reject);
      request.end(payload);
    });
}

/** The bench's mutation: one no-op call. */
export const INVOKE_NOOP = JSON.stringify({ query: 'mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }' });

/** The token of an invoke's response (undefined: it failed). */
export function tokenOf(text: string): string | undefined {
  return (JSON.parse(text) as { data?: { invoke?: { execution?: { token?: string } } } }).data?.invoke?.execution?.token;
}
