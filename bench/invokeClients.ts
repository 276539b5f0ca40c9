/**
 * The load generator of the invoke bench, in its own process so that it does not share the
 * service's core: `concurrency` HTTP clients, each sending `invoke` mutations one after another
 * until `invokes` were sent, over keep-alive connections of node:http.
 * argv: { url, invokes, concurrency, warmup }; answers { rate, errors } over IPC and exits.
 */
import { INVOKE_NOOP, poster, tokenOf } from './httpPost.js';
import { concurrently } from './measure.js';

const { url, invokes, concurrency, warmup } = JSON.parse(process.argv[2]) as { url: string; invokes: number; concurrency: number; warmup: number };
const post = poster(url, INVOKE_NOOP, concurrency);
let errors = 0;

async function invoke(): Promise<void> {
  if (!tokenOf(await post())) errors++;
}

for (let i = 0; i < warmup; i++) await invoke();
const rate = await concurrently(concurrency, invokes, invoke);
process.send!({ rate, errors }, () => process.exit(0));
