import { gql } from '../api';
import { ConfirmAction, ErrorNote, Grid, Section, Time } from '../components';
import { capabilities, useLiveQuery } from '../live';
import { useStore } from '../store';

interface Schedule {
  name: string;
  procedure: string;
  cron: string;
  timezone: string;
  paused: boolean;
  nextRunAt: string | null;
  lastRunAt: string | null;
  overlap: string;
}

const SCHEDULES = '{ schedules { name procedure cron timezone paused nextRunAt lastRunAt overlap } }';

/** Schedules (admins and operators read them; admins pause and resume). A fire submits a call: its event reads them again. */
export function Schedules() {
  const caps = useStore(capabilities);
  const list = useLiveQuery<{ schedules: Schedule[] }>(caps?.operator ? SCHEDULES : '{ __typename }', undefined, (event) => event.status === 'PENDING' || event.status === 'WAITING', 500);
  if (!caps?.operator) return <p class="note">Schedules are shown to admins and operators only.</p>;
  const schedules = list.data?.schedules ?? [];
  const toggle = (s: Schedule) => gql(`mutation Toggle($name: String!) { ${s.paused ? 'resumeSchedule' : 'pauseSchedule'}(name: $name) { schedule { name paused } } }`, { name: s.name });
  return (
    <Section title="Schedules">
      <ErrorNote error={list.error} />
      {schedules.length ? (
        <div class="scroll">
          <Grid head={['schedule', 'procedure', 'cron', 'next run', 'last run', '']}>
            <tbody>
              {schedules.map((s) => (
                <tr key={s.name} class={s.paused ? 'paused' : undefined}>
                  <th>{s.name}</th>
                  <td>{s.procedure}</td>
                  <td>
                    <code>{s.cron}</code> <span class="muted small">{s.timezone}</span>
                  </td>
                  <td>{s.paused ? <span class="tag">paused</span> : <Time at={s.nextRunAt} />}</td>
                  <td>
                    <Time at={s.lastRunAt} />
                  </td>
                  <td>
                    {caps.admin ? (
                      <ConfirmAction
                        label={s.paused ? 'Resume' : 'Pause'}
                        question={s.paused ? 'Resume firing?' : 'Stop firing until resumed?'}
                        confirm={s.paused ? 'Yes, resume' : 'Yes, pause'}
                        run={() => toggle(s)}
                        onDone={list.reload}
                        safe={s.paused}
                      />
                    ) : null}
                  </td>
                </tr>
              ))}
            </tbody>
          </Grid>
        </div>
      ) : (
        <p class="muted">{list.loading ? 'Loading…' : 'No schedules.'}</p>
      )}
    </Section>
  );
}
