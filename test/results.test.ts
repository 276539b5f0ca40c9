/**
 * Results that must come back whole and exact (issue 9, items 11–15): every OUT and INOUT
 * parameter, numbers past 2^53, routines dropped and created again, rows cut at the cap,
 * errors with their detail and context, relative dates fixed at submit. End to end over
 * GraphQL against the real service and a real PostgreSQL.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import { loadConfig } from '../src/config.js';
import { parseExactJson } from '../src/engines/exactJson.js';
import { startTestApp, type TestApp } from './support/app.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const EXECUTION = `token status arguments attempts error { number message detail context line }
  result { returnValue outputParameters rows rowCount truncated } history { status error { number message } }`;

let cluster: TestCluster;
let t: TestApp;
let sql: pg.Client;

before(async () => {
  cluster = await startTestCluster();
  const url = await cluster.createDatabase();
  t = await startTestApp(url);
  sql = await cluster.connect(url);
  await sql.query(`
    create schema billing;
    create function billing.pair(a int, out x int, out y text) language sql as $$ select a * 2, 'y' || a $$;
    create function billing.stats(out n bigint, out x numeric) language sql as $$ select 9007199254740993, 1.5 $$;
    create procedure billing.accumulate(a numeric, inout total numeric default null)
      language plpgsql as $$ begin total := coalesce(total, 100) + a; end $$;
    create function billing.scaled(a numeric, inout factor numeric default 2) language sql as $$ select a * factor $$;
    create function billing.big() returns bigint language sql as $$ select 9007199254740993 $$;
    create function billing.small() returns bigint language sql as $$ select 42::bigint $$;
    create procedure billing.echo(n bigint, d numeric, out n_out bigint, out d_out numeric)
      language plpgsql as $$ begin n_out := n; d_out := d; end $$;
    create function billing.ledger(n int) returns table (id bigint, amount numeric)
      language sql as $$ select 9007199254740990 + g, g / 3.0 from generate_series(1, n) g $$;
    create procedure billing.refuse(reason text) language plpgsql as $$
      begin raise exception 'refused' using detail = 'because ' || reason, errcode = '22023'; end $$;
    create procedure billing.charge(amount int, out receipt text) language sql as $$ select 'paid ' || amount $$;
    create procedure billing.on_day(d date, days date[], at timestamptz, out d_out date, out days_out date[], out at_out timestamptz)
      language plpgsql as $$ begin d_out := d; days_out := days; at_out := at; end $$;
    create type billing.money_pair as (amount int, label text);
    create domain billing.checked_pair as billing.money_pair check ((value).amount >= 0);
    create function billing.pair_of(a int) returns billing.checked_pair language sql as $$ select row(a, 'n' || a)::billing.checked_pair $$;
    create domain billing.doc as jsonb check (jsonb_typeof(value) = 'object');
    create domain billing.any_doc as jsonb;
    -- what arrived, each value with its type and its text
    create function billing.seen(docs jsonb[] default null, doc billing.doc default null, plain jsonb default null, grid int[] default null,
                                  loose billing.any_doc default null,
                                  out docs_out text, out doc_out text, out plain_out text, out grid_out text, out loose_out text)
      language plpgsql as $$ begin
        docs_out := pg_typeof(docs) || ' ' || docs::text; doc_out := doc::text; plain_out := plain::text; grid_out := grid::text;
        loose_out := loose::text;
      end $$;
    create function billing.total(variadic parts int[]) returns int language sql as $$ select sum(p)::int from unnest(parts) p $$;
    create function billing.ov(x integer) returns text language sql as $$ select 'integer ' || x $$;
    create function billing.ov(x text) returns text language sql as $$ select 'text ' || x $$;
    -- typed by length (a parameter has none: char(3) runs as bpchar), in and out, also run outside a transaction
    create procedure billing.codes(cur char(3), tags char(5)[], flags bit(4), out cur_out char(5), out tags_out text, out flags_out bit(4))
      language plpgsql as $$ begin cur_out := cur || 'xy'; tags_out := tags::text; flags_out := flags; end $$;
    create procedure billing.codes_nt(cur char(3), out cur_out char(5), out flags_out bit(4))
      language plpgsql as $$ begin cur_out := cur || 'xy'; flags_out := B'1011'; end $$;
    create domain billing.required as int not null;
    create procedure billing.take_required(v billing.required default 1, vs billing.required[] default null)
      language plpgsql as $$ begin end $$;
    create procedure billing.take_rel(r regclass, out r_out text) language plpgsql as $$ begin r_out := r::text; end $$;
    create type billing.stamped as (at timestamptz, label text);
    create function billing.spans(r tstzrange default null, s billing.stamped default null, days datemultirange default null,
                                   t timestamptz default null, out lower_out timestamptz, out at_out timestamptz, out days_out text, out t_out timestamptz)
      language plpgsql as $$ begin lower_out := lower(r); at_out := s.at; days_out := days::text; t_out := t; end $$;
    create schema "billing.x";
    create function "billing.x".y() returns int language sql as $$ select 1 $$;
    create function billing."x.y"() returns int language sql as $$ select 2 $$;
  `);
  for (const routine of [
    'billing.pair',
    'billing.stats',
    'billing.accumulate',
    'billing.scaled',
    'billing.big',
    'billing.small',
    'billing.echo',
    'billing.ledger',
    'billing.refuse',
    'billing.charge',
    'billing.on_day',
    'billing.pair_of',
    'billing.seen',
    'billing.total',
    'billing.codes',
    'billing.take_required',
    'billing.take_rel',
    'billing.spans',
  ]) {
    await sql.query(`select asyncproc.register(to_regproc($1)::oid::regprocedure)`, [routine]);
  }
  await sql.query(`select asyncproc.register(to_regproc('billing.codes_nt')::oid::regprocedure, transactional => false)`);
});
after(async () => {
  await sql?.end();
  await t?.stop();
  await cluster?.stop();
});

async function invoke(input: Record<string, unknown>) {
  const { body } = await t.gql(`mutation($input: InvokeInput!) { invoke(input: $input) { execution { ${EXECUTION} } } }`, { input });
  return body;
}

async function finished(token: string) {
  return waitFor(async () => {
    const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { ${EXECUTION} } }`, { t: token });
    const e = body.data?.execution;
    return e && ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(e.status) ? e : null;
  });
}

async function run(procedure: string, args: Record<string, unknown> = {}) {
  const body = await invoke({ procedure, arguments: args });
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return finished(body.data.invoke.execution.token);
}

/** The result as stored in the table, read as text so no number is rounded on the way. */
async function stored(token: string) {
  return (await sql.query<{ result: string }>(`select result::text as result from asyncproc.executions where token = $1`, [token])).rows[0]
    .result;
}

