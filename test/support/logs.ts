import { Writable } from 'node:stream';
import pino from 'pino';

/** A real pino logger at `level` (debug unless given) whose every line is kept, parsed, in `lines`. */
export function capturingLogger(level = 'debug') {
  const lines: Record<string, any>[] = [];
  const stream = new Writable({
    write(chunk, _encoding, done) {
      for (const line of String(chunk).split('\n').filter(Boolean)) lines.push(JSON.parse(line));
      done();
    },
  });
  return { logger: pino({ level }, stream), lines };
}
