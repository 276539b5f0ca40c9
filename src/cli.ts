#!/usr/bin/env node
import { readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Command } from 'commander';
import { startApp, startWorker, type App } from './app.js';
import { createApiKey, DEFAULT_ROTATION_OVERLAP_SECONDS, rotateApiKey } from './auth/apiKeys.js';
import { ConfigError, loadConfig } from './config.js';
import { embeddedUrl } from './embeddedPostgres.js';
import { apiKeyActive, EngineError, type ApiKey, type Engine } from './engine.js';
import { createEngine } from './engines/index.js';
import { createLogger } from './logger.js';
import { openPsql, runSqlFile } from './sqlConsole.js';
import { databaseFailure } from './startupFailure.js';

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

/** DATABASE_URL, or where the embedded PostgreSQL of `npm start` answers (its password is a local development one). */
function databaseUrl(): string {
  const cfg = loadConfig(process.env);
  return cfg.DATABASE_URL ?? embeddedUrl(cfg.ASYNCPROC_EMBEDDED_PORT);
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
  .option('--demo', 'install and register the demo procedures (on by default for the embedded database; ASYNCPROC_DEMO=false turns that off)')
  .action(async (options) => {
    const cfg = config(options);
    await runUntilSignal(() => startApp(cfg, createLogger(cfg.LOG_LEVEL)));
  });

program
  .command('worker')
  .description('run only the worker pool (scale out) on DATABASE_URL, or on the embedded PostgreSQL of a running `serve`')
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
    throw databaseFailure(error, cfg.DATABASE_URL ?? embeddedUrl(cfg.ASYNCPROC_EMBEDDED_PORT), !cfg.DATABASE_URL);
  } finally {
    await engine.close();
  }
}

program
  .command('db-url')
  .description('print the database URL: DATABASE_URL, or that of the embedded PostgreSQL `npm start` runs (password included)')
  .action(() => {
    process.stdout.write(`${databaseUrl()}\n`);
  });

program
  .command('psql')
  .description('open psql on the database (DATABASE_URL or the embedded one); arguments after -- go to psql')
  .allowUnknownOption()
  .argument('[args...]')
  .action(async (args: string[]) => {
    process.exitCode = await openPsql(databaseUrl(), args);
  });

program
  .command('sql [file]')
  .description('run a SQL file (or standard input) on the database, without psql, and print what each statement returns')
  .action(async (file: string | undefined) => {
    await runSqlFile(databaseUrl(), file);
  });

const printKey = (key: ApiKey) =>
  `${key.id}  ${key.name}  roles=${key.roles.join(',') || '-'}  ${key.prefix}…  created ${key.createdAt.toISOString()}` +
  (key.revokedAt ? `  ${apiKeyActive(key) ? 'ROTATED, stops' : 'REVOKED'} ${key.revokedAt.toISOString()}` : '') +
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
  .command('rotate <id>')
  .description('give a key a new secret without a gap: print the new secret (shown once); the old one works for the overlap, then stops')
  .option('--overlap <seconds>', 'how long the old secret goes on working (0: it stops at once)', String(DEFAULT_ROTATION_OVERLAP_SECONDS))
  .action(async (id: string, options: { overlap: string }) => {
    const overlapSeconds = /^\d{1,10}$/.test(options.overlap) ? Number(options.overlap) : Number.NaN;
    const { key, previous, secret } = await withEngine((engine) => rotateApiKey(engine, { id, overlapSeconds, createdBy: 'cli' }));
    process.stderr.write(`${printKey(previous)}\n${printKey(key)}\nsecret of the new key (shown once; send as "Authorization: ApiKey <secret>"):\n`);
    process.stdout.write(`${secret}\n`);
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
    // both would write and pass: a CI step meant to fail on a stale file never could
    if (options.write && options.check) throw new ConfigError('print-schema: --write or --check, not both');
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
  // a failure at start is one line: the cause and the fix; the stack only when asked for
  const debug = /^(debug|trace)$/.test(process.env.LOG_LEVEL ?? '');
  if (error instanceof ConfigError || error instanceof EngineError) process.stderr.write(`asyncproc: ${error.message}\n`);
  else if (debug) process.stderr.write(`asyncproc: ${error instanceof Error ? error.stack ?? error.message : String(error)}\n`);
  else process.stderr.write(`asyncproc: ${error instanceof Error ? error.message.replace(/\s*\n\s*/g, ' ') : String(error)} (LOG_LEVEL=debug shows where)\n`);
  process.exit(1);
});
