// The load generator of the invoke bench, in its own process so that it does not share the
// service's core: CONCURRENCY HTTP clients (fetch), each sending `invoke` mutations one after
// another until INVOKES were sent. Plain JavaScript: no loader needed.
//
// argv: { url, invokes, concurrency, warmup }. Answers { rate, errors } over IPC and exits.
const { url, invokes, concurrency, warmup } = JSON.parse(process.argv[2]);
const BODY = JSON.stringify({ query: 'mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }' });
let errors = 0;

async function invoke() {
  const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: BODY });
  const body = await response.json();
  if (!body.data?.invoke?.execution?.token) errors++;
}

for (let i = 0; i < warmup; i++) await invoke();
let sent = 0;
const t0 = performance.now();
await Promise.all(
  Array.from({ length: concurrency }, async () => {
    while (sent < invokes) {
      sent++;
      await invoke();
    }
  }),
);
const rate = invokes / ((performance.now() - t0) / 1000);
process.send({ rate, errors }, () => process.exit(0));
