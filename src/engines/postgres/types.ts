import { createRequire } from 'node:module';
import type pg from 'pg';
import { parseExactJson } from '../exactJson.js';

type Parse = (value: string) => unknown;

/** pg-types (the text parsers pg uses), as pg loads it. */
const textParsers = createRequire(createRequire(import.meta.url).resolve('pg'))('pg-types/lib/textParsers') as {
  init(register: (oid: number, parse: Parse) => void): void;
};

const INT8 = 20;
const JSON_OID = 114;
const JSONB = 3802;

const parsers = new Map<number, Parse>();
textParsers.init((oid, parse) => parsers.set(oid, parse));
// bigint ids and cursors stay strings; timestamps arrive as Date
parsers.set(INT8, (value) => value);
// results and arguments keep every number exact (past 2^53 as strings)
parsers.set(JSON_OID, parseExactJson);
parsers.set(JSONB, parseExactJson);

/**
 * The engine's own type parsers (pg's `types` option), given to each of its connections and to
 * each statement it sends on a caller's client: pg-types' text parsers as that package
 * registers them, with JSON and jsonb read exactly and bigint as text. Not pg's process-wide
 * parsers, which an application may change and which the engine used to change on import: an
 * application that imported the package then read its own JSON columns differently, and one
 * with parsers of its own (timestamps or jsonb left as text) broke the engine's rows.
 */
export const ENGINE_TYPES: pg.CustomTypesConfig = {
  getTypeParser: ((oid: number) => parsers.get(oid) ?? String) as pg.CustomTypesConfig['getTypeParser'],
};
