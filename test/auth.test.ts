/**
 * Identity and access, end to end: real signed JWTs (HS256 secret, an ES256 key served
 * as a JWKS), real API keys, over real HTTP, SSE and graphql-ws, against a real PostgreSQL.
 * A plain caller must not see, subscribe to or cancel another caller's work, nor tell
 * that it exists; roles gate the admin mutations and each procedure's calls.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import { exportJWK, exportSPKI, generateKeyPair, SignJWT, type JWTPayload } from 'jose';
import WebSocket from 'ws';
import { startApp } from '../src/app.js';
import { authSettings, ConfigError, loadConfig } from '../src/config.js';
import { JwtVerifier } from '../src/auth/jwt.js';
import { silentLogger } from '../src/logger.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { sleep, startTestCluster, waitFor, type TestCluster } from './support/database.js';

const execFileAsync = promisify(execFile);

const SECRET = 'a-test-secret-of-at-least-thirty-two-characters';
const ISSUER = 'https://issuer.test';
const AUDIENCE = 'asyncproc-test';

let cluster: TestCluster;
let t: TestApp;
let databaseUrl: string;

/** A token as the configured issuer would sign it; `claims` override the defaults. */
function token(sub: string | undefined, roles: string[] = [], claims: JWTPayload & { expiresIn?: string | null } = {}, secret = SECRET) {
  const { expiresIn = '10m', ...rest } = claims;
  const jwt = new SignJWT({ roles, iss: ISSUER, aud: AUDIENCE, ...rest }).setProtectedHeader({ alg: 'HS256' }).setIssuedAt();
  if (sub !== undefined) jwt.setSubject(sub);
  // null: no exp at all (a token that never expires)
  if (expiresIn !== null) jwt.setExpirationTime(expiresIn);
  return jwt.sign(new TextEncoder().encode(secret));
}
const bearer = async (sub: string, roles: string[] = []) => ({ authorization: `Bearer ${await token(sub, roles)}` });

let alice: Record<string, string>;
let bob: Record<string, string>;
let operator: Record<string, string>;
let admin: Record<string, string>;

before(async () => {
  cluster = await startTestCluster();
  databaseUrl = await cluster.createDatabase();
  t = await startTestApp(databaseUrl, {
    ASYNCPROC_JWT_SECRET: SECRET,
    ASYNCPROC_JWT_ISSUER: ISSUER,
    ASYNCPROC_JWT_AUDIENCE: AUDIENCE,
    ASYNCPROC_RATE_LIMIT: '1000',
    ASYNCPROC_MAX_CONNECTIONS_PER_CALLER: '3',
  });
  alice = await bearer('alice');
  bob = await bearer('bob');
  operator = await bearer('olga', ['operator']);
  admin = await bearer('ada', ['admin']);
});
after(async () => {
  await t?.stop();
  await cluster?.stop();
});

const EXECUTION = 'token status submittedBy';