describe('output parameters', () => {
  it('a function with several OUT parameters returns every one, also in the stored result', async () => {
    const pair = await run('billing.pair', { a: 21 });
    assert.equal(pair.status, 'SUCCEEDED', JSON.stringify(pair.error));
    assert.deepEqual(pair.result.outputParameters, { x: 42, y: 'y21' });
    assert.equal(pair.result.returnValue, null);
    assert.deepEqual(JSON.parse(await stored(pair.token)).outputParameters, { x: 42, y: 'y21' });

    const stats = await run('billing.stats');
    assert.deepEqual(stats.result.outputParameters, { n: '9007199254740993', x: 1.5 });
    assert.match(await stored(stats.token), /"outputParameters": \{"n": 9007199254740993, "x": 1.5\}/);
  });

  it('an INOUT parameter left to its default still comes back (procedure and function)', async () => {
    const accumulated = await run('billing.accumulate', { a: 5 });
    assert.equal(accumulated.status, 'SUCCEEDED', JSON.stringify(accumulated.error));
    assert.deepEqual(accumulated.result.outputParameters, { total: 105 });
    assert.deepEqual((await run('billing.accumulate', { a: 5, total: 1 })).result.outputParameters, { total: 6 });
    assert.deepEqual((await run('billing.scaled', { a: 5 })).result.outputParameters, { factor: 10 });
  });
});

