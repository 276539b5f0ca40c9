/**
 * Recurring schedules on PostgreSQL: exactly-once fires under racing processes, catch-up
 * after a stop, a procedure gone since, and the next-time function across daylight saving.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import { EngineError, type Closeable } from '../src/engine.js';
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { fireDueSchedules } from '../src/engines/postgres/schedules.js';
import { FIRE_PAGE, nextRunAfter, planFire } from '../src/schedules.js';
import { freePort, sleep, startDemoDatabase, waitFor, type TestCluster } from './support/database.js';
import { healthy, postGraphql, startProcess, stopProcess } from './support/service.js';

const at = (iso: string) => new Date(iso);

describe('next run (croner)', () => {
  it('runs 02:30 Europe/Berlin once on the spring-forward day, at 03:00 CEST, the first valid time after the gap', () => {
    // 2026-03-29: clocks go from 02:00 CET to 03:00 CEST; 02:30 does not exist that day
    assert.deepEqual(nextRunAfter('30 2 * * *', 'Europe/Berlin', at('2026-03-28T12:00:00Z')), at('2026-03-29T01:00:00Z'));
    assert.deepEqual(nextRunAfter('30 2 * * *', 'Europe/Berlin', at('2026-03-29T01:00:00Z')), at('2026-03-30T00:30:00Z'));
  });
  it('runs 02:30 Europe/Berlin once on the fall-back day, though 02:30 happens twice', () => {
    assert.deepEqual(nextRunAfter('30 2 * * *', 'Europe/Berlin', at('2026-10-24T12:00:00Z')), at('2026-10-25T00:30:00Z'));
    assert.deepEqual(nextRunAfter('30 2 * * *', 'Europe/Berlin', at('2026-10-25T00:30:00Z')), at('2026-10-26T01:30:00Z'));
  });
  it('treats a list or a range of hours as fixed times across daylight saving, as Vixie cron does: once on the fall-back night, at 03:00 on the spring-forward one', () => {
    // 2026-10-25 Europe/Berlin: 02:30 happens twice (00:30Z in CEST, 01:30Z in CET)
    assert.deepEqual(nextRunAfter('30 2,14 * * *', 'Europe/Berlin', at('2026-10-24T13:00:00Z')), at('2026-10-25T00:30:00Z'));
    assert.deepEqual(nextRunAfter('30 2,14 * * *', 'Europe/Berlin', at('2026-10-25T00:30:00Z')), at('2026-10-25T13:30:00Z'), 'not again at 01:30Z');
    assert.deepEqual(nextRunAfter('0 2-3 * * *', 'Europe/Berlin', at('2026-10-25T00:00:00Z')), at('2026-10-25T02:00:00Z'), '02:00 once (00:00Z), then 03:00 CET');
    // 2026-03-29: 02:30 does not exist; it runs at 03:00 CEST (01:00Z)
    assert.deepEqual(nextRunAfter('30 2,14 * * *', 'Europe/Berlin', at('2026-03-28T20:00:00Z')), at('2026-03-29T01:00:00Z'));
    // a step is an interval job still: every 30 minutes skips the gap
    assert.deepEqual(nextRunAfter('*/30 * * * *', 'Europe/Berlin', at('2026-03-29T00:45:00Z')), at('2026-03-29T01:00:00Z'));
  });

  it('matches day-of-month AND day-of-week when either starts with *, either of them when both are restricted (Vixie cron)', () => {
    // every other day of the month from the 1st, Monday to Friday: odd-numbered weekdays only
    const runs: string[] = [];
    let after = at('2026-11-01T00:00:00Z');
    for (let i = 0; i < 6; i++) {
      after = nextRunAfter('0 9 */2 * 1-5', 'UTC', after)!;
      runs.push(after.toISOString().slice(0, 10));
    }
    // November 2026: the 1st is a Sunday
    assert.deepEqual(runs, ['2026-11-03', '2026-11-05', '2026-11-09', '2026-11-11', '2026-11-13', '2026-11-17']);
    // both restricted: the 1st or the 15th, or any Monday
    assert.deepEqual(nextRunAfter('0 9 1,15 * 1', 'UTC', at('2026-11-01T10:00:00Z')), at('2026-11-02T09:00:00Z'), 'Monday the 2nd');
    assert.deepEqual(nextRunAfter('0 9 1,15 * 1', 'UTC', at('2026-11-09T10:00:00Z')), at('2026-11-15T09:00:00Z'), 'Sunday the 15th');
  });

  it('reads six fields as seconds first', () => {
    assert.deepEqual(nextRunAfter('*/10 * * * * *', 'UTC', at('2026-01-01T00:00:01Z')), at('2026-01-01T00:00:10Z'));
  });
  it('plans one fire for many missed instants, and calls a late fire missed', () => {
    const schedule = { name: 's', cron: '* * * * *', timezone: 'UTC', nextRunAt: at('2026-01-01T00:01:00Z') };
    assert.deepEqual(planFire(schedule, at('2026-01-01T00:01:00.500Z')), {
      name: 's',
      due: at('2026-01-01T00:01:00Z'),
      next: at('2026-01-01T00:02:00Z'),
      missed: false,
    });
    const late = planFire(schedule, at('2026-01-01T03:07:30Z'));
    assert.equal(late.missed, true);
    assert.deepEqual(late.next, at('2026-01-01T03:08:00Z'), 'the next instant after now, not one per missed minute');
  });

  it('a fire an instant or two late, within the grace, is on time and moves to the following instant: each instant fires in turn', () => {
    const schedule = { name: 's', cron: '* * * * * *', timezone: 'UTC', nextRunAt: at('2026-01-01T00:00:10Z') };
    const fire = planFire(schedule, at('2026-01-01T00:00:12.400Z'));
    assert.equal(fire.missed, false, 'a tick 2.4 s late loses nothing');
    assert.deepEqual(fire.next, at('2026-01-01T00:00:11Z'), 'the instant after this one, due already: fired next');
  });
});

