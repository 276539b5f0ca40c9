import { useEffect, useState } from 'preact/hooks';
import { ApiError, gql, subscribe } from '../api';
import { CancelExecution, duration, ErrorNote, Json, KeyValues, ProgressBar, RowsTable, Section, StatusBadge, Time, useNow } from '../components';
import { ENDED, useLiveQuery, type Status } from '../live';
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

interface Progress {
  percent: number;
  message: string | null;
  at: string;
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
  batch: { id: string } | null;
  progress: Progress | null;
  error: { number: string | null; message: string; line: number | null; severity: number | null; state: number | null; context: string | null; detail: string | null } | null;
  result: { returnValue: unknown; outputParameters: Record<string, unknown> | null; rows: unknown; rowCount: number | null; truncated: boolean | null } | null;
  history: Attempt[];
}

const ONE = `query Execution($token: ID!) {
  execution(token: $token) {
    token procedure arguments queue status submittedAt runAt startedAt finishedAt attempts maxAttempts submittedBy worker sessionId stage
    batch { id }
    progress { percent message at }
    error { number message line severity state context detail }
    result { returnValue outputParameters rows rowCount truncated }
    history { number status startedAt finishedAt worker sessionId error { number message } }
  }
}`;

const PROGRESS = 'subscription Progress($token: ID!) { executionProgress(token: $token) { status progress { percent message at } } }';
const COMPLETED = 'subscription Completed($token: ID!) { executionCompleted(token: $token) { status } }';

/** One call: followed live (its change events, its progress while it runs, its completion) until it ends. */
export function ExecutionPage({ token }: { token: string }) {
  const one = useLiveQuery<{ execution: Execution | null }>(ONE, { token }, (event) => event.execution.token === token, 100);
  const execution = one.data?.execution ?? null;
  const [progress, setProgress] = useState<Progress | null>(null);
  const running = execution?.status === 'RUNNING';
  const ended = execution ? ENDED.includes(execution.status) : false;
  useEffect(() => {
    if (!running) return;
    return subscribe<{ executionProgress: { progress: Progress | null } }>(
      { query: PROGRESS, variables: { token } },
      { next: ({ executionProgress }) => executionProgress.progress && setProgress(executionProgress.progress) },
    );
  }, [token, running]);
  // the outcome, however the feed fares: one event when the call ends (also if it already has)
  useEffect(() => {
    if (!execution || ended) return;
    return subscribe({ query: COMPLETED, variables: { token } }, { next: () => one.reload() });
  }, [token, !!execution, ended]);
  const now = useNow();
  if (one.error && !execution) return <ErrorNote error={one.error} />;
  if (!execution) return one.loading ? <p class="muted">Loading…</p> : <p class="note">No execution {token} — unknown, or not yours to see.</p>;
  const shownProgress = progress && (!execution.progress || progress.at >= execution.progress.at) ? progress : execution.progress;
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
          <div>
            <span>status</span>
            <StatusBadge status={execution.status} />
          </div>
          <div>
            <span>token</span>
            <code class="small">{execution.token}</code>
          </div>
          <div>
            <span>queue</span>
            {execution.queue}
          </div>
          <div>
            <span>submitted</span>
            <Time at={execution.submittedAt} /> {execution.submittedBy ? `by ${execution.submittedBy}` : ''}
          </div>
          {execution.runAt ? (
            <div>
              <span>not before</span>
              <Time at={execution.runAt} />
            </div>
          ) : null}
          <div>
            <span>started</span>
            <Time at={execution.startedAt} />
          </div>
          <div>
            <span>finished</span>
            <Time at={execution.finishedAt} />
          </div>
          <div>
            <span>{execution.finishedAt ? 'took' : 'running for'}</span>
            {elapsed === null ? '—' : duration(elapsed)}
          </div>
          <div>
            <span>attempts</span>
            {execution.attempts} of {execution.maxAttempts}
          </div>
          <div>
            <span>worker · session</span>
            {execution.worker ?? '—'} · {execution.sessionId ?? '—'}
          </div>
          {execution.batch ? (
            <div>
              <span>batch</span>
              <a href={`#/batch/${execution.batch.id}`}>{execution.batch.id.slice(0, 8)}</a> stage {execution.stage}
            </div>
          ) : null}
        </div>
        {shownProgress && (running || execution.status === 'SUCCEEDED') ? <ProgressBar percent={shownProgress.percent} message={shownProgress.message} label="progress of the call" /> : null}
      </Section>
      {execution.error ? (
        <Section title="Error">
          <div class="failure" data-testid="execution-error">
            <p class="error-message">{execution.error.message}</p>
            <dl class="inline-dl">
              <dt>number</dt>
              <dd>{execution.error.number ?? '—'}</dd>
              <dt>line</dt>
              <dd>{execution.error.line ?? '—'}</dd>
              {execution.error.severity !== null ? (
                <>
                  <dt>severity</dt>
                  <dd>{execution.error.severity}</dd>
                </>
              ) : null}
              {execution.error.state !== null ? (
                <>
                  <dt>state</dt>
                  <dd>{execution.error.state}</dd>
                </>
              ) : null}
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

/** The same procedure with the same arguments, on the same queue; then its own page. */
function RunAgain({ execution }: { execution: Execution }) {
  const [error, setError] = useState<ApiError | null>(null);
  return (
    <span class="confirm">
      <button
        type="button"
        onClick={() =>
          gql<{ invoke: { execution: { token: string } } }>(INVOKE, { input: { procedure: execution.procedure, arguments: execution.arguments, queue: execution.queue } }).then(
            ({ invoke }) => navigate(`/execution/${invoke.execution.token}`),
            setError,
          )
        }
      >
        Run again
      </button>
      {error ? <span class="error-text">{error.message}</span> : null}
    </span>
  );
}

export { INVOKE };
