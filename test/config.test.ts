import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, it } from 'node:test';
import { ConfigError, loadConfig } from '../src/config.js';

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

  it('`worker` needs DATABASE_URL', () => {
    const result = spawnSync(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'worker'], {
      cwd: fileURLToPath(new URL('..', import.meta.url)),
      env: { ...process.env, DATABASE_URL: '' },
      encoding: 'utf8',
      timeout: 30_000,
    });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /DATABASE_URL is required by `worker`/);
  });

  it('a bad value stops the service with that message', () => {
    const result = spawnSync(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'serve'], {
      cwd: fileURLToPath(new URL('..', import.meta.url)),
      env: { ...process.env, PORT: 'eighty' },
      encoding: 'utf8',
      timeout: 30_000,
    });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /PORT="eighty"/);
  });
});
