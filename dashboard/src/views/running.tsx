import { useEffect, useMemo, useState } from 'preact/hooks';
import { subscribe } from '../api';
import { CancelExecution, duration, ErrorNote, ExecutionLink, Grid, ProgressBar, Section, useNow } from '../components';
import { useLiveQuery } from '../live';

export interface RunningRow {
  elapsedMs: number;
  execution: {
    token: string;
    procedure: string;
    queue: string;
    worker: string | null;
    sessionId: number | null;
    submittedBy?: string | null;
    attempts?: number;
    progress?: { percent: number; message: string | null } | null;
  };
}

const RUNNING = `{ running(first: 200) { elapsedMs execution { token procedure queue worker sessionId submittedBy attempts progress { percent message } } } }`;

type Progress = { percent: number; message: string | null };

/** Rows whose progress is followed live (one executionProgress stream each; a connection holds at most 100). */
const FOLLOWED = 25;
const PROGRESS = 'subscription Progress($token: ID!) { executionProgress(token: $token) { progress { percent message } } }';

function LiveProgress({ token, initial, follow }: { token: string; initial: Progress | null; follow: boolean }) {
  const [progress, setProgress] = useState(initial);
  useEffect(() => setProgress(initial), [initial?.percent, initial?.message]);
  useEffect(() => {
    if (!follow) return;
    return subscribe<{ executionProgress: { progress: Progress | null } }>(
      { query: PROGRESS, variables: { token } },
      { next: ({ executionProgress }) => executionProgress.progress && setProgress(executionProgress.progress) },
    );
  }, [token, follow]);
  return progress ? <ProgressBar percent={progress.percent} message={progress.message} /> : <span class="muted">—</span>;
}

/** What runs now, longest first, elapsed ticking; everything a caller can see here it may cancel (its own, or all for operators). */
export function Running() {
  const running = useLiveQuery<{ running: RunningRow[] }>(RUNNING, undefined, () => true, 300);
  const fetchedAt = useMemo(() => Date.now(), [running.data]);
  const now = useNow();
  const rows = running.data?.running ?? [];
  return (
    <Section title={`Running now (${rows.length})`}>
      <ErrorNote error={running.error} />
      {rows.length ? (
        <div class="scroll">
          <Grid class="running">
            <thead>
              <tr>
                <th>call</th>
                <th>procedure</th>
                <th>queue</th>
                <th class="num">elapsed</th>
                <th>worker · session</th>
                <th>submitted by</th>
                <th>progress</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {rows.map((r, i) => (
                <tr key={r.execution.token} data-token={r.execution.token}>
                  <td>
                    <ExecutionLink token={r.execution.token} />
                  </td>
                  <td>{r.execution.procedure}</td>
                  <td>{r.execution.queue}</td>
                  <td class="num elapsed">{duration(r.elapsedMs + now - fetchedAt)}</td>
                  <td>
                    {r.execution.worker ?? '—'} · {r.execution.sessionId ?? '—'}
                  </td>
                  <td>{r.execution.submittedBy ?? <span class="muted">anonymous</span>}</td>
                  <td class="progress-cell">
                    <LiveProgress token={r.execution.token} initial={r.execution.progress ?? null} follow={i < FOLLOWED} />
                  </td>
                  <td>
                    <CancelExecution token={r.execution.token} onDone={running.reload} />
                  </td>
                </tr>
              ))}
            </tbody>
          </Grid>
        </div>
      ) : running.loading ? (
        <p class="muted">Loading…</p>
      ) : (
        <p class="muted">Nothing runs now.</p>
      )}
    </Section>
  );
}
