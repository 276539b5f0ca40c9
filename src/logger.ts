import pino from 'pino';

export type Logger = pino.Logger;

/** The service's logger: JSON lines on stdout; LOG_LEVEL picks the level. */
export function createLogger(level: string = process.env.LOG_LEVEL ?? 'info'): Logger {
  return pino({ level, base: { service: 'asyncproc' } });
}

/** A logger that drops everything (tests, benchmarks). */
export const silentLogger: Logger = pino({ level: 'silent' });
