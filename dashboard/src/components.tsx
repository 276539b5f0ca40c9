import type { ComponentChildren } from 'preact';
import { useEffect, useLayoutEffect, useRef, useState } from 'preact/hooks';
import { ApiError, gql } from './api';
import type { Status } from './live';

export function duration(ms: number): string {
  if (ms < 1000) return `${Math.max(0, Math.round(ms))} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function Time({ at }: { at: string | null | undefined }) {
  if (!at) return <span class="muted">—</span>;
  const date = new Date(at);
  const today = date.toDateString() === new Date().toDateString();
  return <time dateTime={at} title={date.toISOString()}>{today ? date.toLocaleTimeString() : date.toLocaleString()}</time>;
}

/** The current time, a tick a second, for elapsed times (local arithmetic; nothing is fetched). */
export function useNow(everyMs = 1000): number {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    const timer = setInterval(() => setNow(Date.now()), everyMs);
    return () => clearInterval(timer);
  }, [everyMs]);
  return now;
}

export function StatusBadge({ status }: { status: Status | string }) {
  return <span class={`badge status-${status.toLowerCase()}`} data-status={status}>{status}</span>;
}

export function ProgressBar({ percent, message, label }: { percent: number; message?: string | null; label?: string }) {
  const clamped = Math.max(0, Math.min(100, percent));
  return (
    <div class="progress" role="progressbar" aria-label={label ?? 'progress'} aria-valuemin={0} aria-valuemax={100} aria-valuenow={Math.round(clamped)}>
      <div class="progress-fill" style={{ width: `${clamped}%` }} />
      <span class="progress-text">
        {clamped.toFixed(0)}%{message ? ` · ${message}` : ''}
      </span>
    </div>
  );
}

export function Json({ value }: { value: unknown }) {
  if (value === null || value === undefined) return <span class="muted">null</span>;
  if (typeof value !== 'object') return <code>{JSON.stringify(value)}</code>;
  return <pre class="json">{JSON.stringify(value, null, 2)}</pre>;
}

/** Key → value rows (arguments, output parameters). */
export function KeyValues({ value }: { value: unknown }) {
  if (!value || typeof value !== 'object' || Array.isArray(value)) return <Json value={value} />;
  const entries = Object.entries(value);
  if (!entries.length) return <span class="muted">none</span>;
  return (
    <table class="kv">
      <tbody>
        {entries.map(([key, v]) => (
          <tr key={key}>
            <th>{key}</th>
            <td>
              <Json value={v} />
            </td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

/**
 * A table that turns into one card per row at phone width: each cell is labelled (data-label) with
 * its column's heading, which the stylesheet shows in front of it.
 */
export function Grid({ class: extra, head, children }: { class?: string; head: (string | [string, 'num'])[]; children: ComponentChildren }) {
  const table = useRef<HTMLTableElement>(null);
  useLayoutEffect(() => {
    const labels = [...(table.current?.querySelectorAll('thead th') ?? [])].map((th) => th.textContent ?? '');
    for (const row of table.current?.querySelectorAll('tbody tr') ?? []) [...row.children].forEach((cell, i) => cell.setAttribute('data-label', labels[i] ?? ''));
  });
  return (
    <table ref={table} class={`grid cards${extra ? ` ${extra}` : ''}`}>
      <thead>
        <tr>{head.map((column) => (typeof column === 'string' ? <th key={column}>{column}</th> : <th key={column[0]} class={column[1]}>{column[0]}</th>))}</tr>
      </thead>
      {children}
    </table>
  );
}

/** Rows of a result set as a table; columns are the union of the rows' keys. */
export function RowsTable({ rows }: { rows: unknown }) {
  if (!Array.isArray(rows)) return <Json value={rows} />;
  if (!rows.length) return <span class="muted">no rows</span>;
  const columns = [...new Set(rows.flatMap((row) => (row && typeof row === 'object' ? Object.keys(row) : [])))];
  return (
    <div class="scroll">
      <table class="grid">
        <thead>
          <tr>{columns.map((c) => <th key={c}>{c}</th>)}</tr>
        </thead>
        <tbody>
          {rows.map((row, i) => (
            <tr key={i}>
              {columns.map((c) => {
                const cell = (row as Record<string, unknown>)[c];
                return <td key={c}>{cell !== null && typeof cell === 'object' ? JSON.stringify(cell) : String(cell ?? '')}</td>;
              })}
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

export function ErrorNote({ error }: { error: ApiError | Error | string | null | undefined }) {
  if (!error) return null;
  const text = typeof error === 'string' ? error : error instanceof ApiError ? `${error.code}: ${error.message}` : error.message;
  return <p class="note error" role="alert">{text}</p>;
}

/** One labelled value in a `.facts` grid. */
export function Fact({ label, children }: { label: string; children: ComponentChildren }) {
  return (
    <div>
      <span>{label}</span>
      {children}
    </div>
  );
}

export function Section({ title, children, actions }: { title: string; children: ComponentChildren; actions?: ComponentChildren }) {
  return (
    <section class="card">
      <header class="card-head">
        <h2>{title}</h2>
        {actions ? <div class="actions">{actions}</div> : null}
      </header>
      {children}
    </section>
  );
}

/**
 * A button that runs a mutation only after a second, explicit click ("Yes, cancel"); the server's answer
 * (ALREADY_FINISHED, FORBIDDEN, …) is shown in place.
 */
export function ConfirmAction({ label, question, confirm, run, onDone, safe }: { label: string; question: string; confirm: string; run: () => Promise<unknown>; onDone?: () => void; safe?: boolean }) {
  const [asking, setAsking] = useState(false);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<ApiError | null>(null);
  if (!asking) {
    return (
      <span class="confirm">
        <button type="button" class={safe ? undefined : 'danger'} onClick={() => (setError(null), setAsking(true))}>
          {label}
        </button>
        {error ? <span class="error-text">{error.code}: {error.message}</span> : null}
      </span>
    );
  }
  return (
    <span class="confirm" role="group" aria-label={question}>
      <span>{question}</span>
      <button
        type="button"
        class={safe ? 'primary' : 'danger'}
        disabled={busy}
        onClick={() => {
          setBusy(true);
          run().then(
            () => (setBusy(false), setAsking(false), onDone?.()),
            (e: ApiError) => (setBusy(false), setAsking(false), setError(e)),
          );
        }}
      >
        {confirm}
      </button>
      <button type="button" onClick={() => setAsking(false)}>
        Keep
      </button>
    </span>
  );
}

export function CancelExecution({ token, onDone }: { token: string; onDone?: () => void }) {
  return (
    <ConfirmAction
      label="Cancel"
      question="Cancel this call?"
      confirm="Yes, cancel"
      run={() => gql('mutation Cancel($token: ID!) { cancelExecution(token: $token) { execution { token status } } }', { token })}
      onDone={onDone}
    />
  );
}

export function ExecutionLink({ token, children }: { token: string; children?: ComponentChildren }) {
  return (
    <a href={`#/execution/${token}`} class="token" title={token}>
      {children ?? token.slice(0, 8)}
    </a>
  );
}