async function invoke(headers: Record<string, string>, procedure = 'demo.add', args: Record<string, unknown> = { a: 1, b: 2 }) {
  const { status, body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { ${EXECUTION} } } }`, { i: { procedure, arguments: args } }, headers);
  assert.equal(status, 200, JSON.stringify(body));
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return body.data.invoke.execution as { token: string; status: string; submittedBy: string };
}

/** Every execution in the database, seen by an admin. */
async function allTokens(): Promise<string[]> {
  const { body } = await t.gql(`{ executions(first: 500) { nodes { token } } }`, {}, admin);
  return body.data.executions.nodes.map((n: { token: string }) => n.token);
}

/** The answer's only error, with its code; and nothing was enqueued meanwhile. */
async function refused(run: () => Promise<{ status: number; body: any }>, code: string, status = 200) {
  const before = (await allTokens()).length;
  const { status: httpStatus, body } = await run();
  assert.equal(httpStatus, status, JSON.stringify(body));
  assert.equal(body.errors?.[0]?.extensions?.code, code, JSON.stringify(body));
  assert.equal((await allTokens()).length, before, 'nothing enqueued');
  return body.errors[0] as { message: string; extensions: Record<string, unknown> };
}

/** Open a raw graphql-transport-ws socket, send connection_init, and report how it ends. */
function wsInit(payload: Record<string, unknown> | undefined): Promise<{ ack: boolean; code?: number; reason?: string }> {
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
    socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload })));
    socket.on('message', (data) => {
      if (JSON.parse(String(data)).type === 'connection_ack') {
        resolve({ ack: true });
        socket.close();
      }
    });
    socket.on('close', (code, reason) => resolve({ ack: false, code, reason: String(reason) }));
    socket.on('error', reject);
  });
}

describe('authentication', () => {
  it('refuses an anonymous request with 401 UNAUTHENTICATED and runs nothing', async () => {
    const error = await refused(() => t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 2 } }) { execution { token } } }`), 'UNAUTHENTICATED', 401);
    assert.match(error.message, /Authorization/);
    const response = await fetch(t.url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"query":"{ procedures { name } }"}' });
    assert.equal(response.status, 401);
    assert.match(response.headers.get('www-authenticate') ?? '', /Bearer/);
  });

  it('refuses forged, expired, wrong-audience, wrong-issuer, unsigned and subject-less tokens', async () => {
    const unsigned = `${Buffer.from('{"alg":"none"}').toString('base64url')}.${Buffer.from(JSON.stringify({ sub: 'eve', aud: AUDIENCE, iss: ISSUER, roles: ['admin'] })).toString('base64url')}.`;
    const cases: [string, string, RegExp][] = [
      ['forged', await token('eve', ['admin'], {}, 'another-secret-of-at-least-thirty-two-chars'), /signature/],
      ['expired', await token('alice', [], { expiresIn: '-1m' }), /expired/],
      // within the clock tolerance kept for "nbf" and "iat": its sockets were closed, yet HTTP took it for 5 s more
      ['expired 2 s ago', await token('alice', [], { expiresIn: '-2s' }), /expired/],
      ['wrong audience', await token('alice', [], { aud: 'someone-else' }), /aud/],
      ['wrong issuer', await token('alice', [], { iss: 'https://evil.test' }), /iss/],
      ['alg none', unsigned, /none/],
      ['no subject', await token(undefined), /sub/],
      // stored as U+FFFD, the caller would then not own its own calls
      ['a lone surrogate in the subject', await token('me\ud800'), /sub/],
      // each reads as alice wherever an admin sees `submittedBy`, and is another caller
      ['DEL in the subject', await token('alice\u007f'), /sub/],
      ['a zero-width space in the subject', await token('ali\u200bce'), /sub/],
      ['a right-to-left override in the subject', await token('\u202eecila'), /sub/],
      ['garbage', 'not-a-token', /malformed/],
      // issued a minute ahead of this clock: beyond the 5 s the README allows for skew
      [
        'iat a minute ahead',
        await new SignJWT({ iss: ISSUER, aud: AUDIENCE, sub: 'alice', iat: Math.floor(Date.now() / 1000) + 60 })
          .setProtectedHeader({ alg: 'HS256' })
          .setExpirationTime('10m')
          .sign(new TextEncoder().encode(SECRET)),
        /"iat" is in the future/,
      ],
      // an exp no date holds: a token that never expires
      ['exp 1e300', await token('alice', [], { expiresIn: null, exp: 1e300 }), /past any date/],
      // good for ever once leaked, and a JWT cannot be revoked
      ['no exp', await token('alice', [], { expiresIn: null }), /"exp"/],
      // an API key's identity: the JWT would own that key's calls
      ['an API key subject', await token('apikey:deploy-bot'), /apikey:/],
      ['an API key subject, in capitals', await token('APIKEY:deploy-bot'), /apikey:/],
    ];
    for (const [what, jwt, message] of cases) {
      const error = await refused(() => t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 2 } }) { execution { token } } }`, {}, { authorization: `Bearer ${jwt}` }), 'UNAUTHENTICATED', 401);
      assert.match(error.message, message, what);
    }
  });

  it('a token without exp is accepted only where ASYNCPROC_JWT_REQUIRE_EXP=false says so', async () => {
    const lenient = await startTestApp(databaseUrl, {
      ASYNCPROC_JWT_SECRET: SECRET, ASYNCPROC_JWT_ISSUER: ISSUER, ASYNCPROC_JWT_AUDIENCE: AUDIENCE, ASYNCPROC_JWT_REQUIRE_EXP: 'false',
    });
    try {
      const forever = { authorization: `Bearer ${await token('carol', [], { expiresIn: null })}` };
      const { status, body } = await lenient.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 2 } }) { execution { submittedBy } } }`, {}, forever);
      assert.equal(status, 200, JSON.stringify(body));
      assert.equal(body.data.invoke.execution.submittedBy, 'carol');
      assert.equal((await t.gql(`{ __typename }`, {}, forever)).status, 401, 'refused by default');
    } finally {
      await lenient.stop();
    }
  });

  it('records the verified subject as submittedBy, never the x-asyncproc-user header', async () => {
    const execution = await invoke({ ...alice, 'x-asyncproc-user': 'bob' });
    assert.equal(execution.submittedBy, 'alice');
  });

  it('graphql-ws: no credentials close 4401, bad ones 4403, before any subscription; good ones are acknowledged', async () => {
    const missing = await wsInit(undefined);
    assert.equal(missing.code, 4401);
    assert.match(missing.reason ?? '', /authentication required/);
    const forged = await wsInit({ Authorization: `Bearer ${await token('eve', ['admin'], {}, 'another-secret-of-at-least-thirty-two-chars')}` });
    assert.equal(forged.code, 4403);
    assert.equal((await wsInit({ Authorization: alice.authorization })).ack, true);
    assert.equal((await wsInit({ token: alice.authorization.slice('Bearer '.length) })).ack, true, 'the bare token form');
  });

  it('SSE: refused without credentials; with them the event arrives', async () => {
    const denied = await fetch(t.url, {
      method: 'POST',
      headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
      body: JSON.stringify({ query: 'subscription { executionEvents { status } }' }),
    });
    assert.equal(denied.status, 401);
    await denied.body?.cancel();
    const execution = await invoke(alice, 'demo.sleep', { seconds: 0.2 });
    const events = t.sse(alice).iterate<{ executionCompleted: { status: string } }>({
      query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`,
      variables: { t: execution.token },
    });
    const [event] = await collect(events, 1);
    assert.equal(event.data?.executionCompleted.status, 'SUCCEEDED');
  });

  it('a socket whose token expires can make no new subscription', async () => {
    const shortLived = await token('alice', [], { expiresIn: '2s' });
    const client = t.ws({ Authorization: `Bearer ${shortLived}` });
    const first = await collect(client.iterate({ query: '{ __typename }' }), 1);
    assert.equal((first[0].data as any)?.__typename, 'Query');
    await sleep(2_600);
    await assert.rejects(collect(client.iterate({ query: '{ __typename }' }), 1), (error: any) => {
      // refused by the subscription's own check, or the socket already closed by the periodic one (4403)
      const code = error?.[0]?.extensions?.code ?? error?.extensions?.code;
      if (code === undefined) assert.equal(error?.code, 4403, `neither UNAUTHENTICATED nor a 4403 close: ${JSON.stringify(error)} (${error})`);
      else assert.equal(code, 'UNAUTHENTICATED', JSON.stringify(error));
      return true;
    });
  });

  it('sockets destroyed while their credentials are checked are not counted against their caller (no lock-out by 4429)', async () => {
    const carol = await bearer('carol');
    // 60 sockets that send connection_init and go at once, before their answer (a flaky mobile network)
    await Promise.all(
      Array.from({ length: 60 }, (_, i) =>
        new Promise<void>((resolve) => {
          const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
          socket.on('error', () => undefined);
          socket.on('close', () => resolve());
          socket.on('open', () => {
            socket.send(JSON.stringify({ type: 'connection_init', payload: { Authorization: carol.authorization } }));
            setTimeout(() => socket.terminate(), i % 4);
          });
        }),
      ),
    );
    await sleep(500);
    // with none of them open, carol still gets her 3 connections (ASYNCPROC_MAX_CONNECTIONS_PER_CALLER)
    for (let i = 0; i < 3; i++) assert.equal((await wsInit({ Authorization: carol.authorization })).ack, true, `connection ${i + 1}`);
  });

  it('limits the graphql-ws connections one caller holds (4429), not other callers', async () => {
    const sockets: WebSocket[] = [];
    const open = (headers: Record<string, string>) =>
      new Promise<{ ack: boolean; code?: number }>((resolve) => {
        const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
        sockets.push(socket);
        socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload: { Authorization: headers.authorization } })));
        socket.on('message', (data) => JSON.parse(String(data)).type === 'connection_ack' && resolve({ ack: true }));
        socket.on('close', (code) => resolve({ ack: false, code }));
      });
    try {
      for (let i = 0; i < 3; i++) assert.equal((await open(bob)).ack, true);
      assert.deepEqual(await open(bob), { ack: false, code: 4429 });
      assert.equal((await open(alice)).ack, true, 'another caller is not counted against bob');
      sockets[0].close();
      await waitFor(async () => (await open(bob)).ack, 5_000, 'a freed connection to be usable again');
    } finally {
      for (const socket of sockets) socket.close();
    }
  });
});

describe('ownership: a plain caller sees only its own work, and cannot tell another\'s exists', () => {
  it('execution, executions with totalCount, running: only its own; admins and operators see all', async () => {
    const mine = await invoke(alice, 'demo.sleep', { seconds: 1 });
    const theirs = await invoke(bob, 'demo.sleep', { seconds: 1 });
    const read = (headers: Record<string, string>, tokenValue: string) =>
      t.gql(`query($t: ID!) { execution(token: $t) { token } }`, { t: tokenValue }, headers).then((r) => r.body.data.execution?.token ?? null);
    assert.equal(await read(alice, mine.token), mine.token);
    assert.equal(await read(alice, theirs.token), null, "another caller's token reads as an unknown one");
    assert.equal(await read(operator, theirs.token), theirs.token);
    assert.equal(await read(admin, theirs.token), theirs.token);

    const list = async (headers: Record<string, string>) => {
      const { body } = await t.gql(`{ executions(first: 500) { totalCount nodes { submittedBy } } }`, {}, headers);
      return body.data.executions as { totalCount: number; nodes: { submittedBy: string }[] };
    };
    const alices = await list(alice);
    assert.ok(alices.nodes.length > 0 && alices.nodes.every((n) => n.submittedBy === 'alice'), JSON.stringify(alices));
    assert.equal(alices.totalCount, alices.nodes.length);
    const everything = await list(operator);
    assert.ok(everything.nodes.some((n) => n.submittedBy === 'bob') && everything.totalCount > alices.totalCount);

    await waitFor(async () => {
      const { body } = await t.gql(`{ running { execution { submittedBy } } }`, {}, operator);
      return body.data.running.some((r: any) => r.execution.submittedBy === 'bob');
    }, 10_000, "bob's call to run");
    const { body } = await t.gql(`{ running { execution { submittedBy } } }`, {}, alice);
    assert.ok(body.data.running.every((r: any) => r.execution.submittedBy === 'alice'), JSON.stringify(body));
  });

  it('viewer says who the caller is and what it may do; submittedBy narrows a list to one subject, never past what the caller may see', async () => {
    const viewer = async (headers: Record<string, string>) =>
      (await t.gql(`{ viewer { subject roles via isAdmin seesEverything } }`, {}, headers)).body.data.viewer;
    assert.deepEqual(await viewer(alice), { subject: 'alice', roles: [], via: 'jwt', isAdmin: false, seesEverything: false });
    assert.deepEqual(await viewer(operator), { subject: 'olga', roles: ['operator'], via: 'jwt', isAdmin: false, seesEverything: true });
    assert.deepEqual(await viewer(admin), { subject: 'ada', roles: ['admin'], via: 'jwt', isAdmin: true, seesEverything: true });
    assert.equal((await t.gql(`{ viewer { subject } }`)).status, 401, 'no credentials, no viewer');

    await invoke(alice);
    await invoke(bob);
    const by = async (headers: Record<string, string>, subject: string) => {
      const { body } = await t.gql(`query($s: String) { executions(first: 500, filter: { submittedBy: $s }) { totalCount nodes { submittedBy } } }`, { s: subject }, headers);
      assert.equal(body.errors, undefined, JSON.stringify(body.errors));
      return body.data.executions as { totalCount: number; nodes: { submittedBy: string }[] };
    };
    const bobs = await by(operator, 'bob');
    assert.ok(bobs.nodes.length > 0 && bobs.nodes.every((n) => n.submittedBy === 'bob'), JSON.stringify(bobs));
    assert.equal(bobs.totalCount, bobs.nodes.length);
    assert.deepEqual(await by(alice, 'bob'), { totalCount: 0, nodes: [] }, "a plain caller asking for another's work gets nothing");
    const own = await by(alice, 'alice');
    assert.ok(own.nodes.length > 0 && own.nodes.every((n) => n.submittedBy === 'alice'));
  });

  it("cancelling another caller's execution or batch answers exactly as an unknown one does, and cancels nothing", async () => {
    const theirs = await invoke(bob, 'demo.sleep', { seconds: 30 });
    const unknown = '00000000-0000-4000-8000-000000000000';
    const cancel = (tokenValue: string, headers: Record<string, string>) =>
      t.gql(`mutation($t: ID!) { cancelExecution(token: $t) { execution { status } } }`, { t: tokenValue }, headers);
    const other = (await cancel(theirs.token, alice)).body.errors![0];
    const none = (await cancel(unknown, alice)).body.errors![0];
    assert.equal(other.extensions.code, 'NOT_FOUND');
    assert.deepEqual({ ...other, message: other.message.replace(theirs.token, 'T') }, { ...none, message: none.message.replace(unknown, 'T') });
    const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { status } }`, { t: theirs.token }, bob);
    assert.notEqual(body.data.execution.status, 'CANCELLED');
    assert.equal((await cancel(theirs.token, operator)).body.data.cancelExecution.execution.status, 'CANCELLED', 'an operator cancels anything');

    const batch = await t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.sleep", arguments: { seconds: 30 } }]] }) { batch { id } } }`, {}, bob);
    const id = batch.body.data.submitBatch.batch.id;
    const readBatch = (headers: Record<string, string>) => t.gql(`query($id: ID!) { batch(id: $id) { id status } }`, { id }, headers).then((r) => r.body.data.batch);
    assert.equal(await readBatch(alice), null);
    assert.equal((await readBatch(bob)).id, id);
    const refusedCancel = await t.gql(`mutation($id: ID!) { cancelBatch(id: $id) { batch { status } } }`, { id }, alice);
    assert.equal(refusedCancel.body.errors?.[0].extensions.code, 'NOT_FOUND');
    assert.equal((await readBatch(bob)).status, 'RUNNING');
    const done = await t.gql(`mutation($id: ID!) { cancelBatch(id: $id) { batch { status } } }`, { id }, bob);
    assert.equal(done.body.data.cancelBatch.batch.status, 'CANCELLED');
  });

  it("subscriptions: another caller's token or batch is NOT_FOUND; executionEvents carries only the caller's own", async () => {
    const theirs = await invoke(bob);
    const batch = await t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.add", arguments: { a: 1, b: 1 } }]] }) { batch { id } } }`, {}, bob);
    const batchId = batch.body.data.submitBatch.batch.id;
    const client = t.ws({ Authorization: alice.authorization });
    /** The one result of a subscription: its error's code, the same for another caller's id as for an unknown one. */
    const outcome = async (query: string, id: string, unknown: string) => {
      const [result] = await collect(client.iterate({ query: query.replace('ID', id) }), 1, 10_000);
      const [other] = await collect(client.iterate({ query: query.replace('ID', unknown) }), 1, 10_000);
      assert.equal(result.data ?? null, null, JSON.stringify(result));
      assert.equal(result.errors?.[0]?.message.replace(id, 'X'), other.errors?.[0]?.message.replace(unknown, 'X'));
      return (result.errors?.[0] as any)?.extensions?.code;
    };
    const unknown = '00000000-0000-4000-8000-000000000000';
    assert.equal(await outcome('subscription { executionCompleted(token: "ID") { status } }', theirs.token, unknown), 'NOT_FOUND');
    assert.equal(await outcome('subscription { batchCompleted(id: "ID") { status } }', batchId, unknown), 'NOT_FOUND');
    const [own] = await collect(t.ws({ Authorization: bob.authorization }).iterate({ query: `subscription { executionCompleted(token: "${theirs.token}") { status } }` }), 1);
    assert.deepEqual(own.data, { executionCompleted: { status: 'SUCCEEDED' } }, 'its owner hears it');

    // from a cursor taken now: bob's and alice's calls interleave; alice hears only hers (replay and live)
    const cursor = (await t.gql(`{ changeCursor }`, {}, alice)).body.data.changeCursor;
    const before = [await invoke(bob), await invoke(alice)];
    const stream = client.iterate<{ executionEvents: { status: string; execution: { token: string; submittedBy: string } } }>({
      query: `subscription($after: String) { executionEvents(after: $after, filter: { status: [SUCCEEDED] }) { status execution { token submittedBy } } }`,
      variables: { after: cursor },
    });
    const during = [await invoke(bob), await invoke(alice)];
    // alice's calls of earlier tests may end after the cursor too: read until both of these came
    const heard: { token: string; submittedBy: string }[] = [];
    const reading = (async () => {
      for await (const event of stream) {
        heard.push(event.data!.executionEvents.execution);
        if ([before[1].token, during[1].token].every((token) => heard.some((e) => e.token === token))) break;
      }
    })();
    await Promise.race([reading, sleep(20_000)]);
    await stream.return?.();
    const tokens = heard.map((e) => e.token);
    assert.ok(tokens.includes(before[1].token) && tokens.includes(during[1].token), `alice heard ${JSON.stringify(heard)}`);
    assert.ok(!tokens.includes(before[0].token) && !tokens.includes(during[0].token), "alice heard bob's call");
    assert.ok(heard.every((e) => e.submittedBy === 'alice'), JSON.stringify(heard));
  });
});

