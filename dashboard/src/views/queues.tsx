import type { ComponentChildren } from 'preact';
import { useState } from 'preact/hooks';
import { ApiError, gql } from '../api';
import { ConfirmAction, ErrorNote, Grid, Section } from '../components';
import { capabilities, useLiveQuery } from '../live';
import { useStore } from '../store';

export interface Queue {
  name: string;
  concurrency: number;
  /** Takes calls but starts none until resumed. */
  paused: boolean;
  groupCommits: GroupCommits;
  waiting: number;
  pending: number;
  running: number;
  recentSeconds: number;
  recent: { succeeded: number; failed: number; cancelled: number };
}

/** Up to `size` short calls of the queue in one transaction, none joining a group older than `maxMs`; size 1: off. */
export interface GroupCommits {
  size: number;
  maxMs: number;
}

export const QUEUES = `{ queues { name concurrency paused groupCommits { size maxMs } waiting pending running recentSeconds recent { succeeded failed cancelled } } }`;

const grouping = ({ size, maxMs }: GroupCommits) => (size === 1 ? 'off' : `${size} calls / ${maxMs} ms`);

/**
 * The queues with their live counts, a paused one marked; `settings` adds each queue's grouped
 * commits, `edit` the admin's fields for the concurrency and the grouping, and Pause / Resume.
 */
export function QueueCounts({ queues, settings, edit, onSaved }: { queues: Queue[]; settings?: boolean; edit?: boolean; onSaved?: () => void }) {
  if (!queues.length) return <p class="muted">No queues.</p>;
  return (
    <div class="scroll">
      <Grid class="queues" head={['queue', ['concurrency', 'num'], ...(settings ? ['grouped commits'] : []), ['waiting', 'num'], ['pending', 'num'], ['running', 'num'], [`ended (last ${Math.round((queues[0]?.recentSeconds ?? 3600) / 60)} min)`, 'num'], ...(edit ? [''] : [])]}>
        <tbody>
          {queues.map((q) => (
            <tr key={q.name} data-queue={q.name} class={q.paused ? 'paused' : undefined}>
              <th>
                {q.name}
                {q.paused ? <span class="tag" title="It takes calls, which wait PENDING; none starts until it is resumed.">paused</span> : null}
              </th>
              <td class="num">{edit ? <Concurrency queue={q} onSaved={onSaved} /> : q.concurrency}</td>
              {settings ? <td data-setting="groupCommits">{edit ? <Grouping queue={q} onSaved={onSaved} /> : grouping(q.groupCommits)}</td> : null}
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
              {edit ? (
                <td>
                  <PauseQueue queue={q} onDone={onSaved} />
                </td>
              ) : null}
            </tr>
          ))}
        </tbody>
      </Grid>
    </div>
  );
}

/** An admin's Pause / Resume of a queue, asked for once more before it is sent (a refusal is shown in place). */
function PauseQueue({ queue, onDone }: { queue: Queue; onDone?: () => void }) {
  const mutation = queue.paused ? 'resumeQueue' : 'pauseQueue';
  return (
    <ConfirmAction
      label={queue.paused ? 'Resume' : 'Pause'}
      question={queue.paused ? `Start the calls of ${queue.name} again?` : `Start no more calls of ${queue.name} until resumed?`}
      confirm={queue.paused ? 'Yes, resume' : 'Yes, pause'}
      run={() => gql(`mutation Switch($name: String!) { ${mutation}(name: $name) { queue { name paused } } }`, { name: queue.name })}
      onDone={onDone}
      safe={queue.paused}
    />
  );
}

/** How often the Queues view reads the queues again, events or not. */
const SETTINGS_REFRESH_MS = 5_000;

const CONFIGURE = 'mutation Configure($input: ConfigureQueueInput!) { configureQueue(input: $input) { queue { name concurrency } } }';

/** An admin's form for one setting of a queue: Save once something changed; the server's refusal is shown in place. */
function SettingForm({ unchanged, send, saveLabel, onSaved, children }: { unchanged: boolean; send: () => Promise<unknown>; saveLabel?: string; onSaved?: () => void; children: ComponentChildren }) {
  const [error, setError] = useState<ApiError | null>(null);
  const save = (event: Event) => {
    event.preventDefault();
    send().then(() => (setError(null), onSaved?.()), setError);
  };
  return (
    <form class="inline setting" onSubmit={save}>
      <span class="fields">
        {children}
        <button type="submit" disabled={unchanged} aria-label={saveLabel}>
          Save
        </button>
      </span>
      {error ? <span class="error-text">{error.message}</span> : null}
    </form>
  );
}

