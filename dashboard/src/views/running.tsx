import { useMemo } from 'preact/hooks';
import { CancelExecution, duration, ErrorNote, ExecutionLink, Grid, ProgressBar, Section, useNow } from '../components';
import { useLiveQuery, useProgress, type Progress } from '../live';

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
    progress?: Progress | null;
  };
}

const RUNNING = `{ running(first: 200) { elapsedMs execution { token procedure queue worker sessionId submittedBy attempts progress { percent message at } } } }`;

/** Rows whose progress is followed live (one executionProgress stream each; a connection holds at most 100). */
const FOLLOWED = 25;

function LiveProgress({ token, initial, follow }: { token: string; initial: Progress | null; follow: boolean }) {
  const progress = useProgress(token, initial, follow);
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
          <Grid class="running" head={['call', 'procedure', 'queue', ['elapsed', 'num'], 'worker · session', 'submitted by', 'progress', '']}>
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
