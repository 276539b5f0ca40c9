import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, it } from 'node:test';
import { ConfigError, loadConfig } from '../src/config.js';

/** Run the CLI to completion with extra environment (it must fail fast here). */
function runCli(command: string, env: Record<string, string>) {
  return spawnSync(process.execPath, ['--import', 'tsx', 'src/cli.ts', command], {
    cwd: fileURLToPath(new URL('..', import.meta.url)),
    env: { ...process.env, ...env },
    encoding: 'utf8',
    timeout: 30_000,
  });
}

describe('configuration from the environment', () => {
  it('has defaults for everything', () => {
    const config = loadConfig({});
    assert.equal(config.PORT, 4000);
    assert.equal(config.DATABASE_URL, undefined);
    assert.equal(config.ASYNCPROC_DATA_DIR, undefined);
    assert.equal(config.ASYNCPROC_ACTIVATOR, true);
    assert.equal(config.ASYNCPROC_DEMO, undefined);
  });

  it('parses values', () => {
    const config = loadConfig({ PORT: '8080', ASYNCPROC_DEMO: 'yes', ASYNCPROC_ACTIVATOR: '0', DATABASE_URL: 'postgres://u:p@db/x' });
    assert.equal(config.PORT, 8080);
    assert.equal(config.ASYNCPROC_DEMO, true);
    assert.equal(config.ASYNCPROC_ACTIVATOR, false);
  });

  for (const [name, value] of [
    ['PORT', 'eighty'],
    ['PORT', '70000'],
    ['DATABASE_URL', 'mysql://localhost/x'],
    ['ASYNCPROC_DEMO', 'perhaps'],
    ['ASYNCPROC_MAX_CALLS', '-1'],
    ['LOG_LEVEL', 'loud'],
  ]) {
    it(`refuses ${name}=${value} with a message naming the variable`, () => {
      assert.throws(
        () => loadConfig({ [name]: value }),
        (error: unknown) => error instanceof ConfigError && error.message.includes(`${name}=`) && error.message.includes(value),
      );
    });
  }

  it('ASYNCPROC_EMBEDDED=false requires DATABASE_URL', () => {
    assert.throws(() => loadConfig({ ASYNCPROC_EMBEDDED: 'false' }), /DATABASE_URL=undefined: required/);
    assert.equal(loadConfig({ ASYNCPROC_EMBEDDED: 'false', DATABASE_URL: 'postgres://h/db' }).ASYNCPROC_EMBEDDED, false);
  });

  it('`worker` needs DATABASE_URL, or a running `npm start` whose embedded database it joins', () => {
    const result = runCli('worker', { DATABASE_URL: '', ASYNCPROC_EMBEDDED_PORT: '1' });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /no database: set DATABASE_URL, or start the service \(npm start\)/);
  });

  it('a bad value stops the service with that message', () => {
    const result = runCli('serve', { PORT: 'eighty' });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /PORT="eighty"/);
  });
});
