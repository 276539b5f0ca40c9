import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { generateKeyPairSync } from 'node:crypto';
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

  for (const [name, value, why] of [
    ['ASYNCPROC_STOP_GRACE_SECONDS', '2147484', 'a Node timer past 2^31 − 1 ms fires after 1 ms: the stop waited for nothing'],
    ['ASYNCPROC_RETENTION_DAYS', '1e10', 'every purge failed: interval field value out of range'],
    ['ASYNCPROC_JWKS_URL', 'file:///etc/passwd', 'not https or http'],
    ['ASYNCPROC_JWKS_URL', 'ftp://keys.example.com/jwks.json', 'not https or http'],
    ['ASYNCPROC_ALLOWED_HOSTS', 'devbox.internal:4000', 'a Host is compared without its port'],
  ]) {
    it(`refuses ${name}=${value} (${why})`, () => {
      assert.throws(() => loadConfig({ [name]: value }), (error: unknown) => error instanceof ConfigError && error.message.includes(`${name}=`));
    });
  }

  it('a JWT public key the verifier cannot read is refused with the configuration, before any database starts; a real one is taken', () => {
    assert.throws(
      () => loadConfig({ ASYNCPROC_JWT_PUBLIC_KEY: '-----BEGIN PUBLIC KEY-----\\nnot a key\\n-----END PUBLIC KEY-----' }),
      (error: unknown) => error instanceof ConfigError && /ASYNCPROC_JWT_PUBLIC_KEY=.*not a public key/.test(error.message),
    );
    const { publicKey } = generateKeyPairSync('ec', { namedCurve: 'P-256', publicKeyEncoding: { type: 'spki', format: 'pem' }, privateKeyEncoding: { type: 'pkcs8', format: 'pem' } });
    assert.equal(loadConfig({ ASYNCPROC_JWT_PUBLIC_KEY: publicKey.replace(/\n/g, '\\n') }).ASYNCPROC_JWT_PUBLIC_KEY, publicKey.replace(/\n/g, '\\n'), 'with \\n for line breaks, as an environment variable holds it');
  });

  it('a value of blanks is unset, as an empty one is: PORT " " is the default port, not 0 (a random one)', () => {
    const config = loadConfig({ PORT: ' ', ASYNCPROC_STOP_GRACE_SECONDS: '  ', ASYNCPROC_RATE_LIMIT: '\t' });
    assert.equal(config.PORT, 4000);
    assert.equal(config.ASYNCPROC_STOP_GRACE_SECONDS, 8);
    assert.equal(config.ASYNCPROC_RATE_LIMIT, undefined);
  });

  it('a refused secret or database password is not repeated in the message', () => {
    assert.throws(
      () => loadConfig({ ASYNCPROC_JWT_SECRET: 'too-short-but-secret-value' }),
      (error: Error) => error.message.includes('ASYNCPROC_JWT_SECRET=') && !error.message.includes('too-short-but-secret-value'),
    );
    assert.throws(
      () => loadConfig({ DATABASE_URL: 'postgress://app:hunter2@db.example.com/x' }),
      (error: Error) => error.message.includes('DATABASE_URL=') && !error.message.includes('hunter2') && error.message.includes('db.example.com'),
    );
  });

  it('ASYNCPROC_EMBEDDED=false requires DATABASE_URL', () => {
    assert.throws(() => loadConfig({ ASYNCPROC_EMBEDDED: 'false' }), /DATABASE_URL=undefined: required/);
    assert.equal(loadConfig({ ASYNCPROC_EMBEDDED: 'false', DATABASE_URL: 'postgres://h/db' }).ASYNCPROC_EMBEDDED, false);
  });

  it('`worker` needs DATABASE_URL, or a running `npm start` whose embedded database it joins', () => {
    const result = runCli('worker', { DATABASE_URL: '', ASYNCPROC_EMBEDDED_PORT: '1' });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /no database: set DATABASE_URL, or start the service \(npm start\)/);
  });

  it('an ASYNCPROC_ variable it does not know is refused, naming the setting it may be a misspelling of', () => {
    // a mistyped secret was ignored: the embedded service started with no authentication at all
    assert.throws(
      () => loadConfig({ ASYNCPROC_JWT_SECERT: 'x'.repeat(40) }),
      (error: unknown) =>
        error instanceof ConfigError &&
        error.message.includes('ASYNCPROC_JWT_SECERT: not a setting of asyncproc (did you mean ASYNCPROC_JWT_SECRET?)') &&
        !error.message.includes('x'.repeat(40)),
    );
    assert.throws(() => loadConfig({ ASYNCPROC_MAXROWS: '5', PORT: 'eighty' }), (error: Error) => error.message.includes('PORT="eighty"') && /ASYNCPROC_MAXROWS: .*ASYNCPROC_MAX_ROWS/.test(error.message));
    assert.throws(() => loadConfig({ ASYNCPROC_PORT: '8080' }), /ASYNCPROC_PORT: not a setting of asyncproc \(did you mean PORT\?\)/);
    assert.throws(() => loadConfig({ ASYNCPROC_QUUX: '1' }), (error: Error) => error.message.endsWith('ASYNCPROC_QUUX: not a setting of asyncproc'));
    // other variables are the environment's, not ours
    assert.equal(loadConfig({ ASYNCPROC: '1', NODE_ENV: 'production', ASYNCPROCX: '1' }).PORT, 4000);
  });

  it('the service port equal to the embedded PostgreSQL port is refused before anything starts', () => {
    assert.throws(() => loadConfig({ PORT: '5500', ASYNCPROC_EMBEDDED_PORT: '5500' }), /PORT="5500": the embedded PostgreSQL listens on this port/);
    assert.throws(() => loadConfig({ PORT: '54329' }), /PORT="54329"/);
    // with a database of its own, or none embedded, the port is free
    assert.equal(loadConfig({ PORT: '54329', DATABASE_URL: 'postgres://h/db' }).PORT, 54329);
    assert.equal(loadConfig({ PORT: '5500', ASYNCPROC_EMBEDDED_PORT: '5501' }).PORT, 5500);
  });

  it('a bad value stops the service with that message', () => {
    const result = runCli('serve', { PORT: 'eighty' });
    assert.equal(result.status, 1);
    assert.match(result.stderr, /PORT="eighty"/);
  });
});
