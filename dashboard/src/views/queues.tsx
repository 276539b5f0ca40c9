import { useState } from 'preact/hooks';
import { ApiError, gql } from '../api';
import { ErrorNote, Grid, Section } from '../components';
import { capabilities, useLiveQuery } from '../live';
import { useStore } from '../store';

export interface Queue {
  name: string;
  concurrency: number;
  waiting: number;
  pending: number;
  running: number;
  recentSeconds: number;
  recent: { succeeded: number; failed: number; cancelled: number };
}

export const QUEUES = `{ queues { name concurrency waiting pending running recentSeconds recent { succeeded failed cancelled } } }`;

/** The queues with their live counts; `edit` adds the admin's concurrency field. */
export function QueueCounts({ queues, edit, onSaved }: { queues: Queue[]; edit?: boolean; onSaved?: () => void }) {
  if (!queues.length) return <p class="muted">No queues.</p>;
  return (
    <div class="scroll">
      <Grid class="queues" head={['queue', ['concurrency', 'num'], ['waiting', 'num'], ['pending', 'num'], ['running', 'num'], [`ended (last ${Math.round((queues[0]?.recentSeconds ?? 3600) / 60)} min)`, 'num']]}>
        <tbody>
          {queues.map((q) => (
            <tr key={q.name} data-queue={q.name}>
              <th>{q.name}</th>
              <td class="num">{edit ? <Concurrency queue={q} onSaved={onSaved} /> : q.concurrency}</td>
              <td class="num" data-count="waiting">{q.waiting}</td>
              <td class="num" data-count="pending">{q.pending}</td>
              <td class="num" data-count="running">
                {q.running}
                <span class="meter" aria-hidden="true">
                  <span class="meter-fill" style={{ width: `${Math.min(100, (100 * q.running) / Math.max(1, q.concurrency))}%` }} />
                </span>
              </td>
              <td class="num">
                <span class="ok-text">{q.recent.succeeded} ok</span>
                {q.recent.failed ? <span class="bad-text"> · {q.recent.failed} failed</span> : null}
                {q.recent.cancelled ? <span class="muted"> · {q.recent.cancelled} cancelled</span> : null}
              </td>
            </tr>
          ))}
        </tbody>
      </Grid>
    </div>
  );
}

const CONFIGURE = 'mutation Configure($input: ConfigureQueueInput!) { configureQueue(input: $input) { queue { name concurrency } } }';

function Concurrency({ queue, onSaved }: { queue: Queue; onSaved?: () => void }) {
  const [value, setValue] = useState(String(queue.concurrency));
  const [error, setError] = useState<ApiError | null>(null);
  const save = (event: Event) => {
    event.preventDefault();
    gql(CONFIGURE, { input: { name: queue.name, concurrency: Number(value) } }).then(() => (setError(null), onSaved?.()), setError);
  };
  return (
    <form class="inline" onSubmit={save}>
      <input type="number" min={1} max={1000} required value={value} aria-label={`concurrency of ${queue.name}`} onInput={(e) => setValue(e.currentTarget.value)} />
      <button type="submit" disabled={value === String(queue.concurrency)}>
        Save
      </button>
      {error ? <span class="error-text">{error.message}</span> : null}
    </form>
  );
}

export function Queues() {
  const caps = useStore(capabilities);
  const queues = useLiveQuery<{ queues: Queue[] }>(QUEUES, undefined, () => true, 500);
  const [name, setName] = useState('');
  const [concurrency, setConcurrency] = useState('4');
  const [error, setError] = useState<ApiError | null>(null);
  const create = (event: Event) => {
    event.preventDefault();
    gql(CONFIGURE, { input: { name, concurrency: Number(concurrency) } }).then(() => (setName(''), setError(null), queues.reload()), setError);
  };
  return (
    <div class="stack">
      <Section title="Queues">
        <ErrorNote error={queues.error} />
        {queues.data ? <QueueCounts queues={queues.data.queues} edit={caps?.admin} onSaved={queues.reload} /> : <p class="muted">Loading…</p>}
        {caps?.admin ? null : <p class="muted">Only admins change a queue's concurrency.</p>}
      </Section>
      {caps?.admin ? (
        <Section title="New queue">
          <form class="inline" onSubmit={create}>
            <input placeholder="name" required pattern="[A-Za-z0-9_.:\-]{1,128}" value={name} onInput={(e) => setName(e.currentTarget.value)} aria-label="queue name" />
            <input type="number" min={1} max={1000} required value={concurrency} onInput={(e) => setConcurrency(e.currentTarget.value)} aria-label="concurrency" />
            <button type="submit">Create</button>
          </form>
          <ErrorNote error={error} />
        </Section>
      ) : null}
    </div>
  );
}
