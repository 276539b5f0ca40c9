import type { Engine } from '../engine.js';
import type { Logger } from '../logger.js';
import { createPostgresEngine } from './postgres/index.js';

export interface EngineSettings {
  url: string;
  logger: Logger;
  poolSize?: number;
  retentionMs?: number;
}

/** Pick the engine from the URL scheme: postgres(ql):// or mssql:// / sqlserver://. */
export async function createEngine(settings: EngineSettings): Promise<Engine> {
  const scheme = settings.url.slice(0, settings.url.indexOf(':')).toLowerCase();
  if (scheme === 'postgres' || scheme === 'postgresql') {
    return createPostgresEngine({
      connectionString: settings.url,
      logger: settings.logger,
      poolSize: settings.poolSize,
      retentionMs: settings.retentionMs,
    }) as Engine;
  }
  if (scheme === 'mssql' || scheme === 'sqlserver') {
    const { createMssqlEngine } = await import('./mssql/index.js');
    return (await createMssqlEngine({ url: settings.url, logger: settings.logger, poolSize: settings.poolSize, retentionMs: settings.retentionMs })) as Engine;
  }
  throw new Error(`DATABASE_URL: unsupported scheme "${scheme}:" (use postgres:// or mssql://)`);
}