describe('numbers past 2^53', () => {
  it('travel as exact strings in returnValue, outputParameters and rows; safe ones stay numbers', async () => {
    assert.equal((await run('billing.big')).result.returnValue, '9007199254740993');
    assert.equal((await run('billing.small')).result.returnValue, 42);

    const ledger = await run('billing.ledger', { n: 3 });
    assert.deepEqual(ledger.result.rows, [
      { id: 9007199254740991, amount: '0.33333333333333333333' },
      { id: '9007199254740992', amount: '0.66666666666666666667' },
      { id: '9007199254740993', amount: 1 },
    ]);
  });

  it('arguments sent as strings for bigint and numeric parameters are accepted and exact', async () => {
    const echo = await run('billing.echo', { n: '9007199254740993', d: '12345678901234567890.123456789' });
    assert.equal(echo.status, 'SUCCEEDED', JSON.stringify(echo.error));
    assert.deepEqual(echo.result.outputParameters, { n_out: '9007199254740993', d_out: '12345678901234567890.123456789' });
    assert.deepEqual(echo.arguments, { n: '9007199254740993', d: '12345678901234567890.123456789' });
    assert.deepEqual((await run('billing.echo', { n: -42, d: 0.25 })).result.outputParameters, { n_out: -42, d_out: 0.25 });
  });

  it('the parser keeps every number that a double holds exactly, and only those', () => {
    assert.deepEqual(parseExactJson('[9007199254740991, -9007199254740991, 9007199254740992, -9007199254740993]'), [
      9007199254740991,
      -9007199254740991,
      '9007199254740992',
      '-9007199254740993',
    ]);
    assert.deepEqual(parseExactJson('[0.1, 1.10, 1e300, 1e400, 0.30000000000000004, 0.300000000000000000001, 100.0]'), [
      0.1,
      1.1,
      1e300,
      '1e400',
      0.30000000000000004,
      '0.300000000000000000001',
      100,
    ]);
    assert.deepEqual(parseExactJson('{"9007199254740993": "9007199254740993 \\" 9007199254740993"}'), {
      '9007199254740993': '9007199254740993 " 9007199254740993',
    });
  });
});

describe('a routine dropped and created again', () => {
  it('keeps its registration: procedures lists its parameters and calls run', async () => {
    assert.equal((await run('billing.charge', { amount: 1 })).status, 'SUCCEEDED');
    await sql.query(`drop procedure billing.charge(int);
      create procedure billing.charge(amount int, out receipt text) language sql as $$ select 'paid ' || amount $$;`);
    const { body } = await t.gql(`{ procedures { name parameters { name type mode } } }`);
    const charge = body.data.procedures.find((p: { name: string }) => p.name === 'billing.charge');
    assert.deepEqual(charge.parameters, [
      { name: 'amount', type: 'integer', mode: 'IN' },
      { name: 'receipt', type: 'text', mode: 'OUT' },
    ]);
    const again = await run('billing.charge', { amount: 2 });
    assert.equal(again.status, 'SUCCEEDED', JSON.stringify(again.error));
    assert.deepEqual(again.result.outputParameters, { receipt: 'paid 2' });
  });

  it('a session that called it before calls the new one: the statement it keeps is built again', async () => {
    // call_routine keeps each routine's last statement per session; one session sees every change here
    await sql.query(`create function billing.shape(a int, b int default 0, out x int) language sql as $$ select a + b $$;
      select asyncproc.register('billing.shape(int,int)');`);
    const proc = (await sql.query(`select proc::oid as oid from asyncproc.procedures where name = 'billing.shape'`)).rows[0].oid;
    const call = async (args: object) =>
      (await sql.query(`select asyncproc.call_routine($1::oid::regprocedure, $2, 100) as o`, [proc, JSON.stringify(args)])).rows[0].o
        .outputParameters;
    assert.deepEqual(await call({ a: 1 }), { x: 1 });
    assert.deepEqual(await call({ a: 1, b: 2 }), { x: 3 }); // other arguments present: another statement
    assert.deepEqual(await call({ a: 1 }), { x: 1 });
    // a setting made in a transaction that rolls back is left empty, not unset
    await sql.query('begin');
    await sql.query(`select asyncproc.call_routine($1::oid::regprocedure, '{"a": 1}', 7)`, [proc]);
    await sql.query('rollback');
    assert.deepEqual((await sql.query(`select asyncproc.call_routine($1::oid::regprocedure, '{"a": 1}', 7) as o`, [proc])).rows[0].o.outputParameters, { x: 1 });
    await sql.query(`drop function billing.shape(int, int);
      create function billing.shape(a int, b int default 0, out x int, out y int) language sql as $$ select a, b $$;`);
    assert.deepEqual(await call({ a: 1 }), { x: 1, y: 0 });
    await sql.query(`alter function billing.shape(int, int) rename to shape_before;
      create function billing.shape(a int, b int default 0, out z int) language sql as $$ select a * 10 $$;`);
    assert.deepEqual(await call({ a: 1 }), { z: 10 });
    await sql.query(`drop function billing.shape(int, int)`);
    await assert.rejects(call({ a: 1 }), /billing\.shape.* no longer exists/);
  });

  it('once gone: UNKNOWN_PROCEDURE at invoke, and a call already submitted FAILS with a clear error, not LOST', async () => {
    await sql.query(`create procedure billing.gone(n int) language sql as $$ select 1 $$;
      select asyncproc.register('billing.gone(int)');`);
    const body = await invoke({ procedure: 'billing.gone', arguments: { n: 1 }, runAt: new Date(Date.now() + 1500).toISOString() });
    const token = body.data.invoke.execution.token;
    await sql.query(`drop procedure billing.gone(int)`);

    const refused = await invoke({ procedure: 'billing.gone', arguments: { n: 1 } });
    assert.equal(refused.errors?.[0]?.extensions?.code, 'UNKNOWN_PROCEDURE', JSON.stringify(refused));
    assert.match(refused.errors[0].message, /no longer exists/);

    const done = await finished(token);
    assert.equal(done.status, 'FAILED');
    assert.equal(done.attempts, 1);
    assert.equal(done.error.number, '42883');
    assert.match(done.error.message, /billing\.gone.* no longer exists/);
    assert.deepEqual(
      done.history.map((a: { status: string }) => a.status),
      ['FAILED'],
    );
  });
});

