import type { InputHTMLAttributes } from 'preact';
import { useState } from 'preact/hooks';
import { ApiError, gql } from '../api';
import { ErrorNote, Grid, Section } from '../components';
import { useLiveQuery } from '../live';
import { navigate } from '../router';
import { INVOKE } from './execution';

interface Parameter {
  name: string;
  type: string;
  mode: 'IN' | 'INOUT' | 'OUT';
  hasDefault: boolean;
  position: number;
}

interface Procedure {
  name: string;
  queue: string;
  maxAttempts: number;
  timeoutMs: number | null;
  transactional: boolean;
  roles: string[];
  parameters: Parameter[];
}

const PROCEDURES = '{ procedures { name queue maxAttempts timeoutMs transactional roles parameters { name type mode hasDefault position } } }';

export function Procedures() {
  const list = useLiveQuery<{ procedures: Procedure[] }>(PROCEDURES, undefined, null);
  return (
    <Section title="Procedures">
      <ErrorNote error={list.error} />
      <div class="scroll">
        <Grid head={['procedure', 'parameters', 'queue', ['attempts', 'num'], 'timeout', 'roles']}>
          <tbody>
            {(list.data?.procedures ?? []).map((p) => (
              <tr key={p.name}>
                <td>
                  <a href={`#/procedure/${encodeURIComponent(p.name)}`}>{p.name}</a>
                  {p.transactional ? null : <span class="tag">no transaction</span>}
                </td>
                <td class="params">{p.parameters.map((x) => `${x.mode === 'IN' ? '' : `${x.mode.toLowerCase()} `}${x.name} ${x.type}${x.hasDefault ? ' = default' : ''}`).join(', ') || <span class="muted">none</span>}</td>
                <td>{p.queue}</td>
                <td class="num">{p.maxAttempts}</td>
                <td>{p.timeoutMs ? `${p.timeoutMs} ms` : <span class="muted">none</span>}</td>
                <td>{p.roles.join(', ') || <span class="muted">any caller</span>}</td>
              </tr>
            ))}
          </tbody>
        </Grid>
      </div>
    </Section>
  );
}

type Kind = 'integer' | 'bigint' | 'decimal' | 'float' | 'boolean' | 'json' | 'date' | 'timestamp' | 'timestamptz' | 'time' | 'text';

/** How a parameter is typed in, from the database's type name (PostgreSQL's format_type, SQL Server's type names). */
export function kindOf(type: string): Kind {
  const t = type.toLowerCase();
  if (t.endsWith('[]') || /^(json|jsonb|xml)$/.test(t)) return 'json';
  if (/^(smallint|integer|int|int2|int4|tinyint)$/.test(t)) return 'integer';
  if (t === 'bigint' || t === 'int8') return 'bigint';
  if (/^(numeric|decimal|money|smallmoney)/.test(t)) return 'decimal';
  if (/^(real|double precision|float)/.test(t)) return 'float';
  if (t === 'boolean' || t === 'bit') return 'boolean';
  if (t === 'date') return 'date';
  if (/^timestamp.* with time zone$|^datetimeoffset/.test(t)) return 'timestamptz';
  if (/^(timestamp|datetime|smalldatetime|datetime2)/.test(t)) return 'timestamp';
  if (/^time/.test(t)) return 'time';
  return 'text';
}

/** A typed-in value as the argument to send; undefined: left out (its default applies). Throws on what does not parse. */
export function argumentValue(kind: Kind, text: string): unknown {
  if (text === '') return undefined;
  switch (kind) {
    case 'integer':
    case 'float': {
      const n = Number(text);
      if (!Number.isFinite(n)) throw new Error(`"${text}" is not a number`);
      return n;
    }
    // exact: beyond a double's precision a JSON number would arrive rounded
    case 'bigint':
      if (!/^-?\d+$/.test(text)) throw new Error(`"${text}" is not an integer`);
      return Number.isSafeInteger(Number(text)) ? Number(text) : text;
    case 'decimal':
      if (!/^-?\d+(\.\d+)?$/.test(text)) throw new Error(`"${text}" is not a decimal number`);
      return text;
    case 'boolean':
      return text === 'true';
    case 'json':
      try {
        return JSON.parse(text);
      } catch {
        throw new Error('not valid JSON');
      }
    case 'timestamptz':
      return isoInstant(text);
    default:
      return text;
  }
}

/**
 * A local date and time as the instant the service takes (ISO 8601, UTC). A year the browser's
 * Date cannot hold (past 275760, or past 9999 once turned into ISO text) is refused here, before
 * anything is sent, rather than thrown from the submit.
 */
function isoInstant(text: string): string {
  const at = new Date(text);
  if (Number.isNaN(at.getTime()) || at.getUTCFullYear() > 9999 || at.getUTCFullYear() < 1) throw new Error(`"${text}" is not a date and time from year 1 to 9999`);
  return at.toISOString();
}

