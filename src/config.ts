import type { AuthSettings } from './auth/authenticate.js';
import { publicKeyFromPem } from './auth/publicKey.js';
import { z } from 'zod';
import { suggestionList } from 'graphql/jsutils/suggestionList.js';
import { DEFAULT_OPERATION_LIMITS } from './edge/operationLimits.js';

const flag = z
  .enum(['1', '0', 'true', 'false', 'yes', 'no', 'on', 'off'], { message: 'expected true or false (1/0, yes/no, on/off)' })
  .transform((v) => ['1', 'true', 'yes', 'on'].includes(v));

/** Whether the JWT verifier (src/auth/jwt.ts) can read `pem` as a public key. */
function readablePublicKey(pem: string): boolean {
  try {
    publicKeyFromPem(pem);
    return true;
  } catch {
    return false;
  }
}

/** The longest delay a Node timer holds (2^31 − 1 ms), in whole seconds. */
const MAX_TIMER_SECONDS = Math.floor((2 ** 31 - 1) / 1000);

const positiveInt = z.coerce.number({ message: 'expected a number' }).int('expected a whole number').positive('expected a positive number');

const schema = z.object({
  PORT: z.coerce.number({ message: 'expected a port number' }).int().min(0).max(65535).default(4000),
  HOST: z.string().min(1).default('0.0.0.0'),
  /**
   * none: anonymous access (development; refused with DATABASE_URL unless set explicitly).
   * required: a JWT or an API key on every operation. Unset: required when a JWT key is
   * configured, none on the embedded database, else the service refuses to start.
   */
  ASYNCPROC_AUTH: z.enum(['none', 'required'], { message: 'expected none or required' }).optional(),
  /** HS256 shared secret (at least 32 characters). */
  ASYNCPROC_JWT_SECRET: z.string().min(32, 'at least 32 characters (256 bits) for HS256').optional(),
  /** PEM public key or certificate (RS/PS/ES/EdDSA); `\n` may stand for line breaks. */
  ASYNCPROC_JWT_PUBLIC_KEY: z
    .string()
    .includes('-----BEGIN', { message: 'expected a PEM public key or certificate' })
    // read here as the JWT verifier reads it: a key it cannot read stopped the service only after the database had started and migrated
    .refine(readablePublicKey, 'not a public key or certificate this runtime can read (PEM)')
    .optional(),
  ASYNCPROC_JWKS_URL: z.string().url('expected an https:// (or http://) URL').refine((url) => /^https?:\/\//i.test(url), 'expected an https:// (or http://) URL').optional(),
  ASYNCPROC_JWT_ISSUER: z.string().min(1).optional(),
  ASYNCPROC_JWT_AUDIENCE: z.string().min(1).optional(),
  ASYNCPROC_JWT_ROLES_CLAIM: z.string().regex(/^[^.\s]+(\.[^.\s]+)*$/, 'expected a claim name or dotted path').default('roles'),
  /** Refuse JWTs without `exp` (tokens that never expire). */
  ASYNCPROC_JWT_REQUIRE_EXP: flag.default(true),
  /** Mutations per second one caller may send, sustained (0: no limit). Default: 20 with auth required, no limit without. */
  ASYNCPROC_RATE_LIMIT: z.coerce.number({ message: 'expected a number' }).min(0, 'expected 0 or more').optional(),
  /** Mutations one caller may send at once above the sustained rate. @default 3 × the rate, at least 10 */
  ASYNCPROC_RATE_BURST: positiveInt.optional(),
  /** Open graphql-ws connections one caller may hold. */
  ASYNCPROC_MAX_CONNECTIONS_PER_CALLER: positiveInt.default(20),
  DATABASE_URL: z
    .string()
    .regex(/^(postgres|postgresql|mssql|sqlserver):\/\//, 'expected postgres://…, postgresql://…, mssql://… or sqlserver://…')
    .optional(),
  /** Embedded PostgreSQL data folder; `.data` when unset. */
  ASYNCPROC_DATA_DIR: z.string().min(1).optional(),
  /** false: DATABASE_URL is required (the production image sets this). */
  ASYNCPROC_EMBEDDED: flag.default(true),
  ASYNCPROC_EMBEDDED_PORT: z.coerce.number({ message: 'expected a port number' }).int().min(1).max(65535).default(54329),
  ASYNCPROC_DEMO: flag.optional(),
  ASYNCPROC_ACTIVATOR: flag.default(true),
  /** Default: on when no authentication is required (development), off once it is. */
  ASYNCPROC_GRAPHIQL: flag.optional(),
  ASYNCPROC_MAX_BODY_BYTES: positiveInt.default(1024 * 1024),
  ASYNCPROC_MAX_CALLS: positiveInt.default(1000),
  ASYNCPROC_MAX_ARGUMENT_BYTES: positiveInt.default(64 * 1024),
  /**
   * On SIGTERM/SIGINT, how long calls running in this process are waited for before the
   * transactional ones are handed back to their queues (PostgreSQL). Below the process manager's
   * own kill timeout (Docker: 10 s).
   */
  ASYNCPROC_STOP_GRACE_SECONDS: z.coerce
    .number({ message: 'expected a number of seconds' })
    .min(0, 'expected 0 or more')
    // Node's timers hold at most 2^31 − 1 ms: a longer one fired after 1 ms
    .max(MAX_TIMER_SECONDS, `at most ${MAX_TIMER_SECONDS} (about 24 days)`)
    .default(8),
  ASYNCPROC_RETENTION_DAYS: z.coerce
    .number({ message: 'expected a number of days' })
    .positive()
    // PostgreSQL's intervals end somewhere past 178 million years; a retention past that failed every purge
    .max(36_500, 'at most 36500 (100 years)')
    .default(7),
  ASYNCPROC_POOL_SIZE: positiveInt.default(10),
  /** Rows of a call's first result set kept in its result (the rest are counted, `truncated` says so). */
  ASYNCPROC_MAX_ROWS: z.coerce
    .number({ message: 'expected a number of rows' })
    .int('expected a whole number')
    .min(0, 'expected 0 or more')
    .max(100_000, 'at most 100000 (rows are kept in memory and in the results table)')
    .default(100),
  // GraphQL edge
  /** Deepest selection of one operation (introspection excluded). */
  ASYNCPROC_MAX_DEPTH: positiveInt.default(DEFAULT_OPERATION_LIMITS.maxDepth),
  /** Aliased fields in one operation. */
  ASYNCPROC_MAX_ALIASES: positiveInt.default(DEFAULT_OPERATION_LIMITS.maxAliases),
  /** Lexical tokens of one document: bounds parse time before anything else runs. */
  ASYNCPROC_MAX_TOKENS: positiveInt.default(DEFAULT_OPERATION_LIMITS.maxTokens),
  /** Directives in one operation. */
  ASYNCPROC_MAX_DIRECTIVES: positiveInt.default(DEFAULT_OPERATION_LIMITS.maxDirectives),
  /** graphql-armor's cost: objects 2, scalars 1, ×1.5 per level, × a literal `first`/`last`. */
  ASYNCPROC_MAX_COST: positiveInt.default(DEFAULT_OPERATION_LIMITS.maxCost),
  /** List items an operation may ask for: each page times the pages around it, with the variables' values. */
  ASYNCPROC_MAX_NODES: positiveInt.default(10_000),
  /** Open SSE subscriptions one caller may hold (authentication required). */
  ASYNCPROC_MAX_SSE_STREAMS_PER_CALLER: positiveInt.default(100),
  /** Subscriptions one graphql-ws connection may hold at once. */
  ASYNCPROC_MAX_SUBSCRIPTIONS_PER_CONNECTION: positiveInt.default(100),
  /** Feed changes the hub may hold for one event stream whose subscriber does not take them before it ends it with SLOW_CONSUMER. */
  ASYNCPROC_MAX_SUBSCRIBER_QUEUE: positiveInt.default(20_000),
  /** Origins allowed cross-origin (comma-separated; `*` for any). Default: closed when authentication is required, open in development. */
  ASYNCPROC_CORS_ORIGINS: z
    .string()
    .transform((v) => v.split(',').map((o) => o.trim()).filter(Boolean))
    .refine((list) => list.every((o) => o === '*' || /^https?:\/\/[^/\s]+$/.test(o)), 'expected * or origins like https://app.example.com, comma-separated')
    .optional(),
  /**
   * With authentication off: host names the service answers besides IP addresses and localhost
   * (comma-separated; `*` for any). Others are refused, so that a page of another site cannot
   * point its own name at the service (DNS rebinding) and act as its administrator.
   */
  ASYNCPROC_ALLOWED_HOSTS: z
    .string()
    .transform((v) => v.split(',').map((h) => h.trim().toLowerCase()).filter(Boolean))
    .refine((list) => list.every((h) => h === '*' || /^[a-z0-9.-]+$/.test(h)), 'expected * or host names like devbox.internal (no ports), comma-separated')
    .optional(),
  /** Schema introspection. Default: on unless authentication is required. */
  ASYNCPROC_INTROSPECTION: flag.optional(),
  /** "Did you mean …?" in error messages. Default: on unless authentication is required. */
  ASYNCPROC_SUGGESTIONS: flag.optional(),
  /** Prometheus metrics at /metrics. */
  ASYNCPROC_METRICS: flag.default(true),
  /** The dashboard at /dashboard/ (`/` redirects there). */
  ASYNCPROC_DASHBOARD: flag.default(true),
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
});

export type Config = z.infer<typeof schema>;

function hasJwtKey(c: Pick<Config, 'ASYNCPROC_JWT_SECRET' | 'ASYNCPROC_JWT_PUBLIC_KEY' | 'ASYNCPROC_JWKS_URL'>): boolean {
  return Boolean(c.ASYNCPROC_JWT_SECRET || c.ASYNCPROC_JWT_PUBLIC_KEY || c.ASYNCPROC_JWKS_URL);
}

/**
 * The authentication a configuration asks for. Without DATABASE_URL (the embedded
 * development database) and no key, anonymous access; with DATABASE_URL, refusing to
 * start unless ASYNCPROC_AUTH=none says so explicitly.
 */
export function authSettings(config: Config): AuthSettings {
  const jwt = hasJwtKey(config)
    ? {
        secret: config.ASYNCPROC_JWT_SECRET,
        publicKey: config.ASYNCPROC_JWT_PUBLIC_KEY,
        jwksUrl: config.ASYNCPROC_JWKS_URL,
        issuer: config.ASYNCPROC_JWT_ISSUER,
        audience: config.ASYNCPROC_JWT_AUDIENCE,
        rolesClaim: config.ASYNCPROC_JWT_ROLES_CLAIM,
        requireExpiry: config.ASYNCPROC_JWT_REQUIRE_EXP,
      }
    : null;
  const mode = config.ASYNCPROC_AUTH ?? (jwt ? 'required' : config.DATABASE_URL ? undefined : 'none');
  if (!mode) {
    throw new ConfigError(
      'no authentication configured for DATABASE_URL: set ASYNCPROC_JWT_SECRET, ASYNCPROC_JWT_PUBLIC_KEY or ASYNCPROC_JWKS_URL ' +
        '(JWTs), or ASYNCPROC_AUTH=required (API keys only), or ASYNCPROC_AUTH=none to allow anonymous access (not for production)',
    );
  }
  return { mode, jwt };
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

/** The URL with its password masked, for messages and logs. */
export function maskPassword(url: string): string {
  try {
    const parsed = new URL(url);
    if (parsed.password) parsed.password = '***';
    return parsed.toString();
  } catch {
    return url.replace(/\/\/([^:/@]*):[^@]*@/, '//$1:***@');
  }
}

/** A value as an error message may show it: a secret not at all, a URL without its password. */
function shown(name: string, value: string | undefined): string | undefined {
  if (value === undefined) return value;
  if (/SECRET|PASSWORD/.test(name)) return `(${value.length} characters, not shown)`;
  return maskPassword(value);
}

/**
 * ASYNCPROC_* variables this version does not read, each with the settings it may be a
 * misspelling of: such a variable was ignored, so a mistyped ASYNCPROC_JWT_SECRET left the
 * embedded service open to anyone, and a mistyped limit left its default in force, without a word.
 */
function unknownSettings(env: NodeJS.ProcessEnv): string[] {
  const settings = Object.keys(schema.shape);
  // compared without the shared prefix, which would make every name look alike (ASYNCPROC_PORT is PORT)
  const bare = (name: string) => name.replace(/^ASYNCPROC_/, '');
  return Object.keys(env)
    .filter((name) => name.startsWith('ASYNCPROC_') && !settings.includes(name))
    .sort()
    .map((name) => {
      // the closest one only (the list's later names are often far off)
      const [closest] = suggestionList(bare(name), settings.map(bare));
      const like = settings.find((setting) => bare(setting) === closest);
      return `${name}: not a setting of asyncproc${like ? ` (did you mean ${like}?)` : ''}`;
    });
}

/** Read and validate the configuration; a bad value fails with a message naming the variable. */
export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  // a value of only blanks is unset, as an empty one is (z.coerce.number read " " as 0: PORT " " listened on a random port)
  const known = Object.fromEntries(Object.keys(schema.shape).map((key) => [key, env[key]?.trim() === '' ? undefined : env[key]]));
  const parsed = schema
    .refine((c) => c.ASYNCPROC_EMBEDDED || c.DATABASE_URL, {
      path: ['DATABASE_URL'],
      message: 'required when ASYNCPROC_EMBEDDED=false (the production start runs against an existing database)',
    })
    .refine((c) => !(c.ASYNCPROC_JWT_PUBLIC_KEY && c.ASYNCPROC_JWKS_URL), {
      path: ['ASYNCPROC_JWKS_URL'],
      message: 'give ASYNCPROC_JWT_PUBLIC_KEY or ASYNCPROC_JWKS_URL, not both',
    })
    .refine((c) => !(c.ASYNCPROC_AUTH === 'none' && hasJwtKey(c)), {
      path: ['ASYNCPROC_AUTH'],
      message: 'none contradicts the JWT key configured (ASYNCPROC_JWT_SECRET / ASYNCPROC_JWT_PUBLIC_KEY / ASYNCPROC_JWKS_URL)',
    })
    // checked here, not when the service has started the database and fails to listen beside it
    .refine((c) => c.DATABASE_URL || !c.ASYNCPROC_EMBEDDED || c.PORT !== c.ASYNCPROC_EMBEDDED_PORT, {
      path: ['PORT'],
      message: 'the embedded PostgreSQL listens on this port (ASYNCPROC_EMBEDDED_PORT): give one of them another',
    })
    .safeParse(known);
  const problems = parsed.success
    ? []
    : parsed.error.issues.map((issue) => {
        const name = String(issue.path[0]);
        return `${issue.path.join('.')}=${JSON.stringify(shown(name, env[name]))}: ${issue.message}`;
      });
  problems.push(...unknownSettings(env));
  if (!parsed.success || problems.length) throw new ConfigError(`invalid configuration: ${problems.join("; ")}`);
  return parsed.data;
}