describe('rows cut at the cap', () => {
  it('rowCount counts every row and truncated says they were cut', async () => {
    const many = await run('billing.ledger', { n: 150 });
    assert.equal(many.result.rows.length, 100);
    assert.equal(many.result.rowCount, 150);
    assert.equal(many.result.truncated, true);
    assert.deepEqual(many.result.rows[99], { id: '9007199254741090', amount: '33.3333333333333333' });

    const few = await run('billing.ledger', { n: 3 });
    assert.equal(few.result.rowCount, 3);
    assert.equal(few.result.truncated, false);

    const none = await run('billing.pair', { a: 1 });
    assert.equal(none.result.rowCount, null);
    assert.equal(none.result.truncated, false);
  });

  it("the cap is run()'s row_cap", async () => {
    const { rows } = await sql.query<{ outcome: { rows: unknown[]; rowCount: number; truncated: boolean } }>(
      `select asyncproc.call_routine('billing.ledger(int)', '{"n": 7}', 5) as outcome`,
    );
    assert.equal(rows[0].outcome.rows.length, 5);
    assert.equal(rows[0].outcome.rowCount, 7);
    assert.equal(rows[0].outcome.truncated, true);
    const zero = (await sql.query(`select asyncproc.call_routine('billing.ledger(int)', '{"n": 2}', 0) as outcome`)).rows[0].outcome;
    assert.deepEqual([zero.rows, zero.rowCount, zero.truncated], [[], 2, true]);
  });

  it(
    'ASYNCPROC_MAX_ROWS reaches the worker',
    async () => {
      const url = await cluster.createDatabase();
      const capped = await startTestApp(url, { ASYNCPROC_MAX_ROWS: '5' });
      try {
        const client = await cluster.connect(url);
        try {
          await client.query(`create function public.series(n int) returns setof int language sql as $$ select generate_series(1, n) $$;
            select asyncproc.register('public.series(int)')`);
        } finally {
          await client.end();
        }
        const invoked = await capped.gql(`mutation { invoke(input: { procedure: "public.series", arguments: { n: 8 } }) { execution { token } } }`);
        const token = invoked.body.data.invoke.execution.token;
        const result = await waitFor(async () => (await capped.gql(`{ execution(token: "${token}") { result { rows rowCount truncated } } }`)).body.data.execution.result);
        assert.deepEqual(result, { rows: [1, 2, 3, 4, 5].map((n) => ({ series: n })), rowCount: 8, truncated: true });
      } finally {
        await capped.stop();
      }
    },
  );

  it('ASYNCPROC_MAX_ROWS is validated', () => {
    assert.equal(loadConfig({}).ASYNCPROC_MAX_ROWS, 100);
    assert.equal(loadConfig({ ASYNCPROC_MAX_ROWS: '0' }).ASYNCPROC_MAX_ROWS, 0);
    assert.equal(loadConfig({ ASYNCPROC_MAX_ROWS: '5000' }).ASYNCPROC_MAX_ROWS, 5000);
    for (const bad of ['-1', '1.5', 'many', '100001']) {
      assert.throws(() => loadConfig({ ASYNCPROC_MAX_ROWS: bad }), /ASYNCPROC_MAX_ROWS/);
    }
  });
});

