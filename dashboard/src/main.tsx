import { render } from 'preact';
import { useEffect, useState } from 'preact/hooks';
import { ApiError, connected, credential, signedOut, signIn, signOut } from './api';
import { ErrorNote } from './components';
import { capabilities, feedError, listen, probeCapabilities, startFeed, stopLiveFeed } from './live';
import { countEvent } from './outcomes';
import { useRoute } from './router';
import { useStore } from './store';
import './style.css';
import { BatchPage, Batches } from './views/batches';
import { ExecutionPage } from './views/execution';
import { Executions } from './views/executions';
import { Overview } from './views/overview';
import { ProcedurePage, Procedures } from './views/procedures';
import { Queues } from './views/queues';
import { Running } from './views/running';
import { Schedules } from './views/schedules';

const NAV = [
  ['overview', 'Overview'],
  ['running', 'Running'],
  ['executions', 'Executions'],
  ['batches', 'Batches'],
  ['procedures', 'Procedures'],
  ['queues', 'Queues'],
  ['schedules', 'Schedules'],
] as const;

listen(countEvent);

type Phase = { state: 'checking' } | { state: 'signin' } | { state: 'ready' } | { state: 'unreachable'; message: string };

function App() {
  const authorization = useStore(credential);
  const reason = useStore(signedOut);
  const [phase, setPhase] = useState<Phase>({ state: 'checking' });
  const [attempt, setAttempt] = useState(0);
  useEffect(() => {
    if (reason !== null) {
      stopLiveFeed();
      capabilities.set(null);
      setPhase({ state: 'signin' });
      return;
    }
    let stale = false;
    setPhase({ state: 'checking' });
    // the development mode needs no credentials: a first read tells whether this service asks for them
    probeCapabilities()
      .then(() => startFeed())
      .then(
        () => !stale && setPhase({ state: 'ready' }),
        (error: ApiError) => {
          if (stale || error.code === 'UNAUTHENTICATED') return;
          // down or restarting is not a reason to sign in again
          if (error.code === 'NETWORK' || error.code === 'HTTP') setPhase({ state: 'unreachable', message: error.message });
          else signOut(`The service refused: ${error.message}`);
        },
      );
    return () => {
      stale = true;
    };
  }, [authorization, reason, attempt]);
  if (phase.state === 'signin') return <SignIn reason={reason} />;
  if (phase.state === 'unreachable') {
    return (
      <main class="signin">
        <h1>asyncproc</h1>
        <ErrorNote error={phase.message} />
        <button type="button" class="primary" onClick={() => setAttempt(attempt + 1)}>
          Try again
        </button>
      </main>
    );
  }
  if (phase.state === 'checking') return <p class="boot muted">Connecting…</p>;
  return <Shell />;
}

function SignIn({ reason }: { reason: string | null }) {
  const [typed, setTyped] = useState('');
  return (
    <main class="signin">
      <h1>asyncproc</h1>
      <form
        class="card"
        onSubmit={(e) => {
          e.preventDefault();
          signIn(typed);
        }}
      >
        <label>
          <span class="label">JWT or API key</span>
          <input type="password" name="credential" autocomplete="off" required value={typed} onInput={(e) => setTyped(e.currentTarget.value)} />
        </label>
        <p class="muted small">Sent as the Authorization header and in the WebSocket's connection parameters; kept for this tab only.</p>
        <button type="submit" class="primary">
          Sign in
        </button>
        {reason && reason !== 'signed out' ? <ErrorNote error={reason} /> : null}
      </form>
    </main>
  );
}

function Shell() {
  const route = useRoute();
  const live = useStore(connected);
  const feedProblem = useStore(feedError);
  const authorization = useStore(credential);
  const caps = useStore(capabilities);
  const [view, id] = route;
  const current = view ?? 'overview';
  const section = current === 'execution' ? 'executions' : current === 'batch' ? 'batches' : current === 'procedure' ? 'procedures' : current;
  return (
    <>
      <header class="top">
        <a class="brand" href="#/overview">
          asyncproc
        </a>
        <nav>
          {NAV.map(([key, label]) => (
            <a key={key} href={`#/${key}`} aria-current={section === key ? 'page' : undefined}>
              {label}
            </a>
          ))}
        </nav>
        <div class="who">
          <span class={`dot ${live ? 'live' : 'down'}`} title={live ? 'live: following changes' : 'reconnecting…'} data-live={live} />
          <span class="small" title={caps?.subject ?? undefined}>
            {authorization ? `${caps?.subject ?? ''} · ${caps?.admin ? 'admin' : caps?.operator ? 'operator' : 'caller'}` : 'development (no sign-in)'}
          </span>
          {authorization ? (
            <button type="button" class="link" onClick={() => signOut('signed out')}>
              Sign out
            </button>
          ) : null}
        </div>
      </header>
      {feedProblem ? <p class="note error banner">Live updates interrupted: {feedProblem}</p> : null}
      <main class="page">{page(current, id)}</main>
    </>
  );
}

function page(view: string, id: string | undefined) {
  switch (view) {
    case 'running':
      return <Running />;
    case 'executions':
      return <Executions />;
    case 'execution':
      return <ExecutionPage key={id} token={id ?? ''} />;
    case 'batches':
      return <Batches />;
    case 'batch':
      return <BatchPage key={id} id={id ?? ''} />;
    case 'procedures':
      return <Procedures />;
    case 'procedure':
      return <ProcedurePage key={id} name={id ?? ''} />;
    case 'queues':
      return <Queues />;
    case 'schedules':
      return <Schedules />;
    default:
      return <Overview />;
  }
}

render(<App />, document.getElementById('app')!);
