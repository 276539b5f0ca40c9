/**
 * The README's TypeScript example, as a backend service would run it: in a folder of its
 * own outside this repository, importing the built package by its name ('asyncproc', via
 * package.json `exports` and its types), type-checked, run with node: it prints a token
 * and exits.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { cp, mkdir, mkdtemp, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { after, before, describe, it } from 'node:test';
import { startDemoDatabase, type DemoDatabase } from './support/database.js';

const run = promisify(execFile);
const ROOT = fileURLToPath(new URL('..', import.meta.url));
const TSC = path.join(ROOT, 'node_modules/typescript/bin/tsc');

const readme = await readFile(path.join(ROOT, 'README.md'), 'utf8');
const example = [...readme.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1]).find((code) => /from 'asyncproc'/.test(code));

describe('the package, used from outside the repository', () => {
  let app: string;
  let db: DemoDatabase;
  before(async () => {
    app = await mkdtemp(path.join(tmpdir(), 'asyncproc-library-'));
    // the package as `npm install` would lay it out: its `files`, built, its dependencies beside it
    const pkg = JSON.parse(await readFile(path.join(ROOT, 'package.json'), 'utf8'));
    const installed = path.join(app, 'node_modules/asyncproc');
    await mkdir(installed, { recursive: true });
    await cp(path.join(ROOT, 'package.json'), path.join(installed, 'package.json'));
    for (const entry of pkg.files as string[]) if (entry !== 'dist') await cp(path.join(ROOT, entry), path.join(installed, entry), { recursive: true });
    await run(process.execPath, [TSC, '-p', path.join(ROOT, 'tsconfig.build.json'), '--outDir', path.join(installed, 'dist')], { cwd: ROOT });
    // its dependencies, and only those (a type package of the repository's dev set would hide one missing)
    for (const name of Object.keys(pkg.dependencies)) {
      await mkdir(path.dirname(path.join(installed, 'node_modules', name)), { recursive: true });
      await symlink(path.join(ROOT, 'node_modules', name), path.join(installed, 'node_modules', name));
    }
    // the app's own @types/node
    await mkdir(path.join(app, 'node_modules/@types'), { recursive: true });
    await symlink(path.join(ROOT, 'node_modules/@types/node'), path.join(app, 'node_modules/@types/node'));
    await writeFile(path.join(app, 'package.json'), JSON.stringify({ name: 'billing-service', type: 'module', dependencies: { asyncproc: `file:${ROOT}` } }));
    await writeFile(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({ compilerOptions: { target: 'ES2022', module: 'NodeNext', moduleResolution: 'NodeNext', strict: true, types: ['node'], skipLibCheck: false }, files: ['service.ts'] }),
    );

    db = await startDemoDatabase();
    // the README's own set-up block: the table and procedures its examples use
    const setup = [...readme.matchAll(/```sql\n([\s\S]*?)```/g)].map((m) => m[1]).find((block) => /create table if not exists billing\.orders/.test(block));
    assert.ok(setup, "the README's SQL block that creates billing.orders");
    await db.sql.query(setup);
  });
  after(async () => {
    await db?.sql.end();
    await db?.engine.close();
    await db?.cluster.stop();
    if (app) await rm(app, { recursive: true, force: true });
  });

  it('the README has a TypeScript example that imports the package by name', () => {
    assert.ok(example, "a ```ts block importing from 'asyncproc'");
    assert.doesNotMatch(example!, /\.\/src\//);
  });

  it('type-checks against the published types, prints a token and exits', async () => {
    await writeFile(path.join(app, 'service.ts'), example!);
    await run(process.execPath, [TSC, '-p', app], { cwd: app }).catch((error: { stdout: string }) => assert.fail(`tsc:\n${error.stdout}`));
    const started = Date.now();
    const { stdout } = await run(process.execPath, ['service.js'], { cwd: app, env: { ...process.env, DATABASE_URL: db.url }, timeout: 15_000 }).catch(
      (error: { killed?: boolean; stderr: string }) => assert.fail(error.killed ? 'the example did not exit within 15 s' : `the example failed:\n${error.stderr}`),
    );
    assert.match(stdout.trim(), /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
    assert.ok(Date.now() - started < 15_000);
    const { rows } = await db.sql.query('select total from billing.orders where id = 44');
    assert.equal(rows.length, 1, "the example's own write committed with the call");
    assert.ok(await db.engine.getExecution(stdout.trim()), 'the call was submitted');
  });
});
