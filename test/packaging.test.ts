/** Docker-free checks of the Dockerfile and compose file (no Docker engine runs in CI). */
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { describe, it } from 'node:test';
import { authSettings, loadConfig } from '../src/config.js';

const root = fileURLToPath(new URL('..', import.meta.url));
const read = (file: string) => readFileSync(new URL(`../${file}`, import.meta.url), 'utf8');

describe('Dockerfile', () => {
  const text = read('Dockerfile');
  const lines = text.split('\n').filter((l) => l.trim() && !l.trim().startsWith('#'));
  const stages = lines.filter((l) => /^FROM\s/i.test(l));
  const final = text.slice(text.lastIndexOf('\nFROM '));

  it('is multi-stage on a Node version our engines field allows', () => {
    assert.ok(stages.length >= 2);
    const engines = JSON.parse(read('package.json')).engines.node as string;
    const min = Number(/(\d+)/.exec(engines)![1]);
    for (const stage of stages) assert.ok(Number(/node:(\d+)/.exec(stage)![1]) >= min, stage);
  });

  it('installs production dependencies only, runs as non-root, checks readiness and needs DATABASE_URL', () => {
    assert.match(final, /npm ci --omit=dev/);
    assert.match(final, /^USER\s+(?!root\b)\S+/m);
    // /ready, not /health (200 whatever happens): Docker sees a service without its database as unhealthy
    assert.match(final, /^HEALTHCHECK [^\n]*\\\n\s*CMD [^\n]*\/ready'/m);
    assert.match(final, /ASYNCPROC_EMBEDDED=false/);
    assert.throws(() => loadConfig({ ASYNCPROC_EMBEDDED: 'false' }), /DATABASE_URL/);
  });

  it('copies only what exists, and starts what the build produces', () => {
    for (const line of lines.filter((l) => /^COPY\s/i.test(l) && !/--from=/.test(l))) {
      const sources = line.trim().split(/\s+/).slice(1, -1);
      for (const source of sources) assert.ok(existsSync(`${root}/${source}`), `${source} (${line})`);
    }
    const build = JSON.parse(read('tsconfig.build.json'));
    assert.equal(build.compilerOptions.rootDir, 'src');
    assert.equal(build.compilerOptions.outDir, 'dist');
    const cmd = /^CMD\s+(.*)$/m.exec(final)![1];
    const entry = (JSON.parse(cmd) as string[]).find((part) => part.startsWith('dist/'))!;
    assert.ok(existsSync(`${root}/${entry.replace(/^dist\//, 'src/').replace(/\.js$/, '.ts')}`), entry);
  });
});

describe('docker-compose.yml', () => {
  const text = read('docker-compose.yml');
  it('starts SQL Server 2022 with a health check and the service built from this Dockerfile', () => {
    assert.match(text, /image:\s*mcr\.microsoft\.com\/mssql\/server:2022/);
    assert.match(text, /healthcheck:/);
    assert.match(text, /build:\s*\./);
    const service = text.slice(text.indexOf('\n  asyncproc:'));
    assert.match(service, /healthcheck:\s*\n[^]*?test:[^\n]*\/ready'/, 'the service is healthy when ready');
    assert.match(text, /ENABLE_BROKER/);
  });
  it("gives the service a configuration it accepts", () => {
    const service = text.slice(text.indexOf('\n  asyncproc:'));
    const env = Object.fromEntries(
      [...service.matchAll(/^\s{6}([A-Z_]+):\s*"?([^"\n]*)"?$/gm)].map(([, key, value]) => [key, value.replace('${MSSQL_SA_PASSWORD}', 'Passw0rd!')]),
    );
    assert.match(env.DATABASE_URL, /^mssql:\/\//);
    const config = loadConfig({ ...env, ASYNCPROC_EMBEDDED: 'false' });
    assert.equal(config.PORT, 4000);
    assert.equal(authSettings(config).mode, 'required', 'a service on DATABASE_URL needs an authentication configuration');
  });
});
