import { useEffect, useMemo } from 'preact/hooks';
import { credential } from '../api';
import { BarChart } from '../chart';
import { duration, ErrorNote, ExecutionLink, Grid, Section, useNow } from '../components';
import { useLiveQuery } from '../live';
import { BUCKET_SECONDS, outcomesVersion, seedOutcomes, series, WINDOW_MINUTES } from '../outcomes';
import { useStore } from '../store';
import { QueueCounts, QUEUES, type Queue } from './queues';
import type { RunningRow } from './running';

const SLOWEST = `{ running(first: 5) { elapsedMs execution { token procedure queue worker sessionId } } }`;

export function Overview() {
  const queues = useLiveQuery<{ queues: Queue[] }>(QUEUES, undefined, () => true, 500);
  const slowest = useLiveQuery<{ running: RunningRow[] }>(SLOWEST, undefined, () => true, 500);
  const version = useStore(outcomesVersion);
  // the window slides every bucket even when nothing ends
  const tickAt = useNow(BUCKET_SECONDS * 1000);
  // seeded again for the next caller's credentials (outcomes.ts forgets the last one's counts)
  const who = useStore(credential);
  useEffect(() => void seedOutcomes().catch(() => {}), [who]);
  // read the clock at each change too: a call that ended in a bucket the last tick did not reach
  // yet is counted at once, not up to a bucket later
  const [xs, ok, bad] = useMemo(() => series(Date.now()), [version, tickAt]);
  const failures = bad.reduce((a, b) => a + b, 0);
  const successes = ok.reduce((a, b) => a + b, 0);
  const rate = failures + successes ? Math.round((100 * failures) / (failures + successes)) : 0;
  const fetchedAt = useMemo(() => Date.now(), [slowest.data]);
  const tick = useNow();
  return (
    <div class="stack">
      <Section title="Queues">
        <ErrorNote error={queues.error} />
        {queues.data ? <QueueCounts queues={queues.data.queues} /> : <p class="muted">Loading…</p>}
      </Section>
      <div class="two">
        <Section title={`Succeeded · last ${WINDOW_MINUTES} min`}>
          <p class="figure" data-testid="succeeded-total">{successes}</p>
          <BarChart data={[xs, ok]} label="succeeded per 10 s" colorVar="--ok" />
        </Section>
        <Section title={`Failed · last ${WINDOW_MINUTES} min`}>
          <p class={`figure${failures ? ' bad' : ''}`} data-testid="failed-total">
            {failures} <small>({rate}% of ended)</small>
          </p>
          <BarChart data={[xs, bad]} label="failed per 10 s" colorVar="--bad" />
        </Section>
      </div>
      <Section title="Slowest running" actions={<a href="#/running">all running →</a>}>
        <ErrorNote error={slowest.error} />
        {slowest.data?.running.length ? (
          <Grid head={['call', 'procedure', 'queue', ['running for', 'num']]}>
            <tbody>
              {slowest.data.running.map((r) => (
                <tr key={r.execution.token}>
                  <td>
                    <ExecutionLink token={r.execution.token} />
                  </td>
                  <td>{r.execution.procedure}</td>
                  <td>{r.execution.queue}</td>
                  <td class="num">{duration(r.elapsedMs + tick - fetchedAt)}</td>
                </tr>
              ))}
            </tbody>
          </Grid>
        ) : (
          <p class="muted">Nothing runs now.</p>
        )}
      </Section>
    </div>
  );
}
