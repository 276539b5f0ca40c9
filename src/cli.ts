#!/usr/bin/env node
import { readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Command } from 'commander';
import { startApp, startWorker, type App } from './app.js';
import { createApiKey } from './auth/apiKeys.js';
import { ConfigError, loadConfig } from './config.js';
import { embeddedUrl } from './embeddedPostgres.js';
import { EngineError, type ApiKey, type Engine } from './engine.js';
import { createEngine } from './engines/index.js';
import { createLogger } from './logger.js';

const SCHEMA_FILE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../schema/schema.graphql');

async function runUntilSignal(start: () => Promise<App>): Promise<void> {
  const app = await start();
  let stopping = false;
  const stop = async (signal: string) => {
    // Ctrl-C reaches us twice (from the terminal and forwarded by npm): the second must not cut the orderly stop short
    if (stopping) return;
    stopping = true;
    process.stderr.write(`asyncproc: ${signal}, stopping\n`);
    await app.stop();
    process.exit(0);
  };
  process.on('SIGINT', () => void stop('SIGINT'));
  process.on('SIGTERM', () => void stop('SIGTERM'));
}

function config(options: { demo?: boolean }) {
  const env = { ...process.env };
  if (options.demo) env.ASYNCPROC_DEMO = 'true';
  return loadConfig(env);
}

const program = new Command()
  .name('asyncproc')
  .description('Reliable asynchronous execution of stored procedures, over GraphQL')
  .showHelpAfterError();

program
  .command('serve', { isDefault: true })
  .description('run the GraphQL service (and, unless ASYNCPROC_ACTIVATOR=false, the worker pool)')
  .option('--demo', 'install and register the demo procedures (always on for the embedded database)')
  .action(async (options) => {
    const cfg = config(options);
    await runUntilSignal(() => startApp(cfg, createLogger(cfg.LOG_LEVEL)));
  });

program
  .command('worker')
  .description('run only the worker pool (scale out); needs DATABASE_URL')
  .option('--demo', 'install and register the demo procedures')
  .action(async (options) => {
    const cfg = config(options);
    await runUntilSignal(() => startWorker(cfg, createLogger(cfg.LOG_LEVEL)));
  });

/** An engine on DATABASE_URL, or on the embedded PostgreSQL of a running `npm start`; migrated. */
async function withEngine<T>(fn: (engine: Engine) => Promise<T>): Promise<T> {
  const cfg = loadConfig(process.env);
  const engine = await createEngine({ url: cfg.DATABASE_URL ?? embeddedUrl(cfg.ASYNCPROC_EMBEDDED_PORT), logger: createLogger('warn'), poolSize: 2 });
  try {
    await engine.migrate();
    return await fn(engine);
  } catch (error) {
    if (!cfg.DATABASE_URL && /ECONNREFUSED/.test(String((error as Error).message))) {
      throw new ConfigError(`no database: set DATABASE_URL, or start the service (npm start) so its embedded PostgreSQL answers on port ${cfg.ASYNCPROC_EMBEDDED_PORT}`);
    }
    throw error;
  } finally {
    await engine.close();
  }
}

const printKey = (key: ApiKey) =>
  `${key.id}  ${key.name}  roles=${key.roles.join(',') || '-'}  ${key.prefix}…  created ${key.createdAt.toISOString()}` +
  (key.revokedAt ? `  REVOKED ${key.revokedAt.toISOString()}` : '') +
  (key.lastUsedAt ? `  last used ${key.lastUsedAt.toISOString()}` : '');

const apiKeys = program.command('api-key').description('manage API keys in the database (the first admin key is made here)');
apiKeys
  .command('create')
  .description('create a key and print its secret (shown once)')
  .requiredOption('--name <name>', 'what the key is for (unique among keys not revoked)')
  .option('--roles <roles>', 'comma-separated roles, e.g. admin or operator', '')
  .action(async (options: { name: string; roles: string }) => {
    const roles = options.roles.split(',').map((r) => r.trim()).filter(Boolean);
    const { key, secret } = await withEngine((engine) => createApiKey(engine, { name: options.name, roles, createdBy: 'cli' }));
    process.stderr.write(`${printKey(key)}\nsecret (shown once; send as "Authorization: ApiKey <secret>"):\n`);
    process.stdout.write(`${secret}\n`);
  });
apiKeys
  .command('list')
  .description('list keys, revoked ones too')
  .action(async () => {
    for (const key of await withEngine((engine) => engine.listApiKeys())) process.stdout.write(`${printKey(key)}\n`);
  });
apiKeys
  .command('revoke <id>')
  .description('revoke a key: it stops working at once')
  .action(async (id: string) => {
    process.stdout.write(`${printKey(await withEngine((engine) => engine.revokeApiKey(id)))}\n`);
  });

program
  .command('print-schema')
  .description('print the GraphQL SDL; --write updates schema/schema.graphql, --check fails when it differs')
  .option('--write', 'write schema/schema.graphql')
  .option('--check', 'exit 1 when schema/schema.graphql differs from the code')
  .action(async (options: { write?: boolean; check?: boolean }) => {
    const { printedSchema } = await import('./schema/index.js');
    const sdl = printedSchema();
    if (options.write) await writeFile(SCHEMA_FILE, sdl);
    else if (options.check) {
      const onDisk = await readFile(SCHEMA_FILE, 'utf8').catch(() => '');
      if (onDisk !== sdl) {
        process.stderr.write('schema/schema.graphql is out of date: run `npm run schema:print`\n');
        process.exit(1);
      }
    } else process.stdout.write(sdl);
  });

program.parseAsync().catch((error: unknown) => {
  if (error instanceof ConfigError || error instanceof EngineError) process.stderr.write(`asyncproc: ${error.message}\n`);
  else process.stderr.write(`asyncproc: ${error instanceof Error ? error.stack ?? error.message : String(error)}\n`);
  process.exit(1);
});
