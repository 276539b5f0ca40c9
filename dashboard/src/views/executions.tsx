import { useState } from 'preact/hooks';
import { ApiError, gql } from '../api';
import { ErrorNote, ExecutionLink, Grid, Section, StatusBadge, Time } from '../components';
import { useLiveQuery, type ChangeEvent, type Status } from '../live';
import { navigate } from '../router';

export interface ExecutionRow {
  token: string;
  procedure: string;
  queue: string;
  status: Status;
  submittedAt: string;
  finishedAt: string | null;
  attempts: number;
  submittedBy: string | null;
  error: { number: string | null; message: string } | null;
}

const PAGE = 25;
const STATUSES: Status[] = ['WAITING', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED'];

const LIST = `query List($filter: ExecutionFilter, $first: Int, $after: String) {
  executions(filter: $filter, first: $first, after: $after) {
    totalCount
    pageInfo { hasNextPage endCursor }
    nodes { token procedure queue status submittedAt finishedAt attempts submittedBy error { number message } }
  }
}`;

interface Filter {
  status: Status[];
  procedure: string;
  queue: string;
  submittedBy: string;
}

export function Executions() {
  const [filter, setFilter] = useState<Filter>({ status: [], procedure: '', queue: '', submittedBy: '' });
  /** Cursors of the pages before this one: [] on the first (newest) page. */
  const [pages, setPages] = useState<(string | null)[]>([]);
  const [token, setToken] = useState('');
  const [lookup, setLookup] = useState<ApiError | string | null>(null);
  const after = pages.at(-1) ?? null;
  const variables = {
    first: PAGE,
    after,
    filter: {
      ...(filter.status.length ? { status: filter.status } : {}),
      ...(filter.procedure ? { procedure: filter.procedure } : {}),
      ...(filter.queue ? { queue: filter.queue } : {}),
      ...(filter.submittedBy.trim() ? { submittedBy: filter.submittedBy.trim() } : {}),
    },
  };
  const [missed, setMissed] = useState(0);
  const matches = (event: ChangeEvent) =>
    (!filter.procedure || event.execution.procedure === filter.procedure) &&
    (!filter.queue || event.execution.queue === filter.queue) &&
    (!filter.submittedBy.trim() || event.execution.submittedBy === filter.submittedBy.trim());
  // the newest page follows every change; a later page stays put and says how much changed
  const list = useLiveQuery<{ executions: { totalCount: number; pageInfo: { hasNextPage: boolean; endCursor: string | null }; nodes: ExecutionRow[] } }>(
    LIST,
    variables,
    (event) => {
      if (!matches(event)) return false;
      if (after !== null) setMissed((n) => n + 1);
      return after === null;
    },
    400,
  );
  const options = useLiveQuery<{ procedures: { name: string }[]; queues: { name: string }[] }>('{ procedures { name } queues { name } }', undefined, null);
  const change = (patch: Partial<Filter>) => {
    setFilter({ ...filter, ...patch });
    setPages([]);
    setMissed(0);
  };
  const open = (event: Event) => {
    event.preventDefault();
    const wanted = token.trim();
    gql<{ execution: { token: string } | null }>('query One($token: ID!) { execution(token: $token) { token } }', { token: wanted }).then(
      ({ execution }) => (execution ? navigate(`/execution/${execution.token}`) : setLookup(`no execution ${wanted} (or not yours)`)),
      setLookup,
    );
  };
  const data = list.data?.executions;
  const rows = data?.nodes ?? [];
  return (
    <div class="stack">
      <Section title="Find">
        <form class="filters" onSubmit={open}>
          <label>
            token
            <input value={token} placeholder="uuid" onInput={(e) => setToken(e.currentTarget.value)} />
          </label>
          <button type="submit" disabled={!token.trim()}>
            Open
          </button>
        </form>
        <ErrorNote error={lookup} />
        <div class="filters">
          <fieldset class="statuses">
            <legend>status</legend>
            {STATUSES.map((s) => (
              <label key={s} class="check">
                <input type="checkbox" checked={filter.status.includes(s)} onChange={(e) => change({ status: e.currentTarget.checked ? [...filter.status, s] : filter.status.filter((x) => x !== s) })} />
                {s.toLowerCase()}
              </label>
            ))}
          </fieldset>
          <Choice label="procedure" value={filter.procedure} names={options.data?.procedures} onChange={(procedure) => change({ procedure })} />
          <Choice label="queue" value={filter.queue} names={options.data?.queues} onChange={(queue) => change({ queue })} />
          <label>
            submitted by
            <input value={filter.submittedBy} placeholder="subject, exactly" onInput={(e) => change({ submittedBy: e.currentTarget.value })} />
          </label>
        </div>
      </Section>
      <Section
        title={data ? `Executions (${data.totalCount})` : 'Executions'}
        actions={
          <span class="pager">
            {pages.length ? (
              <button type="button" onClick={() => (setPages([]), setMissed(0))}>
                Newest{missed ? ` (${missed} changes)` : ''}
              </button>
            ) : null}
            {pages.length ? <button type="button" onClick={() => setPages(pages.slice(0, -1))}>← Newer</button> : null}
            <button type="button" disabled={!data?.pageInfo.hasNextPage} onClick={() => data && setPages([...pages, data.pageInfo.endCursor])}>
              Older →
            </button>
          </span>
        }
      >
        <ErrorNote error={list.error} />
        <ExecutionTable rows={rows} />
      </Section>
    </div>
  );
}

/** A filter's drop-down: "any", then the names the service knows. */
function Choice({ label, value, names, onChange }: { label: string; value: string; names: { name: string }[] | undefined; onChange: (value: string) => void }) {
  return (
    <label>
      {label}
      <select value={value} onChange={(e) => onChange(e.currentTarget.value)}>
        <option value="">any</option>
        {names?.map(({ name }) => <option key={name}>{name}</option>)}
      </select>
    </label>
  );
}

export function ExecutionTable({ rows }: { rows: ExecutionRow[] }) {
  if (!rows.length) return <p class="muted">No executions.</p>;
  return (
    <div class="scroll">
      <Grid class="executions" head={['call', 'status', 'procedure', 'queue', 'submitted', 'finished', ['attempts', 'num'], 'by']}>
        <tbody>
          {rows.map((e) => (
            <tr key={e.token} class={e.status === 'FAILED' ? 'failed' : undefined} data-token={e.token}>
              <td>
                <ExecutionLink token={e.token} />
              </td>
              <td>
                <StatusBadge status={e.status} />
                {e.error ? <div class="error-text small">{e.error.message}</div> : null}
              </td>
              <td>{e.procedure}</td>
              <td>{e.queue}</td>
              <td>
                <Time at={e.submittedAt} />
              </td>
              <td>
                <Time at={e.finishedAt} />
              </td>
              <td class="num">{e.attempts}</td>
              <td>{e.submittedBy ?? <span class="muted">—</span>}</td>
            </tr>
          ))}
        </tbody>
      </Grid>
    </div>
  );
}