/**
 * A field's text, following the server's value while the admin has not edited it: another admin's
 * change shows here, instead of a stale value that one click of Save would write back.
 */
function useField(server: string): [string, (value: string) => void] {
  const [value, setValue] = useState(server);
  const [shown, setShown] = useState(server);
  if (server !== shown) {
    // the server's value changed: an unedited field takes it (render-time update, no extra frame)
    setShown(server);
    if (value === shown) setValue(server);
  }
  return [value, setValue];
}

function Concurrency({ queue, onSaved }: { queue: Queue; onSaved?: () => void }) {
  const [value, setValue] = useField(String(queue.concurrency));
  return (
    <SettingForm unchanged={value === String(queue.concurrency)} send={() => gql(CONFIGURE, { input: { name: queue.name, concurrency: Number(value) } })} onSaved={onSaved}>
      <input type="number" min={1} max={1000} required value={value} aria-label={`concurrency of ${queue.name}`} onInput={(e) => setValue(e.currentTarget.value)} />
    </SettingForm>
  );
}

/** Sent with the queue's current concurrency. No min or max: the server judges, and says why (its limits; SQL Server refuses any grouping). */
function Grouping({ queue, onSaved }: { queue: Queue; onSaved?: () => void }) {
  const [size, setSize] = useField(String(queue.groupCommits.size));
  const [maxMs, setMaxMs] = useField(String(queue.groupCommits.maxMs));
  const unchanged = size === String(queue.groupCommits.size) && maxMs === String(queue.groupCommits.maxMs);
  const send = () => gql(CONFIGURE, { input: { name: queue.name, concurrency: queue.concurrency, groupCommits: { size: Number(size), maxMs: Number(maxMs) } } });
  return (
    <SettingForm unchanged={unchanged} send={send} saveLabel={`Save grouped commits of ${queue.name}`} onSaved={onSaved}>
      <input type="number" required value={size} aria-label={`grouped calls of ${queue.name}`} onInput={(e) => setSize(e.currentTarget.value)} />
      calls /
      <input type="number" required value={maxMs} aria-label={`group max ms of ${queue.name}`} onInput={(e) => setMaxMs(e.currentTarget.value)} />
      ms
    </SettingForm>
  );
}

export function Queues() {
  const caps = useStore(capabilities);
  // settings change without an event: read every few seconds too, so another admin's change shows
  const queues = useLiveQuery<{ queues: Queue[] }>(QUEUES, undefined, () => true, 500, SETTINGS_REFRESH_MS);
  const [name, setName] = useState('');
  const [concurrency, setConcurrency] = useState('4');
  const [error, setError] = useState<ApiError | null>(null);
  const create = (event: Event) => {
    event.preventDefault();
    // configureQueue also changes a queue that exists: a new queue's form must not do that unseen
    if (queues.data?.queues.some((q) => q.name === name)) {
      setError(new ApiError('BAD_USER_INPUT', `a queue named ${name} exists already: change its concurrency in its row above`));
      return;
    }
    gql(CONFIGURE, { input: { name, concurrency: Number(concurrency) } }).then(() => (setName(''), setError(null), queues.reload()), setError);
  };
  return (
    <div class="stack">
      <Section title="Queues">
        <ErrorNote error={queues.error} />
        {queues.data ? <QueueCounts queues={queues.data.queues} settings edit={caps?.admin} onSaved={queues.reload} /> : <p class="muted">Loading…</p>}
        <p class="muted">Grouped commits: each worker of the queue runs up to that many short calls in one transaction, and none joins a group begun more than that many ms ago; off, each call commits alone. PostgreSQL only.</p>
        <p class="muted">A paused queue takes calls, which wait PENDING; none starts until it is resumed. Calls running when it is paused end as they would.</p>
        {caps?.admin ? null : <p class="muted">Only admins change a queue's concurrency and grouped commits, and pause or resume it.</p>}
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