describe('roles', () => {
  it('admin-only mutations and queries are FORBIDDEN to operators and plain callers', async () => {
    for (const headers of [alice, operator]) {
      await refused(() => t.gql(`mutation { configureQueue(input: { name: "q-${Date.now()}", concurrency: 2 }) { queue { name } } }`, {}, headers), 'FORBIDDEN');
      await refused(() => t.gql(`mutation { createApiKey(input: { name: "k" }) { secret } }`, {}, headers), 'FORBIDDEN');
      await refused(() => t.gql(`{ apiKeys { id } }`, {}, headers), 'FORBIDDEN');
      await refused(() => t.gql(`mutation { registerProcedure(input: { name: "demo.add" }) { procedure { name } } }`, {}, headers), 'FORBIDDEN');
      await refused(() => t.gql(`mutation { unregisterProcedure(name: "demo.add") { procedure { name } } }`, {}, headers), 'FORBIDDEN');
    }
    const { body } = await t.gql(`mutation { configureQueue(input: { name: "by-admin", concurrency: 2 }) { queue { name concurrency } } }`, {}, admin);
    assert.deepEqual(body.data.configureQueue.queue, { name: 'by-admin', concurrency: 2 });
  });

  it('schedules: created, changed, paused, resumed and deleted by admins only; a bad cron is BAD_USER_INPUT; fires are the creator\'s; only admins and operators read them', async () => {
    const create = (headers: Record<string, string>, cron = '* * * * * *') =>
      t.gql(
        `mutation { createSchedule(input: { name: "by-admin", procedure: "demo.add", arguments: { a: 1, b: 2 }, cron: "${cron}" }) { schedule { name createdBy paused } } }`,
        {},
        headers,
      );
    for (const headers of [alice, operator]) {
      await refused(() => create(headers), 'FORBIDDEN');
      for (const action of ['pauseSchedule', 'resumeSchedule', 'deleteSchedule']) {
        await refused(() => t.gql(`mutation { ${action}(name: "by-admin") { schedule { name } } }`, {}, headers), 'FORBIDDEN');
      }
      await refused(() => t.gql(`mutation { updateSchedule(name: "by-admin", input: { cron: "0 * * * *" }) { schedule { name } } }`, {}, headers), 'FORBIDDEN');
    }
    await refused(() => create(admin, '99 * * * *'), 'BAD_USER_INPUT');
    const { body } = await create(admin);
    assert.deepEqual(body.data.createSchedule.schedule, { name: 'by-admin', createdBy: 'ada', paused: false });
    const fires = `{ schedule(name: "by-admin") { executions(first: 5) { totalCount nodes { submittedBy } } } }`;
    const seen = await waitFor(async () => {
      const { body } = await t.gql(fires, {}, admin);
      // the count and the page are separate reads: a fire may commit between them, so wait for a row in the page
      return body.data.schedule.executions.nodes.length >= 1 ? body.data.schedule.executions : null;
    });
    assert.equal(seen.nodes[0].submittedBy, 'ada');
    await refused(() => t.gql(fires, {}, alice), 'FORBIDDEN');
    await refused(() => t.gql(`{ schedules { name arguments } }`, {}, alice), 'FORBIDDEN');
    const asOperator = await t.gql(`{ schedules { name } }`, {}, operator);
    assert.deepEqual(asOperator.body.data.schedules, [{ name: 'by-admin' }], 'operators read schedules');
    const paused = await t.gql(`mutation { pauseSchedule(name: "by-admin") { schedule { paused nextRunAt } } }`, {}, admin);
    assert.deepEqual(paused.body.data.pauseSchedule.schedule, { paused: true, nextRunAt: null });
    const deleted = await t.gql(`mutation { deleteSchedule(name: "by-admin") { schedule { name } } }`, {}, admin);
    assert.equal(deleted.body.data.deleteSchedule.schedule.name, 'by-admin');
    await refused(() => t.gql(`mutation { deleteSchedule(name: "by-admin") { schedule { name } } }`, {}, admin), 'NOT_FOUND');
  });

  it('a procedure registered with roles is invoked only by holders of one of them (or admin); nothing is enqueued otherwise', async () => {
    const register = await t.gql(
      `mutation { registerProcedure(input: { name: "demo.record", roles: ["ledger"] }) { procedure { name roles } } }`,
      {},
      admin,
    );
    assert.deepEqual(register.body.data.registerProcedure.procedure, { name: 'demo.record', roles: ['ledger'] });
    const call = (headers: Record<string, string>) =>
      t.gql(`mutation { invokeMany(inputs: [{ procedure: "demo.add", arguments: { a: 1, b: 1 } }, { procedure: "demo.record", arguments: { tag: "r" } }]) { executions { token } } }`, {}, headers);
    const error = await refused(() => call(alice), 'FORBIDDEN');
    assert.match(error.message, /demo\.record/);
    await refused(() => t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.record", arguments: { tag: "r" } }]] }) { batch { id } } }`, {}, operator), 'FORBIDDEN');
    assert.equal((await call(await bearer('lena', ['ledger']))).body.data.invokeMany.executions.length, 2);
    assert.equal((await call(admin)).body.data.invokeMany.executions.length, 2);
    await t.gql(`mutation { registerProcedure(input: { name: "demo.record" }) { procedure { name } } }`, {}, admin);
    assert.equal((await call(alice)).body.data.invokeMany.executions.length, 2, 'open again once re-registered without roles');
    await refused(() => t.gql(`mutation { registerProcedure(input: { name: "demo.record", roles: ["no spaces"] }) { procedure { name } } }`, {}, admin), 'BAD_USER_INPUT');
  });

  it('unregisterProcedure stops new calls; a second unregister is NOT_FOUND', async () => {
    const tmp = await t.gql(`mutation { registerProcedure(input: { name: "demo.fail" }) { procedure { name } } }`, {}, admin);
    assert.equal(tmp.body.data.registerProcedure.procedure.name, 'demo.fail');
    const gone = await t.gql(`mutation { unregisterProcedure(name: "demo.fail") { procedure { name } } }`, {}, admin);
    assert.equal(gone.body.data.unregisterProcedure.procedure.name, 'demo.fail');
    await refused(() => t.gql(`mutation { invoke(input: { procedure: "demo.fail", arguments: {} }) { execution { token } } }`, {}, admin), 'UNKNOWN_PROCEDURE');
    await refused(() => t.gql(`mutation { unregisterProcedure(name: "demo.fail") { procedure { name } } }`, {}, admin), 'NOT_FOUND');
    await t.gql(`mutation { registerProcedure(input: { name: "demo.fail" }) { procedure { name } } }`, {}, admin);
  });
});

describe('API keys', () => {
  it('an admin creates a key (secret shown once), a service uses it, revoking it stops it at once', async () => {
    const created = await t.gql(`mutation { createApiKey(input: { name: "billing", roles: ["operator"] }) { secret apiKey { id name roles prefix subject createdBy revokedAt } } }`, {}, admin);
    const { secret, apiKey } = created.body.data.createApiKey;
    assert.match(secret, /^apk_/);
    assert.equal(apiKey.prefix, secret.slice(0, 8));
    assert.deepEqual({ ...apiKey, id: undefined, prefix: undefined }, { id: undefined, prefix: undefined, name: 'billing', roles: ['operator'], subject: 'apikey:billing', createdBy: 'ada', revokedAt: null });
    const listed = await t.gql(`{ apiKeys { id name } }`, {}, admin);
    assert.ok(!JSON.stringify(listed.body).includes(secret.slice(8)), 'the secret is never listed');
    await refused(() => t.gql(`mutation { createApiKey(input: { name: "billing" }) { secret } }`, {}, admin), 'BAD_USER_INPUT');

    for (const authorization of [`ApiKey ${secret}`, `Bearer ${secret}`]) {
      const execution = await invoke({ authorization });
      assert.equal(execution.submittedBy, 'apikey:billing');
    }
    // an operator key sees everyone's work
    const theirs = await invoke(bob);
    const seen = await t.gql(`query($t: ID!) { execution(token: $t) { token } }`, { t: theirs.token }, { authorization: `ApiKey ${secret}` });
    assert.equal(seen.body.data.execution.token, theirs.token);

    const revoked = await t.gql(`mutation($id: ID!) { revokeApiKey(id: $id) { apiKey { revokedAt } } }`, { id: apiKey.id }, admin);
    assert.ok(revoked.body.data.revokeApiKey.apiKey.revokedAt);
    await refused(() => t.gql(`{ procedures { name } }`, {}, { authorization: `ApiKey ${secret}` }), 'UNAUTHENTICATED', 401);
    await refused(() => t.gql(`{ procedures { name } }`, {}, { authorization: `ApiKey apk_${'x'.repeat(43)}` }), 'UNAUTHENTICATED', 401);
    assert.equal((await wsInit({ Authorization: `ApiKey ${secret}` })).code, 4403, 'a revoked key opens no socket');
  });
});

describe('credentials that lapse while a socket or a stream is open', () => {
  /** A raw graphql-transport-ws socket, acknowledged: what it is sent, every message it gets, and how it closes. */
  async function socketWith(authorization: string) {
    const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
    const messages: any[] = [];
    const closed = new Promise<{ code: number; reason: string }>((resolve) => socket.on('close', (code, reason) => resolve({ code, reason: String(reason) })));
    await new Promise<void>((resolve, reject) => {
      socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload: { Authorization: authorization } })));
      socket.on('message', (data) => {
        const message = JSON.parse(String(data));
        messages.push(message);
        if (message.type === 'connection_ack') resolve();
      });
      socket.on('close', (code) => reject(new Error(`closed ${code} before its ack`)));
    });
    const send = (message: unknown) => socket.send(JSON.stringify(message));
    return { socket, messages, closed, send };
  }
  const newKey = async (name: string, roles: string[]) => {
    const { body } = await t.gql(`mutation($i: CreateApiKeyInput!) { createApiKey(input: $i) { secret apiKey { id } } }`, { i: { name, roles } }, admin);
    return { secret: body.data.createApiKey.secret as string, id: body.data.createApiKey.apiKey.id as string };
  };

  it('a revoked API key: its open socket is closed 4403 and its running stream ends; nothing more is done with it', async () => {
    const key = await newKey('lapsing-admin', ['admin']);
    const ws = await socketWith(`ApiKey ${key.secret}`);
    ws.send({ id: 'events', type: 'subscribe', payload: { query: 'subscription { executionEvents { status execution { token } } }' } });
    const sse = t.sse({ authorization: `ApiKey ${key.secret}` }).iterate<{ executionEvents: { execution: { token: string } } }>({ query: 'subscription { executionEvents { status execution { token } } }' });
    const sseSeen: any[] = [];
    const sseDone = (async () => {
      for await (const event of sse) sseSeen.push(event);
    })().catch((error) => sseSeen.push({ thrown: error }));
    // calls until both streams have heard one (each stream begins at its first read)
    await waitFor(
      async () => {
        await invoke(alice);
        await sleep(300);
        return ws.messages.some((m) => m.type === 'next' && m.payload.data?.executionEvents?.execution?.token) && sseSeen.some((e) => e.data?.executionEvents?.execution?.token);
      },
      15_000,
      'both streams to stream',
    );

    const revoked = await t.gql(`mutation($id: ID!) { revokeApiKey(id: $id) { apiKey { revokedAt } } }`, { id: key.id }, admin);
    assert.ok(revoked.body.data.revokeApiKey.apiKey.revokedAt);
    const { code } = await Promise.race([ws.closed, sleep(5_000).then(() => ({ code: -1, reason: '' }))]);
    assert.equal(code, 4403, 'the socket is closed within seconds');
    // the SSE stream ends at its next event, told why
    await invoke(alice);
    await Promise.race([sseDone, sleep(10_000)]);
    const last = sseSeen.at(-1);
    const told = last?.errors?.[0] ?? last?.thrown?.[0] ?? last?.thrown;
    assert.equal(told?.extensions?.code, 'UNAUTHENTICATED', JSON.stringify(sseSeen.slice(-2)));
    // and a socket opened before the revocation can create nothing (it is closed; a new one is refused)
    assert.equal((await wsInit({ Authorization: `ApiKey ${key.secret}` })).code, 4403);
    const keys = await t.gql(`{ apiKeys { name } }`, {}, admin);
    assert.ok(!keys.body.data.apiKeys.some((k: { name: string }) => k.name.startsWith('made-after-revoke')));
  });

  it('a revoked API key cannot subscribe or query on a socket opened before, even between the periodic checks', async () => {
    const key = await newKey('lapsing-operator', ['operator']);
    const ws = await socketWith(`ApiKey ${key.secret}`);
    ws.send({ id: 'q1', type: 'subscribe', payload: { query: '{ viewer { subject } }' } });
    await waitFor(async () => ws.messages.some((m) => m.id === 'q1' && m.type === 'next'), 5_000, 'a first query');
    await t.gql(`mutation($id: ID!) { revokeApiKey(id: $id) { apiKey { revokedAt } } }`, { id: key.id }, admin);
    // at once, before the next periodic check: the revocation here forgets what was looked up
    ws.send({ id: 'q2', type: 'subscribe', payload: { query: `mutation { createApiKey(input: { name: "made-after-revoke", roles: ["admin"] }) { secret } }` } });
    const { code } = await ws.closed;
    assert.equal(code, 4403);
    assert.ok(!ws.messages.some((m) => m.id === 'q2' && m.type === 'next'), JSON.stringify(ws.messages));
    const keys = await t.gql(`{ apiKeys { name } }`, {}, admin);
    assert.ok(!keys.body.data.apiKeys.some((k: { name: string }) => k.name === 'made-after-revoke'), 'no key was made');
  });

  it('an SSE stream that hears nothing ends within seconds of its credentials lapsing, told why (a revoked API key, a JWT past its exp)', async () => {
    // idle streams: a filter nothing matches; before, they stayed open (each holding a slot of its caller's SSE streams)
    const idle = 'subscription { executionEvents(filter: { procedure: "demo.nothing-runs-this" }) { status } }';
    const key = await newKey('lapsing-idle', ['operator']);
    const shortLived = await token('alice', [], { expiresIn: '3s' });
    const hubBefore = t.app.hub!.size;
    const streams = [`ApiKey ${key.secret}`, `Bearer ${shortLived}`].map((authorization) => {
      const seen: any[] = [];
      const ended = (async () => {
        for await (const event of t.sse({ authorization }).iterate({ query: idle })) seen.push({ event, at: Date.now() });
      })().catch((error) => seen.push({ thrown: error, at: Date.now() }));
      return { seen, ended };
    });
    await waitFor(async () => t.app.hub!.size >= hubBefore + 2, 5_000, 'both streams to begin');
    const revokedAt = Date.now();
    await t.gql(`mutation($id: ID!) { revokeApiKey(id: $id) { apiKey { revokedAt } } }`, { id: key.id }, admin);
    for (const [i, stream] of streams.entries()) {
      await Promise.race([stream.ended, sleep(8_000)]);
      const last = stream.seen.at(-1);
      const told = last?.event?.errors?.[0] ?? last?.thrown?.[0] ?? last?.thrown;
      assert.equal(told?.extensions?.code, 'UNAUTHENTICATED', `stream ${i}: ${JSON.stringify(stream.seen)}`);
      assert.ok(last.at - revokedAt < 6_000, `stream ${i} ended ${last.at - revokedAt} ms after the revocation`);
    }
    await waitFor(async () => t.app.hub!.size === hubBefore, 5_000, 'the hub to let both streams go');
  });

  it('a rotated API key: old and new secrets work as one caller through the overlap; at its end the old one stops and its open socket is closed 4403', async () => {
    const key = await newKey('rotating', []);
    const old = { authorization: `ApiKey ${key.secret}` };
    const mine = await invoke(old);
    const ws = await socketWith(old.authorization);
    const ROTATE = `mutation($i: RotateApiKeyInput!) { rotateApiKey(input: $i) { secret apiKey { id name roles subject active revokedAt } previous { id active revokedAt } } }`;
    // refused, changing nothing: not an admin, a bad overlap, a malformed or unknown id
    const keysNow = async () => JSON.stringify((await t.gql(`{ apiKeys { id revokedAt } }`, {}, admin)).body.data.apiKeys);
    const unchanged = await keysNow();
    await refused(() => t.gql(ROTATE, { i: { id: key.id } }, old), 'FORBIDDEN');
    await refused(() => t.gql(ROTATE, { i: { id: key.id } }, operator), 'FORBIDDEN');
    for (const overlapSeconds of [-1, 30 * 24 * 3600 + 1]) await refused(() => t.gql(ROTATE, { i: { id: key.id, overlapSeconds } }, admin), 'BAD_USER_INPUT');
    await refused(() => t.gql(ROTATE, { i: { id: 'not-a-key' } }, admin), 'BAD_USER_INPUT');
    await refused(() => t.gql(ROTATE, { i: { id: '00000000-0000-4000-8000-000000000000' } }, admin), 'NOT_FOUND');
    assert.equal(await keysNow(), unchanged, 'no key changed');

    const rotatedAt = Date.now();
    const { body } = await t.gql(ROTATE, { i: { id: key.id, overlapSeconds: 3 } }, admin);
    const { secret, apiKey, previous } = body.data.rotateApiKey;
    assert.match(secret, /^apk_/);
    assert.deepEqual({ ...apiKey, id: undefined }, { id: undefined, name: 'rotating', roles: [], subject: 'apikey:rotating', active: true, revokedAt: null });
    assert.equal(previous.id, key.id);
    assert.equal(previous.active, true, 'the old key works on through its overlap');
    const stops = Date.parse(previous.revokedAt) - rotatedAt;
    assert.ok(stops > 2000 && stops < 4000, `the old key stops ${stops} ms after the rotation`);
    await refused(() => t.gql(ROTATE, { i: { id: key.id } }, admin), 'BAD_USER_INPUT');

    // both secrets, as one caller: the new one sees and owns the old one's work
    const renewed = { authorization: `ApiKey ${secret}` };
    for (const headers of [old, renewed]) assert.equal((await invoke(headers)).submittedBy, 'apikey:rotating');
    const seen = await t.gql(`query($t: ID!) { execution(token: $t) { token } }`, { t: mine.token }, renewed);
    assert.equal(seen.body.data.execution?.token, mine.token, JSON.stringify(seen.body));
    assert.equal(ws.messages.length, 1, 'the socket opened with the old key is still open');

    // the overlap's end: the old key's socket is closed, its requests refused; the new key works on
    const { code } = await Promise.race([ws.closed, sleep(8_000).then(() => ({ code: -1, reason: '' }))]);
    const closedAfter = Date.now() - rotatedAt;
    assert.equal(code, 4403);
    assert.ok(closedAfter >= 2500, `closed ${closedAfter} ms after the rotation, not before the overlap ended`);
    await refused(() => t.gql(`{ viewer { subject } }`, {}, old), 'UNAUTHENTICATED', 401);
    assert.equal((await wsInit({ Authorization: old.authorization })).code, 4403);
    assert.equal((await invoke(renewed)).submittedBy, 'apikey:rotating');
    const listed = (await t.gql(`{ apiKeys { id active } }`, {}, admin)).body.data.apiKeys;
    assert.deepEqual([listed.find((k: any) => k.id === key.id).active, listed.find((k: any) => k.id === apiKey.id).active], [false, true]);
  });

  it('a JWT past its exp: its open socket is closed 4403, its running subscription ends', async () => {
    const shortLived = await token('alice', [], { expiresIn: '2s' });
    const ws = await socketWith(`Bearer ${shortLived}`);
    ws.send({ id: 'events', type: 'subscribe', payload: { query: 'subscription { executionEvents { status execution { token } } }' } });
    const { code } = await Promise.race([ws.closed, sleep(6_000).then(() => ({ code: -1, reason: '' }))]);
    assert.equal(code, 4403);
  });
});

