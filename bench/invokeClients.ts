/**
 * The load generator of the invoke bench, in its own process so that it does not share the
 * service's core: `concurrency` HTTP clients (fetch), each sending `invoke` mutations one after
 * another until `invokes` were sent. argv: { url, invokes, concurrency, warmup }; answers
 * { rate, errors } over IPC and exits.
 */
import { concurrently } from './measure.js';

const { url, invokes, concurrency, warmup } = JSON.parse(process.argv[2]) as { url: string; invokes: number; concurrency: number; warmup: number };
const BODY = JSON.stringify({ query: 'mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }' });
let errors = 0;

async function invoke(): Promise<void> {
  const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: BODY });
  const body = (await response.json()) as { data?: { invoke?: { execution?: { token?: string } } } };
  if (!body.data?.invoke?.execution?.token) errors++;
}

for (let i = 0; i < warmup; i++) await invoke();
const rate = await concurrently(concurrency, invokes, invoke);
process.send!({ rate, errors }, () => process.exit(0));
