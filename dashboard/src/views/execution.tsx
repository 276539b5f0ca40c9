import { Fragment } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import { ApiError, gql, subscribe } from '../api';
import { CancelExecution, Fact, duration, ErrorNote, Json, KeyValues, ProgressBar, RowsTable, Section, StatusBadge, Time, useNow } from '../components';
import { ENDED, useLiveQuery, useProgress, type Progress, type Status } from '../live';
import { navigate } from '../router';

interface Attempt {
  number: number;
  status: string;
  startedAt: string;
  finishedAt: string | null;
  worker: string | null;
  sessionId: number | null;
  error: { number: string | null; message: string } | null;
}

interface Execution {
  token: string;
  procedure: string;
  arguments: Record<string, unknown>;
  queue: string;
  status: Status;
  submittedAt: string;
  runAt: string | null;
  startedAt: string | null;
  finishedAt: string | null;
  attempts: number;
  maxAttempts: number;
  submittedBy: string | null;
  worker: string | null;
  sessionId: number | null;
  stage: number | null;
  batch: { id: string; batchId: string } | null;
  progress: Progress | null;
  error: { number: string | null; message: string; line: number | null; severity: number | null; state: number | null; context: string | null; detail: string | null } | null;
  result: { returnValue: unknown; outputParameters: Record<string, unknown> | null; rows: unknown; rowCount: number | null; truncated: boolean | null } | null;
  history: Attempt[];
}

const ONE = `query Execution($token: ID!) {
  execution(token: $token) {
    token procedure arguments queue status submittedAt runAt startedAt finishedAt attempts maxAttempts submittedBy worker sessionId stage
    batch { id batchId }
    progress { percent message at }
    error { number message line severity state context detail }
    result { returnValue outputParameters rows rowCount truncated }
    history { number status startedAt finishedAt worker sessionId error { number message } }
  }
}`;

const COMPLETED = 'subscription Completed($token: ID!) { executionCompleted(token: $token) { status } }';