describe('api-key command', () => {
  it('makes the first admin key from the command line; list shows it; revoke stops it', async () => {
    // not spawnSync: a blocked event loop lets the service's idle keep-alive sockets time out
    // under the test's HTTP client, whose next request then fails
    const cli = async (...args: string[]) => {
      const run = await execFileAsync(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'api-key', ...args], {
        cwd: new URL('..', import.meta.url).pathname,
        env: { ...process.env, DATABASE_URL: databaseUrl, ASYNCPROC_AUTH: 'required' },
        encoding: 'utf8',
      }).catch((error: { code?: number; stderr?: string }) => assert.fail(`exit ${error.code}: ${error.stderr}`));
      return run.stdout.trim();
    };
    const secret = await cli('create', '--name', 'first-admin', '--roles', 'admin');
    assert.match(secret, /^apk_[A-Za-z0-9_-]{43}$/);
    const keys = await t.gql(`{ apiKeys { id name roles } }`, {}, { authorization: `ApiKey ${secret}` });
    const key = keys.body.data.apiKeys.find((k: { name: string }) => k.name === 'first-admin');
    assert.deepEqual(key.roles, ['admin'], 'the key works, as an admin');
    assert.match(await cli('list'), /first-admin\s+roles=admin/);
    // rotated: a new secret for the same name and roles; the old one works through the overlap
    const renewed = await cli('rotate', key.id, '--overlap', '600');
    assert.match(renewed, /^apk_[A-Za-z0-9_-]{43}$/);
    for (const s of [secret, renewed]) {
      const { body } = await t.gql(`{ viewer { subject roles } }`, {}, { authorization: `ApiKey ${s}` });
      assert.deepEqual(body.data.viewer, { subject: 'apikey:first-admin', roles: ['admin'] });
    }
    assert.match(await cli('list'), new RegExp(`${key.id}\\s+first-admin\\s+roles=admin\\s+\\S+…\\s+created \\S+\\s+ROTATED, stops `));
    for (const [args, message] of [
      [['rotate', key.id], /rotated already/],
      [['rotate', key.id, '--overlap', 'soon'], /overlapSeconds/],
    ] as const) {
      const failed = await execFileAsync(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'api-key', ...args], {
        cwd: new URL('..', import.meta.url).pathname,
        env: { ...process.env, DATABASE_URL: databaseUrl },
        encoding: 'utf8',
      }).then(
        () => assert.fail(`${args.join(' ')} succeeded`),
        (error: { code?: number; stderr?: string }) => error,
      );
      assert.equal(failed.code, 1);
      assert.match(failed.stderr ?? '', message);
    }
    assert.match(await cli('revoke', key.id), /REVOKED/);
    await refused(() => t.gql(`{ apiKeys { id } }`, {}, { authorization: `ApiKey ${secret}` }), 'UNAUTHENTICATED', 401);
    assert.equal((await t.gql(`{ viewer { subject } }`, {}, { authorization: `ApiKey ${renewed}` })).body.data.viewer.subject, 'apikey:first-admin');
  });
});

