/**
 * The load generator of the invoke bench, in its own process so that it does not share the
 * service's core: `concurrency` HTTP clients, each sending `invoke` mutations one after another
 * until `invokes` were sent, over keep-alive connections of node:http (fetch costs the generator
 * about as much CPU per request as the service spends on it, on the same two cores).
 * argv: { url, invokes, concurrency, warmup }; answers { rate, errors } over IPC and exits.
 */
import http from 'node:http';
import { concurrently } from './measure.js';

const { url, invokes, concurrency, warmup } = JSON.parse(process.argv[2]) as { url: string; invokes: number; concurrency: number; warmup: number };
const BODY = Buffer.from(JSON.stringify({ query: 'mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }' }));
const agent = new http.Agent({ keepAlive: true, maxSockets: concurrency });
const target = new URL(url);
let errors = 0;

function post(): Promise<string> {
  return new Promise((resolve, reject) => {
    const request = http.request(
      { agent, hostname: target.hostname, port: target.port, path: target.pathname, method: 'POST',
        headers: { 'content-type': 'application/json', 'content-length': BODY.length } },
      (response) => {
        const chunks: Buffer[] = [];
        response.on('data', (chunk: Buffer) => chunks.push(chunk));
        response.on('end', () => resolve(Buffer.concat(chunks).toString()));
        response.on('error', reject);
      },
    );
    request.on('error', reject);
    request.end(BODY);
  });
}

async function invoke(): Promise<void> {
  const body = JSON.parse(await post()) as { data?: { invoke?: { execution?: { token?: string } } } };
  if (!body.data?.invoke?.execution?.token) errors++;
}

for (let i = 0; i < warmup; i++) await invoke();
const rate = await concurrently(concurrency, invokes, invoke);
process.send!({ rate, errors }, () => process.exit(0));
