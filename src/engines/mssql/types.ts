/**
 * JSON ⇄ SQL Server values. Arguments travel to usp_AsyncExecInvoke as one JSON
 * object; the database converts each value to its parameter's type (TRY_CONVERT to
 * check, CONVERT to call). Results come back as the JSON the activated procedure
 * built with FOR JSON, plus the declared types of the output parameters.
 */
import { EngineError, toExecutionResult, type ExecutionResult, type ParameterMode } from '../../engine.js';
import { parseExactJson } from '../exactJson.js';

export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

/**
 * A JavaScript value as the JSON that SQL Server's conversions accept:
 * Date → ISO 8601 in UTC without a zone designator (what datetime, datetime2 and
 * datetimeoffset all parse; naive times are UTC), bigint → decimal text (exact for
 * bigint and decimal parameters), Buffer/Uint8Array → base64 (what OPENJSON decodes
 * into binary), objects and arrays → kept as JSON (valid only for character parameters).
 */
export function toSqlJson(value: unknown, path = 'arguments'): JsonValue {
  if (value === null || value === undefined) return null;
  switch (typeof value) {
    case 'string':
    case 'boolean':
      return value;
    case 'number':
      if (!Number.isFinite(value)) throw new EngineError('INVALID_ARGUMENTS', `${path}: ${value} has no SQL Server value`);
      return value;
    case 'bigint':
      return value.toString();
    case 'object': {
      if (value instanceof Date) {
        if (Number.isNaN(value.getTime())) throw new EngineError('INVALID_ARGUMENTS', `${path}: invalid date`);
        return value.toISOString().replace(/Z$/, '');
      }
      if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength).toString('base64');
      if (Array.isArray(value)) return value.map((item, i) => toSqlJson(item, `${path}[${i}]`));
      const out: Record<string, JsonValue> = {};
      for (const [key, item] of Object.entries(value)) {
        if (item !== undefined) out[key] = toSqlJson(item, `${path}.${key}`);
      }
      return out;
    }
    default:
      throw new EngineError('INVALID_ARGUMENTS', `${path}: a ${typeof value} has no SQL Server value`);
  }
}

/** The arguments object as the JSON text usp_AsyncExecInvoke takes. */
export function encodeArguments(args: unknown): string {
  if (args === null || args === undefined) return '{}';
  if (typeof args !== 'object' || Array.isArray(args) || args instanceof Date || args instanceof Uint8Array) {
    throw new EngineError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
  return JSON.stringify(toSqlJson(args));
}

const EXACT_NUMERIC = /^(bigint|decimal|numeric|money|smallmoney)\b/i;
const NUMERIC_TEXT = /^-?\d+(\.\d+)?$/;

/**
 * One output value as JSON. Exact numerics arrive as text (every digit kept); they
 * become numbers when a double holds them exactly, and stay text otherwise.
 */
export function fromSqlOutput(value: unknown, sqlType: string | undefined): unknown {
  if (typeof value !== 'string' || !sqlType || !EXACT_NUMERIC.test(sqlType) || !NUMERIC_TEXT.test(value)) return value;
  const canonical = value.includes('.') ? value.replace(/0+$/, '').replace(/\.$/, '') : value;
  const asNumber = Number(canonical);
  if (/^(bigint)\b/i.test(sqlType)) return Number.isSafeInteger(asNumber) ? asNumber : value;
  return String(asNumber) === canonical.replace(/^(-?)0+(?=\d)/, '$1') ? asNumber : value;
}

interface StoredResult {
  returnValue?: unknown;
  outputParameters?: Record<string, unknown> | null;
  outputTypes?: Record<string, string> | null;
  rows?: unknown[] | null;
}

/** AsyncExecResults.result (FOR JSON text) as an ExecutionResult. */
export function decodeResult(text: string | null | undefined): ExecutionResult | null {
  if (text === null || text === undefined || text === '') return null;
  const stored = parseExactJson(text) as StoredResult;
  let outputParameters: Record<string, unknown> | null = null;
  if (stored.outputParameters && typeof stored.outputParameters === 'object') {
    outputParameters = {};
    for (const [name, value] of Object.entries(stored.outputParameters)) {
      outputParameters[name] = fromSqlOutput(value, stored.outputTypes?.[name]);
    }
  }
  // the T-SQL does not count the rows it leaves out yet: rowCount and truncated stay unknown
  return toExecutionResult({
    returnValue: stored.returnValue ?? null,
    outputParameters,
    rows: Array.isArray(stored.rows) ? stored.rows : null,
  });
}

/** sys.parameters.is_output → mode. SQL Server cannot tell OUT from INOUT: OUTPUT parameters report OUT. */
export function parameterMode(isOutput: boolean): ParameterMode {
  return isOutput ? 'OUT' : 'IN';
}

const CURSOR = /^0x[0-9a-f]{16}$/i;

/** A rowversion (binary(8)) as the cursor text `0x` + 16 hex digits. */
export function cursorFromRowversion(value: Buffer | Uint8Array): string {
  const buffer = Buffer.from(value);
  if (buffer.length !== 8) throw new Error(`a rowversion has 8 bytes, not ${buffer.length}`);
  return `0x${buffer.toString('hex').toUpperCase()}`;
}

/** A rowversion as the number it is (the change feed's writer and position). */
export function rowversionValue(value: Buffer | Uint8Array): bigint {
  return Buffer.from(value).readBigUInt64BE();
}

/** A number back to the rowversion (binary(8)) it stands for. */
export function rowversionOf(value: bigint): Buffer {
  const buffer = Buffer.alloc(8);
  buffer.writeBigUInt64BE(value);
  return buffer;
}

/** A cursor text back to the 8 bytes it stands for. */
export function rowversionFromCursor(cursor: string): Buffer {
  if (!CURSOR.test(cursor)) throw new EngineError('BAD_USER_INPUT', `malformed cursor "${cursor}" (expected 0x and 16 hex digits)`);
  return Buffer.from(cursor.slice(2), 'hex');
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

export function isToken(value: string): boolean {
  return UUID.test(value);
}