describe('JWT keys', () => {
  it('verifies ES256 tokens against a public key and against a JWKS, with roles from a nested claim', async () => {
    const { publicKey, privateKey } = await generateKeyPair('ES256', { extractable: true });
    const sign = (payload: JWTPayload, kid?: string) =>
      new SignJWT(payload).setProtectedHeader({ alg: 'ES256', kid }).setSubject('svc').setExpirationTime('5m').sign(privateKey);
    const byKey = new JwtVerifier({ publicKey: await exportSPKI(publicKey), rolesClaim: 'realm_access.roles' });
    const verified = await byKey.verify(await sign({ realm_access: { roles: ['operator', 'bad role!', 'billing'] } }));
    assert.deepEqual(verified, { subject: 'svc', roles: ['operator', 'billing'], expiresAt: verified.expiresAt });
    // an HS256 token made with the public key as its secret (the classic confusion) is refused
    const confused = await new SignJWT({}).setProtectedHeader({ alg: 'HS256' }).setSubject('eve').sign(new TextEncoder().encode(await exportSPKI(publicKey)));
    await assert.rejects(byKey.verify(confused), /HS256 tokens are not accepted/);

    const jwk = { ...(await exportJWK(publicKey)), kid: 'k1', alg: 'ES256', use: 'sig' };
    const jwks: Server = createServer((_req, res) => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ keys: [jwk] })));
    await new Promise<void>((resolve) => jwks.listen(0, '127.0.0.1', resolve));
    try {
      const byJwks = new JwtVerifier({ jwksUrl: `http://127.0.0.1:${(jwks.address() as AddressInfo).port}/jwks.json`, rolesClaim: 'scope' });
      assert.deepEqual((await byJwks.verify(await sign({ scope: 'admin operator' }, 'k1'))).roles, ['admin', 'operator']);
      const other = await generateKeyPair('ES256');
      const foreign = await new SignJWT({}).setProtectedHeader({ alg: 'ES256', kid: 'k1' }).setSubject('eve').setExpirationTime('5m').sign(other.privateKey);
      await assert.rejects(byJwks.verify(foreign), /signature/);
    } finally {
      jwks.close();
    }
  });
});