/** One call: followed live (its change events, its progress while it runs, its completion) until it ends. */
export function ExecutionPage({ token }: { token: string }) {
  const one = useLiveQuery<{ execution: Execution | null }>(ONE, { token }, (event) => event.execution.token === token, 100);
  const execution = one.data?.execution ?? null;
  const running = execution?.status === 'RUNNING';
  const ended = execution ? ENDED.includes(execution.status) : false;
  const progress = useProgress(token, execution?.progress ?? null, running);
  // the outcome, however the feed fares: one event when the call ends (also if it already has)
  useEffect(() => {
    if (!execution || ended) return;
    return subscribe({ query: COMPLETED, variables: { token } }, { next: () => one.reload() });
  }, [token, !!execution, ended]);
  const now = useNow();
  if (one.error && !execution) return <ErrorNote error={one.error} />;
  if (!execution) return one.loading ? <p class="muted">Loading…</p> : <p class="note">No execution {token} — unknown, or not yours to see.</p>;
  const elapsed = execution.startedAt ? (execution.finishedAt ? Date.parse(execution.finishedAt) : now) - Date.parse(execution.startedAt) : null;
  return (
    <div class="stack">
      <Section
        title={execution.procedure}
        actions={
          <>
            <RunAgain execution={execution} />
            {ended ? null : <CancelExecution token={token} onDone={one.reload} />}
          </>
        }
      >
        <div class="facts">
          <Fact label="status"><StatusBadge status={execution.status} /></Fact>
          <Fact label="token"><code class="small">{execution.token}</code></Fact>
          <Fact label="queue">{execution.queue}</Fact>
          <Fact label="submitted"><Time at={execution.submittedAt} /> {execution.submittedBy ? `by ${execution.submittedBy}` : ''}</Fact>
          {execution.runAt ? (
            <Fact label="not before"><Time at={execution.runAt} /></Fact>
          ) : null}
          <Fact label="started"><Time at={execution.startedAt} /></Fact>
          <Fact label="finished"><Time at={execution.finishedAt} /></Fact>
          <Fact label={execution.finishedAt ? 'took' : 'running for'}>{elapsed === null ? '—' : duration(elapsed)}</Fact>
          <Fact label="attempts">{execution.attempts} of {execution.maxAttempts}</Fact>
          <Fact label="worker · session">{execution.worker ?? '—'} · {execution.sessionId ?? '—'}</Fact>
          {execution.batch ? (
            <Fact label="batch"><a href={`#/batch/${execution.batch.batchId}`}>{execution.batch.batchId.slice(0, 8)}</a> stage {execution.stage}</Fact>
          ) : null}
        </div>
        {progress && (running || execution.status === 'SUCCEEDED') ? <ProgressBar percent={progress.percent} message={progress.message} label="progress of the call" /> : null}
      </Section>
      {execution.error ? (
        <Section title="Error">
          <div class="failure" data-testid="execution-error">
            <p class="error-message">{execution.error.message}</p>
            <dl class="inline-dl">
              {(
                [
                  ['number', execution.error.number ?? '—'],
                  ['line', execution.error.line ?? '—'],
                  ['severity', execution.error.severity],
                  ['state', execution.error.state],
                ] as const
              ).map(([term, value]) =>
                value === null ? null : (
                  <Fragment key={term}>
                    <dt>{term}</dt>
                    <dd>{value}</dd>
                  </Fragment>
                ),
              )}
            </dl>
            {execution.error.context ? <pre class="json">{execution.error.context}</pre> : null}
          </div>
        </Section>
      ) : null}
      <Section title="Arguments">
        <KeyValues value={execution.arguments} />
      </Section>
      {execution.result ? (
        <Section title="Result">
          <h3>return value</h3>
          <Json value={execution.result.returnValue} />
          <h3>output parameters</h3>
          <KeyValues value={execution.result.outputParameters} />
          {execution.result.rows !== null ? (
            <>
              <h3>
                rows{execution.result.rowCount !== null ? ` (${execution.result.rowCount}${execution.result.truncated ? ', cut at the cap' : ''})` : ''}
              </h3>
              <RowsTable rows={execution.result.rows} />
            </>
          ) : null}
        </Section>
      ) : null}
      <Section title="Attempts">
        <History attempts={execution.history} />
      </Section>
    </div>
  );
}

function History({ attempts }: { attempts: Attempt[] }) {
  if (!attempts.length) return <p class="muted">Not started yet.</p>;
  return (
    <ol class="timeline" data-testid="history">
      {attempts.map((a) => (
        <li key={a.number} class={`attempt attempt-${a.status.toLowerCase()}`}>
          <div class="attempt-head">
            <strong>attempt {a.number}</strong> <StatusBadge status={a.status} />
          </div>
          <div class="small">
            <Time at={a.startedAt} /> → <Time at={a.finishedAt} />
            {a.finishedAt ? ` (${duration(Date.parse(a.finishedAt) - Date.parse(a.startedAt))})` : ''} · {a.worker ?? 'worker —'} · session {a.sessionId ?? '—'}
          </div>
          {a.error ? (
            <div class="error-text small">
              {a.error.number ? `${a.error.number}: ` : ''}
              {a.error.message}
            </div>
          ) : null}
        </li>
      ))}
    </ol>
  );
}

const INVOKE = 'mutation Invoke($input: InvokeInput!) { invoke(input: $input) { execution { token } } }';

/** The same procedure with the same arguments, on the same queue; then its own page. One call per click: busy until answered. */
function RunAgain({ execution }: { execution: Execution }) {
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);
  return (
    <span class="confirm">
      <button
        type="button"
        disabled={busy}
        onClick={() => {
          setBusy(true);
          gql<{ invoke: { execution: { token: string } } }>(INVOKE, { input: { procedure: execution.procedure, arguments: execution.arguments, queue: execution.queue } }).then(
            ({ invoke }) => (setBusy(false), navigate(`/execution/${invoke.execution.token}`)),
            (e: ApiError) => (setBusy(false), setError(e)),
          );
        }}
      >
        Run again
      </button>
      {error ? <span class="error-text">{error.message}</span> : null}
    </span>
  );
}

export { INVOKE };