export interface StageCounts {
  stage?: number;
  total: number;
  succeeded: number;
  failed: number;
  cancelled: number;
  running: number;
  pending: number;
  waiting: number;
}

/** A stacked bar: ended (succeeded, failed, cancelled) then running, then what still waits. */
export function StageBar({ counts, label }: { counts: StageCounts; label: string }) {
  const parts = (['succeeded', 'failed', 'cancelled', 'running', 'pending', 'waiting'] as const).filter((k) => counts[k] > 0);
  const ended = counts.succeeded + counts.failed + counts.cancelled;
  return (
    <div class="stage">
      <div class="stage-label">
        <strong>{label}</strong>
        <span class="stage-counts" data-ended={ended} data-total={counts.total}>
          {ended}/{counts.total} ended · {parts.map((k) => `${counts[k]} ${k}`).join(' · ')}
        </span>
      </div>
      <div class="stagebar" role="progressbar" aria-label={label} aria-valuemin={0} aria-valuemax={counts.total} aria-valuenow={ended}>
        {parts.map((k) => (
          <div key={k} class={`seg seg-${k}`} style={{ width: `${(100 * counts[k]) / Math.max(1, counts.total)}%` }} title={`${counts[k]} ${k}`} />
        ))}
      </div>
    </div>
  );
}