describe('configuration', () => {
  it('a service given DATABASE_URL refuses to start without authentication unless ASYNCPROC_AUTH=none', async () => {
    const url = await cluster.createDatabase();
    const config = loadConfig({ DATABASE_URL: url, PORT: '0', HOST: '127.0.0.1' });
    assert.throws(() => authSettings(config), ConfigError);
    await assert.rejects(startApp(config, silentLogger), /no authentication configured/);
    assert.equal(authSettings(loadConfig({ DATABASE_URL: url, ASYNCPROC_AUTH: 'none' })).mode, 'none');
    assert.equal(authSettings(loadConfig({ DATABASE_URL: url, ASYNCPROC_AUTH: 'required' })).mode, 'required');
    assert.equal(authSettings(loadConfig({ DATABASE_URL: url, ASYNCPROC_JWT_SECRET: SECRET })).mode, 'required');
    assert.equal(authSettings(loadConfig({})).mode, 'none', 'the embedded development database');
    assert.throws(() => loadConfig({ ASYNCPROC_AUTH: 'none', ASYNCPROC_JWT_SECRET: SECRET }), /ASYNCPROC_AUTH/);
    assert.throws(() => loadConfig({ ASYNCPROC_JWT_SECRET: 'short' }), /ASYNCPROC_JWT_SECRET/);
  });
});

