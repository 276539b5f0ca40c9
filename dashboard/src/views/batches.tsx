import { useEffect, useState } from 'preact/hooks';
import { gql, subscribe } from '../api';
import { ConfirmAction, Fact, ErrorNote, Grid, Section, StageBar, StatusBadge, Time, type StageCounts } from '../components';
import { useLiveQuery } from '../live';
import { navigate } from '../router';
import { ExecutionTable, type ExecutionRow } from './executions';

interface BatchSummary {
  /** The global (Relay) id; `batchId` is the batch's own UUID, shown and used in links. */
  id: string;
  batchId: string;
  status: string;
  total: number;
  succeeded: number;
  failed: number;
  cancelled: number;
  stageCount: number;
  currentStage: number;
  submittedAt: string;
  finishedAt: string | null;
  submittedBy: string | null;
}

const SUMMARY = 'id batchId status total succeeded failed cancelled stageCount currentStage submittedAt finishedAt submittedBy';

// the API lists executions, not batches: the batches are those of the newest executions
const RECENT = `{ executions(first: 200) { nodes { batch { ${SUMMARY} } } } }`;

export function Batches() {
  const recent = useLiveQuery<{ executions: { nodes: { batch: BatchSummary | null }[] } }>(RECENT, undefined, (event) => event.execution.batch !== null, 500);
  const [id, setId] = useState('');
  const batches = [...new Map((recent.data?.executions.nodes ?? []).flatMap((n) => (n.batch ? [[n.batch.id, n.batch] as const] : []))).values()];
  return (
    <div class="stack">
      <Section title="Open a batch">
        <form class="filters" onSubmit={(e) => (e.preventDefault(), navigate(`/batch/${encodeURIComponent(id.trim())}`))}>
          <label>
            batch id
            <input value={id} placeholder="uuid" onInput={(e) => setId(e.currentTarget.value)} />
          </label>
          <button type="submit" disabled={!id.trim()}>
            Open
          </button>
        </form>
      </Section>
      <Section title="Recent batches">
        <ErrorNote error={recent.error} />
        {batches.length ? (
          <div class="scroll">
            <Grid head={['batch', 'status', 'stage', 'progress', 'submitted', 'by']}>
              <tbody>
                {batches.map((b) => (
                  <tr key={b.id} class={b.status === 'FAILED' ? 'failed' : undefined}>
                    <td>
                      <a href={`#/batch/${b.batchId}`} class="token">
                        {b.batchId.slice(0, 8)}
                      </a>
                    </td>
                    <td>
                      <StatusBadge status={b.status} />
                    </td>
                    <td>
                      {b.currentStage} of {b.stageCount}
                    </td>
                    <td>
                      {b.succeeded + b.failed + b.cancelled}/{b.total} ended
                      {b.failed ? <span class="bad-text"> · {b.failed} failed</span> : null}
                    </td>
                    <td>
                      <Time at={b.submittedAt} />
                    </td>
                    <td>{b.submittedBy ?? <span class="muted">—</span>}</td>
                  </tr>
                ))}
              </tbody>
            </Grid>
          </div>
        ) : (
          <p class="muted">No batches among the newest executions.</p>
        )}
      </Section>
    </div>
  );
}

interface Batch extends BatchSummary {
  onFailure: string;
  stages: Required<StageCounts>[];
  executions: { nodes: (ExecutionRow & { stage: number | null })[] };
}

const ONE = `query Batch($id: ID!) {
  batch(id: $id) {
    ${SUMMARY} onFailure
    stages { stage total succeeded failed cancelled running pending waiting }
    executions(first: 100) { nodes { token procedure queue status submittedAt finishedAt attempts submittedBy stage error { number message } } }
  }
}`;

export function BatchPage({ id }: { id: string }) {
  const one = useLiveQuery<{ batch: Batch | null }>(ONE, { id }, (event) => event.execution.batch?.batchId === id || event.execution.batch?.id === id, 200);
  const batch = one.data?.batch ?? null;
  const running = batch?.status === 'RUNNING';
  useEffect(() => {
    if (!running) return;
    return subscribe({ query: 'subscription Done($id: ID!) { batchCompleted(id: $id) { id } }', variables: { id } }, { next: () => one.reload() });
  }, [id, running]);
  if (one.error && !batch) return <ErrorNote error={one.error} />;
  if (!batch) return one.loading ? <p class="muted">Loading…</p> : <p class="note">No batch {id} — unknown, or not yours to see.</p>;
  return (
    <div class="stack">
      <Section
        title={`Batch ${batch.batchId.slice(0, 8)}`}
        actions={
          running ? (
            <ConfirmAction
              label="Cancel batch"
              question="Cancel every call of this batch not yet ended?"
              confirm="Yes, cancel the batch"
              run={() => gql('mutation CancelBatch($id: ID!) { cancelBatch(id: $id) { batch { id status } } }', { id })}
              onDone={one.reload}
            />
          ) : null
        }
      >
        <div class="facts">
          <Fact label="status"><StatusBadge status={batch.status} /></Fact>
          <Fact label="stage">{batch.currentStage} of {batch.stageCount}</Fact>
          <Fact label="on failure">{batch.onFailure.toLowerCase()}</Fact>
          <Fact label="submitted"><Time at={batch.submittedAt} /> {batch.submittedBy ? `by ${batch.submittedBy}` : ''}</Fact>
          <Fact label="finished"><Time at={batch.finishedAt} /></Fact>
        </div>
        <div class="stages">
          {batch.stages.map((s) => (
            <StageBar key={s.stage} counts={s} label={`stage ${s.stage}`} />
          ))}
        </div>
      </Section>
      {batch.stages.map((s) => (
        <Section key={s.stage} title={`Stage ${s.stage}`}>
          <ExecutionTable rows={batch.executions.nodes.filter((e) => e.stage === s.stage)} />
        </Section>
      ))}
    </div>
  );
}
