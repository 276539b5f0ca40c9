#!/usr/bin/env node
import { readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Command } from 'commander';
import { startApp, startWorker, type App } from './app.js';
import { ConfigError, loadConfig } from './config.js';
import { createLogger } from './logger.js';

const SCHEMA_FILE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../schema/schema.graphql');

async function runUntilSignal(start: () => Promise<App>): Promise<void> {
  const app = await start();
  const stop = async (signal: string) => {
    process.stderr.write(`asyncproc: ${signal}, stopping\n`);
    await app.stop();
    process.exit(0);
  };
  process.once('SIGINT', () => void stop('SIGINT'));
  process.once('SIGTERM', () => void stop('SIGTERM'));
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
  if (error instanceof ConfigError) process.stderr.write(`asyncproc: ${error.message}\n`);
  else process.stderr.write(`asyncproc: ${error instanceof Error ? error.stack ?? error.message : String(error)}\n`);
  process.exit(1);
});