describe('schedules on PostgreSQL', () => {
  let cluster: TestCluster;
  let url: string;
  let engine: PostgresEngine;
  let sql: pg.Client;

  before(async () => {
    ({ cluster, url, engine, sql } = await startDemoDatabase());
  });
  after(async () => {
    await sql?.end();
    await engine?.close();
    await cluster?.stop();
  });

  /** Executions of a schedule per scheduled instant (run_at), with when the instant was (first) fired. */
  const firesPerInstant = async (name: string) =>
    (
      await sql.query<{ run_at: Date; n: number; fired_at: Date }>(
        `select run_at, count(*)::int as n, min(submitted_at) as fired_at
           from asyncproc.executions where schedule_name = $1 group by run_at order by run_at`,
        [name],
      )
    ).rows;

  it('150 schedules due at one instant all fire in one tick, and a tick that comes an instant late fires the instant it missed too: none lost', async () => {
    const names = Array.from({ length: 150 }, (_, i) => `many-${i}`);
    for (const name of names) await engine.createSchedule({ name, procedure: 'demo.noop', arguments: {}, cron: '*/2 * * * * *', catchUp: 'SKIP' });
    try {
      // all due at one even second T, a few seconds back (within the grace)
      const t0 = new Date(Math.floor(Date.now() / 2000) * 2000 - 4000);
      await sql.query(`update asyncproc.schedules set next_run_at = $1 where name = any($2)`, [t0, names]);
      // one tick, 1.5 s after T: every schedule's T (more than one page of them)
      const first = await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 1500));
      assert.equal(first.length, 150);
      // the next tick comes 2.6 s after T + 2: T + 2 and T + 4 are both due, and both fire
      const second = await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 4600));
      assert.equal(second.length, 300);
      const { rows } = await sql.query<{ name: string; instants: string[] }>(
        `select schedule_name as name, array_agg(run_at order by run_at)::text[] as instants
           from asyncproc.executions where schedule_name = any($1) group by schedule_name`,
        [names],
      );
      assert.equal(rows.length, 150);
      const expected = [0, 2000, 4000].map((ms) => new Date(t0.getTime() + ms).getTime());
      for (const row of rows) {
        assert.deepEqual(row.instants.map((text) => new Date(text).getTime()), expected, `${row.name}: each instant once`);
      }
    } finally {
      for (const name of names) await engine.deleteSchedule(name);
    }
  });

  it('overlap SKIP: a schedule deleted and made again under its name waits for the call the old one started', async () => {
    const name = 'recreated';
    const make = () => engine.createSchedule({ name, procedure: 'demo.sleep', arguments: { seconds: 5 }, cron: '* * * * * *', overlap: 'SKIP' });
    const dueAt = async (at: Date) => sql.query('update asyncproc.schedules set next_run_at = $1 where name = $2', [at, name]);
    const t0 = new Date(Math.floor(Date.now() / 1000) * 1000 - 3000);
    await make();
    await dueAt(t0);
    const [first] = await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 500));
    assert.ok(first, 'the first fire starts a call (no worker here: it stays unfinished)');
    await engine.deleteSchedule(name);
    await make();
    await dueAt(new Date(t0.getTime() + 1000));
    assert.deepEqual(await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 1500)), [], 'passed over: the old call has not ended');
    await engine.cancelExecution(first.token);
    assert.equal((await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 2500))).length, 1, 'it fires again once that call ended');
    await engine.deleteSchedule(name);
  });

  it('a tick whose first page of due schedules is all passed over (overlap SKIP) goes on: a schedule due after them fires in the same tick', async () => {
    const t0 = new Date(Math.floor(Date.now() / 1000) * 1000 - 10_000);
    const skipping = Array.from({ length: FIRE_PAGE }, (_, i) => `skip-page-${i}`);
    const started: string[] = [];
    try {
      // each has a call that has not ended (no worker here): its next fire is passed over
      for (const name of skipping) await engine.createSchedule({ name, procedure: 'demo.sleep', arguments: { seconds: 5 }, cron: '0 0 1 1 *', overlap: 'SKIP' });
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = any($2)', [t0, skipping]);
      started.push(...(await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 100))).map((e) => e.token));
      assert.equal(started.length, FIRE_PAGE, 'each started a call');
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = any($2)', [new Date(t0.getTime() + 1000), skipping]);
      await engine.createSchedule({ name: 'after-the-page', procedure: 'demo.record', arguments: { tag: 'after the page' }, cron: '0 0 1 1 *' });
      await sql.query("update asyncproc.schedules set next_run_at = $1 where name = 'after-the-page'", [new Date(t0.getTime() + 2000)]);
      const fired = await fireDueSchedules(engine.pool, () => new Date(t0.getTime() + 3000));
      assert.deepEqual(fired.map((e) => e.schedule), ['after-the-page'], 'the page passed over, then the schedule after it fired');
      started.push(...fired.map((e) => e.token));
    } finally {
      for (const token of started) await engine.cancelExecution(token);
      for (const name of [...skipping, 'after-the-page']) await engine.deleteSchedule(name).catch(() => undefined);
    }
  });

  it("plans fires by the database's clock: a process whose own clock runs 2 minutes ahead fires nothing early", async () => {
    const name = 'skewed-clock';
    await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '0 0 1 1 *', catchUp: 'SKIP' });
    try {
      const dbNow = async () => (await sql.query<{ now: Date }>('select clock_timestamp() as now')).rows[0].now;
      // due in a minute by the database's clock
      const due = new Date(Math.floor(((await dbNow()).getTime() + 60_000) / 1000) * 1000);
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = $2', [due, name]);
      // this process's clock, 2 minutes ahead: Date.now() and new Date() (a date given a value stays as given)
      const RealDate = Date;
      class AheadDate extends RealDate {
        constructor(...args: unknown[]) {
          if (args.length) super(...(args as [string]));
          else super(RealDate.now() + 120_000);
        }
        static override now() {
          return RealDate.now() + 120_000;
        }
      }
      globalThis.Date = AheadDate as DateConstructor;
      let fired;
      try {
        fired = await fireDueSchedules(engine.pool);
      } finally {
        globalThis.Date = RealDate;
      }
      assert.deepEqual(fired.filter((e) => e.schedule === name), [], 'not due yet');
      assert.deepEqual((await engine.getSchedule(name))!.nextRunAt, due, 'and left as it was');
    } finally {
      await engine.deleteSchedule(name);
    }
  });

  it('fires each instant exactly once while several processes race to fire it', async () => {
    const others = Array.from({ length: 2 }, () => createPostgresEngine({ connectionString: url, tickMs: 50 }));
    const name = 'race';
    await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '* * * * * *' });
    const activators: Closeable[] = [];
    try {
      // two processes' activators ticking every 50 ms, two of each
      for (const other of others) for (let i = 0; i < 2; i++) activators.push(await other.startActivator({ workerId: `race-${i}` }));
      // and many direct fires at one instant, all reading the same due row
      const deadline = Date.now() + 4000;
      while (Date.now() < deadline) {
        const now = new Date();
        await Promise.all(others.flatMap((other) => Array.from({ length: 4 }, () => fireDueSchedules(other.pool, () => now))));
        await sleep(100);
      }
    } finally {
      for (const activator of activators) await activator.close();
      for (const other of others) await other.close();
    }
    const fires = await firesPerInstant(name);
    assert.ok(fires.length >= 3, `fired ${fires.length} instants in 4 s`);
    assert.deepEqual(
      fires.filter((f) => f.n !== 1),
      [],
      'every instant fired once',
    );
    await engine.deleteSchedule(name);
  });

  it('two worker processes fire each instant once; one killed (SIGKILL), the other goes on firing each instant once', async () => {
    const name = 'two-processes';
    const workers = [startProcess('worker', url).child, startProcess('worker', url).child];
    try {
      await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '* * * * * *' });
      await waitFor(async () => (await firesPerInstant(name)).length >= 3, 60_000, 'fires from the worker processes');
      const killedAt = new Date();
      await stopProcess(workers[0], 'SIGKILL');
      await waitFor(async () => (await firesPerInstant(name)).filter((f) => f.run_at > killedAt).length >= 3, 30_000, 'fires after the kill');
      await engine.pauseSchedule(name);
    } finally {
      for (const child of workers) await stopProcess(child, 'SIGTERM');
    }
    const fires = await firesPerInstant(name);
    assert.deepEqual(
      fires.filter((f) => f.n !== 1),
      [],
      'every instant fired once',
    );
    await engine.deleteSchedule(name);
  });

  it('two service processes (serve): one fire per instant of an every-second schedule; one SIGKILLed mid-way, the other goes on, each instant once', async (t) => {
    const name = 'two-services';
    const services = await Promise.all([0, 1].map(async () => startProcess('serve', url, await freePort())));
    try {
      await Promise.all(services.map((s) => waitFor(() => healthy(s.port), 60_000, `/health of the service on ${s.port}:\n${s.output()}`)));
      // created through the first service's GraphQL API, as a person would
      const created = await postGraphql(services[0].port, `mutation($i: CreateScheduleInput!) { createSchedule(input: $i) { schedule { name nextRunAt } } }`, {
        i: { name, procedure: 'demo.record', arguments: { tag: name }, cron: '* * * * * *' },
      });
      assert.equal(created.errors, undefined, JSON.stringify(created.errors));
      await waitFor(async () => (await firesPerInstant(name)).length >= 4, 60_000, 'fires from the two services');
      const killedAt = new Date();
      await stopProcess(services[0].child, 'SIGKILL');
      assert.equal(services[0].child.signalCode, 'SIGKILL');
      await waitFor(async () => (await firesPerInstant(name)).filter((f) => f.run_at > killedAt).length >= 4, 60_000, 'fires after the kill');
      assert.ok(await healthy(services[1].port), 'the other service still answers');
      await engine.pauseSchedule(name);
    } finally {
      for (const s of services) await stopProcess(s.child, 'SIGTERM');
    }
    const fires = await firesPerInstant(name);
    assert.deepEqual(fires.filter((f) => f.n !== 1), [], 'every instant fired once');
    // one fire per tick: consecutive instants, except those a late fire collapsed (an instant
    // whose following instant had passed when it fired counts as missed, and the next fire is
    // the first instant after that moment: src/schedules.ts planFire)
    let collapsed = 0;
    for (let i = 1; i < fires.length; i++) {
      const [previous, instant] = [fires[i - 1], fires[i]];
      if (instant.run_at.getTime() - previous.run_at.getTime() === 1000) continue;
      collapsed += (instant.run_at.getTime() - previous.run_at.getTime()) / 1000 - 1;
      assert.ok(
        instant.run_at.getTime() - 1000 <= previous.fired_at.getTime(),
        `instants between ${previous.run_at.toISOString()} (fired at ${previous.fired_at.toISOString()}) and ${instant.run_at.toISOString()} never fired`,
      );
    }
    t.diagnostic(`${fires.length} instants fired once each, ${collapsed} collapsed by a late fire`);
    await engine.deleteSchedule(name);
  });

  for (const catchUp of ['ONCE', 'SKIP'] as const) {
    it(`instants missed while stopped (past the misfire grace) fire ${catchUp === 'ONCE' ? 'once' : 'not at all'} at restart (catchUp ${catchUp})`, async () => {
      const name = `stopped-${catchUp}`;
      let activator = await engine.startActivator({ workerId: 'stopped' });
      await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '* * * * * *', catchUp });
      await waitFor(async () => (await firesPerInstant(name)).length >= 1, 10_000, 'a first fire');
      await activator.close();
      const before = new Set((await firesPerInstant(name)).map((f) => f.run_at.getTime()));
      // stopped for longer than MISFIRE_GRACE_MS: its due instant as it would be 90 s after the stop
      const stoppedAt = new Date(Math.floor(Date.now() / 1000) * 1000 - 90_000);
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = $2', [stoppedAt, name]);
      const restartedAt = new Date();
      activator = await engine.startActivator({ workerId: 'stopped' });
      try {
        await waitFor(async () => (await engine.getSchedule(name))!.nextRunAt! > restartedAt, 10_000, 'the schedule to move past the restart');
        await sleep(1500);
      } finally {
        await activator.close();
      }
      const missed = (await firesPerInstant(name)).filter((f) => !before.has(f.run_at.getTime()) && f.run_at < restartedAt);
      assert.deepEqual(
        missed.map((f) => ({ at: f.run_at.toISOString(), n: f.n })),
        catchUp === 'ONCE' ? [{ at: stoppedAt.toISOString(), n: 1 }] : [],
      );
      const later = (await firesPerInstant(name)).filter((f) => f.run_at >= restartedAt);
      assert.ok(later.length >= 1, 'fires on time again after the restart');
      await engine.deleteSchedule(name);
    });
  }

  it('instants passed during a short stop (within the misfire grace) each fire once at restart: a restart loses nothing', async () => {
    const name = 'short-stop';
    let activator = await engine.startActivator({ workerId: 'short-stop' });
    await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '* * * * * *', catchUp: 'SKIP' });
    try {
      await waitFor(async () => (await firesPerInstant(name)).length >= 1, 10_000, 'a first fire');
      await activator.close();
      const stoppedAt = (await engine.getSchedule(name))!.nextRunAt!;
      await sleep(3500); // three instants or more pass with nothing running
      const restartedAt = new Date();
      activator = await engine.startActivator({ workerId: 'short-stop' });
      await waitFor(async () => (await engine.getSchedule(name))!.nextRunAt! > restartedAt, 10_000, 'the schedule to catch up');
      const fires = (await firesPerInstant(name)).filter((f) => f.run_at >= stoppedAt && f.run_at < restartedAt);
      const expected: number[] = [];
      for (let at = stoppedAt.getTime(); at < restartedAt.getTime(); at += 1000) expected.push(at);
      assert.deepEqual(fires.map((f) => [f.run_at.getTime(), f.n]), expected.map((at) => [at, 1]), 'every instant of the stop, once each');
    } finally {
      await activator.close();
      await engine.deleteSchedule(name);
    }
  });

  it('a fire of a procedure unregistered since fails visibly, as a FAILED execution of the schedule', async () => {
    await sql.query(`create procedure public.gone(x integer) language plpgsql as $$ begin end $$`);
    await engine.configureQueue('gone-queue', 1);
    await engine.registerProcedure('public.gone', { queue: 'gone-queue' });
    const name = 'gone';
    const schedule = await engine.createSchedule({ name, procedure: 'public.gone', arguments: { x: 1 }, cron: '0 0 1 1 *' });
    await engine.unregisterProcedure('public.gone');
    const fired = await fireDueSchedules(engine.pool, () => new Date(schedule.nextRunAt!.getTime() + 1000));
    assert.equal(fired.length, 1);
    const page = await engine.listExecutions({ schedule: name }, { first: 10 });
    assert.deepEqual(
      page.items.map((e) => [e.token, e.status, e.error?.number, e.queue]),
      // in the procedure's queue, where its calls are (it was put in 'default')
      [[fired[0].token, 'FAILED', 'AP001', 'gone-queue']],
    );
    assert.match(page.items[0].error!.message, /not registered/);
    assert.ok((await engine.getSchedule(name))!.nextRunAt! > schedule.nextRunAt!, 'and the schedule moved on');
    await engine.deleteSchedule(name);
  });

  it("a fire whose call cannot be submitted (its arguments' domain check raises) fails alone, visibly: the other schedules due with it fire", async () => {
    // arguments checked by a function that raises once their customer is gone: the error is not
    // one of the service's own (AP001–AP005), and it rolled back the page of every fire with it
    await sql.query(`
      create table public.customers (id integer primary key);
      insert into public.customers values (1);
      create function public.known_customer(id integer) returns boolean language plpgsql as $$
      begin
        if not exists (select from public.customers c where c.id = known_customer.id) then
          raise exception 'unknown customer %', id;
        end if;
        return true;
      end $$;
      create domain public.customer_id as integer check (public.known_customer(value));
      create procedure public.bill(customer public.customer_id) language plpgsql as $$ begin end $$;`);
    await engine.registerProcedure('public.bill');
    const poison = await engine.createSchedule({ name: 'bill-1', procedure: 'public.bill', arguments: { customer: 1 }, cron: '0 0 1 1 *' });
    const healthy = await engine.createSchedule({ name: 'healthy', procedure: 'demo.noop', arguments: {}, cron: '0 0 1 1 *' });
    await sql.query('delete from public.customers');
    const fired = await fireDueSchedules(engine.pool, () => new Date(Math.max(poison.nextRunAt!.getTime(), healthy.nextRunAt!.getTime()) + 1000));
    assert.equal(fired.length, 2, 'both fired');
    const [failed] = (await engine.listExecutions({ schedule: 'bill-1' }, { first: 10 })).items;
    assert.deepEqual([failed.status, failed.error?.number], ['FAILED', 'P0001']);
    assert.match(failed.error!.message, /^schedule "bill-1": unknown customer 1/);
    const [ran] = (await engine.listExecutions({ schedule: 'healthy' }, { first: 10 })).items;
    assert.ok(ran && ran.status !== 'FAILED', JSON.stringify(ran));
    for (const [name, before] of [['bill-1', poison], ['healthy', healthy]] as const) {
      assert.ok((await engine.getSchedule(name))!.nextRunAt! > before.nextRunAt!, `${name} moved on`);
      await engine.deleteSchedule(name);
    }
  });

  it("relative dates in a schedule's arguments ('today') are read in the schedule's time zone, not the database's", async () => {
    await sql.query(`create procedure public.on_day(d date, at timestamptz) language plpgsql as $$ begin end $$`);
    await engine.registerProcedure('public.on_day');
    const day = (zone: string) => new Intl.DateTimeFormat('en-CA', { timeZone: zone }).format(new Date()); // YYYY-MM-DD
    // a zone whose date differs from UTC's right now (+14 from 10:00 UTC, −11 before 11:00 UTC)
    const zone = ['Pacific/Kiritimati', 'Pacific/Pago_Pago'].find((z) => day(z) !== day('UTC'))!;
    const expected = [day(zone)];
    const schedule = await engine.createSchedule({
      name: 'on-day', procedure: 'public.on_day', arguments: { d: 'today', at: 'today 08:00' }, cron: '0 0 1 1 *', timezone: zone,
    });
    const fired = await fireDueSchedules(engine.pool, () => new Date(schedule.nextRunAt!.getTime() + 1000));
    expected.push(day(zone)); // the date may have turned meanwhile
    const execution = (await engine.getExecution(fired[0].token))!;
    const d = execution.arguments.d as string;
    assert.ok(expected.includes(d), `today in ${zone} is ${expected.join(' or ')}, the call got ${d}`);
    const at = new Date(execution.arguments.at as string);
    const local = new Intl.DateTimeFormat('en-CA', { timeZone: zone, year: 'numeric', month: '2-digit', day: '2-digit', hour: '2-digit', minute: '2-digit', hourCycle: 'h23' }).format(at);
    assert.equal(local, `${d}, 08:00`, "'today 08:00' is 08:00 of that day in the schedule's zone");
    await engine.deleteSchedule('on-day');
  });

  it("a zone the database's and the service's time-zone data disagree on is refused (BAD_USER_INPUT, nothing stored); one they agree on is taken", async () => {
    // the service plans the instants with Node's data, the database reads 'today' with its own:
    // every zone the two give different offsets right now (the embedded PostgreSQL and Node 20
    // disagree on America/Vancouver)
    const offsetHere = (zone: string) => {
      const name = new Intl.DateTimeFormat('en-US', { timeZone: zone, timeZoneName: 'longOffset' }).formatToParts(new Date()).find((p) => p.type === 'timeZoneName')!.value;
      const m = /^GMT(?:([+-])(\d{2}):(\d{2}))?$/.exec(name)!;
      return m[1] ? (m[1] === '-' ? -1 : 1) * (Number(m[2]) * 3600 + Number(m[3]) * 60) : 0;
    };
    const { rows } = await sql.query<{ name: string; offset: number }>(
      `select name, extract(epoch from utc_offset)::integer as offset from pg_timezone_names where name ~ '^[A-Z][a-z]+/' order by name`,
    );
    const disagreed = rows.filter((r) => {
      try {
        return offsetHere(r.name) !== r.offset;
      } catch {
        return false; // a name Node does not know: refused as unknown, as before
      }
    });
    for (const { name } of disagreed) {
      await assert.rejects(
        engine.createSchedule({ name: 'zone-check', procedure: 'demo.add', arguments: { a: 1, b: 2 }, cron: '0 8 * * *', timezone: name }),
        (e: EngineError) => e.code === 'BAD_USER_INPUT' && e.message.includes(`disagree on the time zone "${name}"`),
        name,
      );
    }
    assert.equal((await engine.getSchedule('zone-check')), null, 'nothing stored');
    const agreed = await engine.createSchedule({ name: 'zone-check', procedure: 'demo.add', arguments: { a: 1, b: 2 }, cron: '0 8 * * *', timezone: 'Europe/Berlin' });
    if (disagreed.length) {
      await assert.rejects(engine.updateSchedule('zone-check', { timezone: disagreed[0].name }), (e: EngineError) => e.code === 'BAD_USER_INPUT');
      assert.equal((await engine.getSchedule('zone-check'))!.timezone, 'Europe/Berlin', 'the update changed nothing');
    }
    await engine.deleteSchedule(agreed.name);
    assert.ok(disagreed.some((r) => r.name === 'America/Vancouver') || !disagreed.length, `disagreed on: ${disagreed.map((r) => r.name).join(', ')}`);
  });

  it('an update to a cron that has the due instant too keeps it (it fires); to one that has not, moves past now', async () => {
    const name = 'recron-when-due';
    await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: name }, cron: '*/2 * * * * *' });
    try {
      // due at an even second just passed, not fired (no worker here)
      let due = new Date(Math.floor(Date.now() / 2000) * 2000 - 2000);
      if (due.getUTCSeconds() === 30) due = new Date(due.getTime() - 2000);
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = $2', [due, name]);
      const kept = await engine.updateSchedule(name, { cron: '* * * * * *' });
      assert.deepEqual(kept.nextRunAt, due, 'every second has that instant too');
      const [fired] = await fireDueSchedules(engine.pool);
      assert.deepEqual(fired?.runAt, due);
      await sql.query('update asyncproc.schedules set next_run_at = $1 where name = $2', [due, name]);
      const moved = await engine.updateSchedule(name, { cron: '30 * * * * *' });
      assert.ok(moved.nextRunAt! > new Date(), 'a cron without that instant starts after now');
      assert.equal(moved.nextRunAt!.getUTCSeconds(), 30);
    } finally {
      await engine.deleteSchedule(name);
    }
  });

  it('an update that keeps the cron and zone keeps the due instant: it still fires', async () => {
    const name = 'updated-when-due';
    const created = await engine.createSchedule({ name, procedure: 'demo.record', arguments: { tag: 'before' }, cron: '* * * * * *' });
    await sleep(1500); // due now, and nothing running here fires it
    const updated = await engine.updateSchedule(name, { arguments: { tag: 'after' } });
    assert.deepEqual(updated.nextRunAt, created.nextRunAt);
    const [fired] = await fireDueSchedules(engine.pool);
    assert.deepEqual([fired?.runAt, fired?.arguments], [created.nextRunAt, { tag: 'after' }]);
    await engine.deleteSchedule(name);
  });

  it('refuses a procedure the creator may not invoke (FORBIDDEN), as invoke does', async () => {
    await sql.query(`create procedure public.guarded() language plpgsql as $$ begin end $$`);
    await engine.registerProcedure('public.guarded', { roles: ['payroll'] });
    await assert.rejects(
      engine.createSchedule({ name: 'guarded', procedure: 'public.guarded', arguments: {}, cron: '* * * * *', callerRoles: ['sales'] }),
      (e: unknown) => e instanceof EngineError && e.code === 'FORBIDDEN',
    );
    assert.equal(await engine.getSchedule('guarded'), null);
  });
});