/** A service on a database of its own, with JWTs and this mutation rate (per second) and burst. */
async function rateLimitedApp(rate: string, burst: string): Promise<TestApp> {
  return startTestApp(await cluster.createDatabase(), {
    ASYNCPROC_JWT_SECRET: SECRET,
    ASYNCPROC_JWT_ISSUER: ISSUER,
    ASYNCPROC_JWT_AUDIENCE: AUDIENCE,
    ASYNCPROC_RATE_LIMIT: rate,
    ASYNCPROC_RATE_BURST: burst,
  });
}

describe('rate limit', () => {
  it('a caller over its mutation rate gets RATE_LIMITED with Retry-After, others do not, and it recovers', async () => {
    const limited = await rateLimitedApp('2', '3');
    try {
      const mutate = (headers: Record<string, string>) =>
        fetch(limited.url, {
          method: 'POST',
          headers: { 'content-type': 'application/json', ...headers },
          body: JSON.stringify({ query: 'mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 1 } }) { execution { token } } }' }),
        });
      for (let i = 0; i < 3; i++) assert.equal((await mutate(alice)).status, 200);
      const refusedResponse = await mutate(alice);
      assert.equal(refusedResponse.status, 429);
      assert.equal(refusedResponse.headers.get('retry-after'), '1');
      const body = await refusedResponse.json();
      assert.equal(body.errors[0].extensions.code, 'RATE_LIMITED');
      assert.equal(body.data?.invoke ?? null, null);
      const count = await limited.gql(`{ executions { totalCount } }`, {}, admin);
      assert.equal(count.body.data.executions.totalCount, 3, 'the refused mutation enqueued nothing; queries are not limited');
      assert.equal((await mutate(bob)).status, 200, 'another caller has its own budget');
      await sleep(600);
      assert.equal((await mutate(alice)).status, 200, 'a token is back after 1/rate seconds');
      // over graphql-ws the same code, without the HTTP status and headers yoga reads from extensions.http
      const ws = limited.ws({ Authorization: alice.authorization });
      let overSocket: any = null;
      for (let i = 0; i < 5 && !overSocket; i++) {
        const [result] = await collect(ws.iterate({ query: 'mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 1 } }) { execution { token } } }' }));
        if ((result as any).errors) overSocket = (result as any).errors[0];
      }
      assert.equal(overSocket?.extensions?.code, 'RATE_LIMITED', JSON.stringify(overSocket));
      assert.equal(overSocket.extensions.http, undefined, JSON.stringify(overSocket));
    } finally {
      await limited.stop();
    }
  });
});