const INPUT_TYPE: Partial<Record<Kind, 'number' | 'date' | 'datetime-local' | 'time'>> = { integer: 'number', float: 'number', date: 'date', timestamp: 'datetime-local', timestamptz: 'datetime-local', time: 'time' };

/** The input's type and keyboard for a kind of parameter (checked again by argumentValue). */
function typed(kind: Kind): InputHTMLAttributes<HTMLInputElement> {
  const step = kind === 'float' ? 'any' : kind === 'timestamp' || kind === 'timestamptz' || kind === 'time' ? 1 : undefined;
  return { type: INPUT_TYPE[kind] ?? 'text', step, inputMode: kind === 'bigint' || kind === 'decimal' ? 'decimal' : undefined } as InputHTMLAttributes<HTMLInputElement>;
}

/** A form generated from the procedure's parameters; submitting it invokes the call and follows it on its page. */
export function ProcedurePage({ name }: { name: string }) {
  const list = useLiveQuery<{ procedures: Procedure[] }>(PROCEDURES, undefined, null);
  const [values, setValues] = useState<Record<string, string>>({});
  const [queue, setQueue] = useState('');
  const [runAt, setRunAt] = useState('');
  const [error, setError] = useState<ApiError | string | null>(null);
  const [busy, setBusy] = useState(false);
  const procedure = list.data?.procedures.find((p) => p.name === name);
  if (!procedure) return list.loading ? <p class="muted">Loading…</p> : <p class="note">{name ? `No registered procedure ${name}.` : "No procedure named: pick one from the list."}</p>;
  const inputs = procedure.parameters.filter((p) => p.mode !== 'OUT').sort((a, b) => a.position - b.position);
  const submit = (event: Event) => {
    event.preventDefault();
    const args: Record<string, unknown> = {};
    let notBefore: string | undefined;
    try {
      for (const p of inputs) {
        const value = argumentValue(kindOf(p.type), values[p.name] ?? '');
        if (value !== undefined) args[p.name] = value;
      }
      notBefore = runAt ? isoInstant(runAt) : undefined;
    } catch (e) {
      setError((e as Error).message);
      return;
    }
    setBusy(true);
    gql<{ invoke: { execution: { token: string } } }>(INVOKE, { input: { procedure: procedure.name, arguments: args, ...(queue ? { queue } : {}), ...(notBefore ? { runAt: notBefore } : {}) } }).then(
      ({ invoke }) => navigate(`/execution/${invoke.execution.token}`),
      (e: ApiError) => (setBusy(false), setError(e)),
    );
  };
  return (
    <Section title={`Invoke ${procedure.name}`}>
      <form class="invoke" onSubmit={submit}>
        {inputs.map((p) => {
          const kind = kindOf(p.type);
          const set = (value: string) => setValues({ ...values, [p.name]: value });
          const label = (
            <span class="label">
              {p.name} <code class="small">{p.type}</code> {p.hasDefault ? <span class="muted">optional (default)</span> : <span class="required">required</span>}
            </span>
          );
          if (kind === 'boolean') {
            return (
              <label key={p.name}>
                {label}
                <select name={p.name} required={!p.hasDefault} value={values[p.name] ?? ''} onChange={(e) => set(e.currentTarget.value)}>
                  <option value="">{p.hasDefault ? 'default' : 'choose'}</option>
                  <option value="true">true</option>
                  <option value="false">false</option>
                </select>
              </label>
            );
          }
          if (kind === 'json') {
            return (
              <label key={p.name}>
                {label}
                <textarea name={p.name} required={!p.hasDefault} rows={3} placeholder="JSON" value={values[p.name] ?? ''} onInput={(e) => set(e.currentTarget.value)} />
              </label>
            );
          }
          return (
            <label key={p.name}>
              {label}
              <input
                name={p.name}
                {...typed(kind)}
                required={!p.hasDefault}
                placeholder={p.hasDefault ? 'default' : ''}
                value={values[p.name] ?? ''}
                onInput={(e) => set(e.currentTarget.value)}
              />
            </label>
          );
        })}
        {inputs.length ? null : <p class="muted">This procedure takes no arguments.</p>}
        <label>
          <span class="label">
            queue <span class="muted">optional (registered: {procedure.queue})</span>
          </span>
          <input name="queue" value={queue} placeholder={procedure.queue} onInput={(e) => setQueue(e.currentTarget.value)} />
        </label>
        <label>
          <span class="label">
            not before <span class="muted">optional (your local time; empty: now)</span>
          </span>
          <input name="runAt" type="datetime-local" step={1} value={runAt} onInput={(e) => setRunAt(e.currentTarget.value)} />
        </label>
        <div>
          <button type="submit" class="primary" disabled={busy}>
            Invoke
          </button>
        </div>
        <ErrorNote error={error} />
      </form>
    </Section>
  );
}
