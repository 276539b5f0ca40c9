/**
 * Split a T-SQL script into batches on `GO` lines, as sqlcmd and SSMS do.
 * A separator is a line holding only `GO` (any case), optionally a repeat count
 * (`GO 2`) and a trailing `--` comment. `GO` inside a string, a quoted or bracketed
 * identifier or a block comment (which T-SQL lets nest) separates nothing.
 */

export interface Batch {
  /** The batch text, without the separator line. */
  text: string;
  /** How many times to run it (`GO n`). */
  repeat: number;
  /** 1-based line of the script where the batch starts (for error messages). */
  line: number;
}

const SEPARATOR = /^\s*go(?:\s+(\d+))?\s*(?:--.*)?$/i;

interface ScanState {
  commentDepth: number;
  /** The closing character of the literal or identifier we are inside, if any. */
  closer: "'" | '"' | ']' | null;
}

/** Advance the lexical state over one line (without its line break). */
function scanLine(line: string, state: ScanState): void {
  let i = 0;
  while (i < line.length) {
    const c = line[i];
    const next = line[i + 1];
    if (state.commentDepth > 0) {
      if (c === '/' && next === '*') {
        state.commentDepth++;
        i += 2;
      } else if (c === '*' && next === '/') {
        state.commentDepth--;
        i += 2;
      } else i++;
    } else if (state.closer) {
      if (c === state.closer) {
        // a doubled closer is an escaped one: '' inside strings, ]] inside brackets
        if (next === state.closer) i += 2;
        else {
          state.closer = null;
          i++;
        }
      } else i++;
    } else if (c === '-' && next === '-') {
      return; // the rest of the line is a comment
    } else if (c === '/' && next === '*') {
      state.commentDepth = 1;
      i += 2;
    } else if (c === "'") {
      state.closer = "'";
      i++;
    } else if (c === '"') {
      state.closer = '"';
      i++;
    } else if (c === '[') {
      state.closer = ']';
      i++;
    } else i++;
  }
}

export function splitBatches(script: string): Batch[] {
  const lines = script.replace(/^\uFEFF/, '').split(/\r?\n/);
  const batches: Batch[] = [];
  const state: ScanState = { commentDepth: 0, closer: null };
  let current: string[] = [];
  let start = 1;

  const flush = (repeat: number) => {
    const text = current.join('\n');
    if (text.trim() !== '' && repeat > 0) batches.push({ text, repeat, line: start });
    current = [];
  };

  lines.forEach((line, index) => {
    const atTopLevel = state.commentDepth === 0 && state.closer === null;
    const separator = atTopLevel ? SEPARATOR.exec(line) : null;
    if (separator) {
      flush(separator[1] === undefined ? 1 : Number(separator[1]));
      start = index + 2;
      return;
    }
    if (current.length === 0) start = index + 1;
    current.push(line);
    scanLine(line, state);
  });
  flush(1);
  return batches;
}