describe('rate limit: each root field of a mutation is one mutation', () => {
  it('aliased fields (and fields through fragments) each take a token; more than the burst in one request is refused and runs nothing', async () => {
    const limited = await rateLimitedApp('0.5', '4');
    try {
      const mutate = async (query: string, variables: Record<string, unknown> = {}) => {
        const response = await fetch(limited.url, { method: 'POST', headers: { 'content-type': 'application/json', ...alice }, body: JSON.stringify({ query, variables }) });
        return { status: response.status, body: (await response.json()) as { data?: any; errors?: { message: string; extensions?: { code?: string } }[] } };
      };
      const runAt = new Date(Date.now() + 3_600_000).toISOString();
      // one token: invokeMany is one mutation however many calls it submits
      const made = await mutate(`mutation($at: DateTime!) { invokeMany(inputs: [${'{ procedure: "demo.noop", runAt: $at } '.repeat(6)}]) { executions { token } } }`, { at: runAt });
      assert.equal(made.status, 200, JSON.stringify(made.body));
      const tokens = (made.body.data.invokeMany.executions as { token: string }[]).map((e) => e.token);
      const cancel = (i: number) => `c${i}: cancelExecution(token: "${tokens[i]}") { execution { status } }`;
      const cancelled = async () => (await limited.gql(`{ executions(filter: { status: CANCELLED }) { totalCount } }`, {}, admin)).body.data.executions.totalCount as number;

      const five = await mutate(`mutation { ${[0, 1, 2, 3, 4].map(cancel).join(' ')} }`);
      assert.equal(five.status, 429, JSON.stringify(five.body));
      assert.equal(five.body.errors?.[0].extensions?.code, 'RATE_LIMITED');
      assert.match(five.body.errors![0].message, /5 fields, at most 4/);
      assert.equal(await cancelled(), 0, 'nothing of it ran');

      // two through a fragment and one aliased beside it: three tokens, all that is left
      const three = await mutate(`mutation { ...Two ${cancel(2)} } fragment Two on Mutation { ${cancel(0)} ${cancel(1)} }`);
      assert.equal(three.status, 200, JSON.stringify(three.body));
      assert.equal(await cancelled(), 3);
      const one = await mutate(`mutation { ${cancel(3)} }`);
      assert.equal(one.status, 429, 'the burst is spent: three fields cost three tokens, not one');
      assert.equal(one.body.errors?.[0].extensions?.code, 'RATE_LIMITED');
      assert.equal(await cancelled(), 3);
    } finally {
      await limited.stop();
    }
  });
});

describe('reads per request', () => {
  it('Execution.history for a whole page is one engine read (dataloader); Batch.executions is paged', async () => {
    const batch = await t.gql(
      `mutation { submitBatch(input: { stages: [[{ procedure: "demo.add", arguments: { a: 1, b: 1 } }, { procedure: "demo.add", arguments: { a: 2, b: 2 } }, { procedure: "demo.add", arguments: { a: 3, b: 3 } }]] }) { batch { id } } }`,
      {},
      alice,
    );
    const id = batch.body.data.submitBatch.batch.id;
    const engine = t.app.engine;
    const getHistory = engine.getHistory.bind(engine);
    const getBatch = engine.getBatch.bind(engine);
    let historyReads = 0;
    let batchReads = 0;
    engine.getHistory = (ids) => (historyReads++, getHistory(ids));
    engine.getBatch = (batchId) => (batchReads++, getBatch(batchId));
    try {
      const { body } = await t.gql(`{ executions(first: 20) { nodes { history { number } batch { id } } } }`, {}, alice);
      assert.ok(body.data.executions.nodes.length >= 3, JSON.stringify(body));
      assert.equal(historyReads, 1, 'one history read for the page');
      assert.equal(batchReads, 1, 'the batch its three executions share is read once');
    } finally {
      engine.getHistory = getHistory;
      engine.getBatch = getBatch;
    }
    const page = await t.gql(
      `query($id: ID!) { batch(id: $id) { executions(first: 2) { pageInfo { hasNextPage endCursor } nodes { stage } } } }`,
      { id },
      alice,
    );
    const first = page.body.data.batch.executions;
    assert.equal(first.nodes.length, 2);
    assert.equal(first.pageInfo.hasNextPage, true);
    const rest = await t.gql(`query($id: ID!, $after: String) { batch(id: $id) { executions(first: 2, after: $after) { nodes { stage } } } }`, { id, after: first.pageInfo.endCursor }, alice);
    assert.equal(rest.body.data.batch.executions.nodes.length, 1);
  });
});