describe('errors', () => {
  it('carry the detail and context the database reported', async () => {
    const done = await run('billing.refuse', { reason: 'no funds' });
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error.number, '22023');
    assert.equal(done.error.detail, 'because no funds');
    assert.match(done.error.context, /PL\/pgSQL function billing\.refuse\(text\) line 2 at RAISE/);
    assert.equal(done.error.line, 2);
  });
});

describe('relative dates and times', () => {
  it('are resolved when the call is submitted, and the call runs with the resolved value', async () => {
    const { rows } = await sql.query<{ yesterday: string; today: string; tomorrow: string }>(
      `select (current_date - 1)::text as yesterday, current_date::text as today, (current_date + 1)::text as tomorrow`,
    );
    const before = Date.now();
    const body = await invoke({
      procedure: 'billing.on_day',
      arguments: { d: 'Yesterday', days: ['today', 'tomorrow', '2024-02-29', null], at: 'now' },
      runAt: new Date(Date.now() + 1000).toISOString(),
    });
    assert.equal(body.errors, undefined, JSON.stringify(body.errors));
    const submitted = body.data.invoke.execution;
    assert.equal(submitted.status, 'WAITING');
    assert.equal(submitted.arguments.d, rows[0].yesterday);
    assert.deepEqual(submitted.arguments.days, [rows[0].today, rows[0].tomorrow, '2024-02-29', null]);
    const at = Date.parse(submitted.arguments.at);
    assert.ok(at >= before - 5000 && at <= Date.now() + 5000, submitted.arguments.at);

    const done = await finished(submitted.token);
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    assert.equal(done.result.outputParameters.d_out, rows[0].yesterday);
    assert.equal(Date.parse(done.result.outputParameters.at_out), at, 'the moment of submit, not of the run');
  });
});

describe('values that arrive as they were sent, or are refused (a probe found each changed or failing late)', () => {
  it('a function returning a domain over a composite type returns every field, not the first one alone', async () => {
    const done = await run('billing.pair_of', { a: 7 });
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    assert.deepEqual(done.result.outputParameters, { amount: 7, label: 'n7' });
    assert.equal(done.result.returnValue, null);
  });

  it('json values stay what they are in a jsonb[] and in a domain over jsonb: a string is not read again as JSON', async () => {
    const done = await run('billing.seen', { docs: ['1', { a: 1 }, '{"b":2}', null], doc: { c: [1, '2'] }, plain: '{"d":3}', loose: '{"e":5}' });
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    const out = done.result.outputParameters;
    // before: {1,…} and objects refused; the domain's string became an object
    assert.equal(out.docs_out, 'jsonb[] {"\\"1\\"","{\\"a\\": 1}","\\"{\\\\\\"b\\\\\\":2}\\"",NULL}');
    assert.equal(out.doc_out, '{"c": [1, "2"]}');
    assert.equal(out.plain_out, '"{\\"d\\":3}"');
    assert.equal(out.loose_out, '"{\\"e\\":5}"', 'a string, as sent (it became an object)');
    // the domain's constraint is checked at submit: a string is no object
    const refused = await invoke({ procedure: 'billing.seen', arguments: { doc: '{"c":1}' } });
    assert.equal(refused.errors?.[0]?.extensions?.code, 'INVALID_ARGUMENTS', JSON.stringify(refused));
  });

  it("an array given as PostgreSQL's array text arrives (a multi-dimensional one too) instead of failing every attempt", async () => {
    for (const [grid, text] of [['{1,2,3}', '{1,2,3}'], ['{{1,2},{3,4}}', '{{1,2},{3,4}}'], [[5, null, 6], '{5,NULL,6}']] as const) {
      const done = await run('billing.seen', { grid });
      assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
      assert.equal(done.result.outputParameters.grid_out, text);
    }
    const refused = await invoke({ procedure: 'billing.seen', arguments: { grid: '{1,x}' } });
    assert.equal(refused.errors?.[0]?.extensions?.code, 'INVALID_ARGUMENTS', 'not an integer array: refused at submit');
  });

  it('a VARIADIC parameter takes its array', async () => {
    const done = await run('billing.total', { parts: [1, 2, 39] });
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    assert.equal(done.result.returnValue, 42);
  });

  it('registering another overload of a name is refused while calls of the registered one wait; they run the routine they were checked against', async () => {
    const register = (signature: string) => t.gql(`mutation($n: String!) { registerProcedure(input: { name: $n }) { procedure { name } } }`, { n: signature });
    assert.equal((await register('billing.ov(integer)')).body.errors, undefined);
    const waiting = await invoke({ procedure: 'billing.ov', arguments: { x: 5 }, runAt: new Date(Date.now() + 1500).toISOString() });
    assert.equal(waiting.errors, undefined, JSON.stringify(waiting.errors));
    const refused = await register('billing.ov(text)');
    assert.equal(refused.body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(refused.body));
    assert.match(refused.body.errors[0].message, /billing\.ov\(integer\).*have not ended/);
    const done = await finished(waiting.data.invoke.execution.token);
    assert.equal(done.result.returnValue, 'integer 5', 'before: text 5');
    // with none waiting, the other overload replaces it
    assert.equal((await register('billing.ov(text)')).body.errors, undefined);
    assert.equal((await run('billing.ov', { x: 'five' })).result.returnValue, 'text five');

    // a routine created anew with another parameter (a migration: the old one is gone) is registered again at once
    await sql.query(`create function billing.grows(n int) returns text language sql as $$ select 'old ' || n $$;
      select asyncproc.register('billing.grows(int)');`);
    const queued = await invoke({ procedure: 'billing.grows', arguments: { n: 1 }, runAt: new Date(Date.now() + 1500).toISOString() });
    await sql.query(`drop function billing.grows(int);
      create function billing.grows(n int, unit text default 'kg') returns text language sql as $$ select 'new ' || n || unit $$;`);
    const again = await register('billing.grows(int, text)');
    assert.equal(again.body.errors, undefined, JSON.stringify(again.body));
    const ran = await finished(queued.data.invoke.execution.token);
    assert.deepEqual([ran.status, ran.result?.returnValue], ['SUCCEEDED', 'new 1kg'], 'the waiting call runs the new routine, its default for the rest');
  });

  it('a routine whose schema or name holds a dot is refused: "billing.x".y and billing."x.y" were both billing.x.y, the later one silently in place of the other', async () => {
    for (const routine of ['"billing.x".y()', 'billing."x.y"()']) {
      const { body } = await t.gql(`mutation($n: String!) { registerProcedure(input: { name: $n }) { procedure { name } } }`, { n: routine });
      assert.equal(body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', `${routine}: ${JSON.stringify(body)}`);
    }
    const { rows } = await sql.query(`select name from asyncproc.procedures where name = 'billing.x.y'`);
    assert.equal(rows.length, 0);
  });

  it("dates and times are read in the submitting session (its TimeZone and DateStyle), not in the worker's", async () => {
    // a SQL caller of its own, in Tokyo, day first
    await sql.query(`set timezone = 'Asia/Tokyo'; set datestyle = 'ISO, DMY'`);
    try {
      const { rows } = await sql.query<{ token: string; arguments: { d: string; at: string } }>(
        `select token::text, arguments from asyncproc.submit('billing.on_day', '{"d": "01/02/2024", "days": ["03/02/2024"], "at": "2024-06-01 12:00"}'::jsonb)`,
      );
      assert.deepEqual(rows[0].arguments, { d: '2024-02-01', days: ['2024-02-03'], at: '2024-06-01T12:00:00+09:00' }, 'recorded as read here');
      const done = await finished(rows[0].token);
      assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
      // before: 2 January, and noon UTC (9 hours off)
      assert.equal(done.result.outputParameters.d_out, '2024-02-01');
      assert.deepEqual(done.result.outputParameters.days_out, ['2024-02-03']);
      assert.equal(Date.parse(done.result.outputParameters.at_out), Date.parse('2024-06-01T03:00:00Z'));
    } finally {
      await sql.query(`reset timezone; reset datestyle`);
    }
  });

  it('char(n) and bit(n) parameters take values of their length, and outputs of those types come back whole, in a transaction or not', async () => {
    const done = await run('billing.codes', { cur: 'USD', tags: ['ab', 'abcde'], flags: '1011' });
    assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
    assert.deepEqual(done.result.outputParameters, { cur_out: 'USDxy', tags_out: '{ab,abcde}', flags_out: '1011' });
    const alone = await run('billing.codes_nt', { cur: 'EUR' });
    assert.equal(alone.status, 'SUCCEEDED', JSON.stringify(alone.error));
    assert.deepEqual(alone.result.outputParameters, { cur_out: 'EURxy', flags_out: '1011' }, 'not cut to char(1) and bit(1)');
  });

  it('a null that a NOT NULL domain refuses is refused at invoke (also an array element), not accepted to fail at run', async () => {
    const before = Number((await sql.query('select count(*) as n from asyncproc.executions')).rows[0].n);
    for (const args of [{ v: null }, { vs: [1, null] }]) {
      const body = await invoke({ procedure: 'billing.take_required', arguments: args });
      assert.equal(body.errors?.[0]?.extensions?.code, 'INVALID_ARGUMENTS', JSON.stringify(args));
    }
    assert.equal(Number((await sql.query('select count(*) as n from asyncproc.executions')).rows[0].n), before);
    assert.equal((await run('billing.take_required', { v: 5, vs: [1, 2] })).status, 'SUCCEEDED');
  });

  it('a regclass is taken by name, and a number (which the run would look for as a name) is refused at invoke', async () => {
    const body = await invoke({ procedure: 'billing.take_rel', arguments: { r: '1259' } });
    assert.equal(body.errors?.[0]?.extensions?.code, 'INVALID_ARGUMENTS', JSON.stringify(body));
    const done = await run('billing.take_rel', { r: 'pg_class' });
    assert.equal(done.result.outputParameters.r_out, 'pg_class');
  });

  it('dates and times inside a range, a multirange or a composite, and in the basic ISO 8601 form, are read in the submitting session and when submitted', async () => {
    await sql.query(`set timezone = 'Asia/Tokyo'; set datestyle = 'ISO, DMY'`);
    try {
      const { rows } = await sql.query<{ token: string; arguments: Record<string, string> }>(
        `select token::text, arguments from asyncproc.submit('billing.spans', $1::jsonb, run_at => now() + interval '1.5 seconds')`,
        [JSON.stringify({ r: '[2024-06-01 12:00,infinity)', s: '(2024-06-01 12:00,x)', days: '{[01/02/2024,03/02/2024)}', t: '20240601T120000' })],
      );
      const done = await finished(rows[0].token);
      assert.equal(done.status, 'SUCCEEDED', JSON.stringify(done.error));
      const out = done.result.outputParameters;
      for (const at of [out.lower_out, out.at_out, out.t_out]) assert.equal(Date.parse(at), Date.parse('2024-06-01T03:00:00Z'), JSON.stringify(out));
      assert.equal(out.days_out, '{[2024-02-01,2024-02-03)}', 'day first, as the caller reads dates');
      // the basic form alone (nothing else in the arguments looks like a date)
      const { rows: [basic] } = await sql.query<{ token: string }>(
        `select token::text from asyncproc.submit('billing.spans', '{"t": "20240601T120000"}'::jsonb)`,
      );
      assert.equal(Date.parse((await finished(basic.token)).result.outputParameters.t_out), Date.parse('2024-06-01T03:00:00Z'), 'read in Tokyo');
      // 'now' inside a range is the moment of the submit, not of the run 1.5 s later
      const { rows: [now] } = await sql.query<{ token: string; submitted: Date }>(
        `select token::text, clock_timestamp() as submitted from asyncproc.submit('billing.spans', '{"r": "[now,infinity)"}'::jsonb, run_at => now() + interval '1.5 seconds')`,
      );
      const later = await finished(now.token);
      assert.ok(Math.abs(Date.parse(later.result.outputParameters.lower_out) - now.submitted.getTime()) < 1000, JSON.stringify(later.result));
      assert.doesNotMatch(JSON.stringify(later.arguments), /now/, 'recorded as resolved');
    } finally {
      await sql.query(`reset timezone; reset datestyle`);
    }
  });
});
