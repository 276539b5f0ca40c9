import { isAdmin, seesEverything, type Principal } from '../auth/principal.js';
import { builder } from './builder.js';

/** Who the caller is to this service, and what it may do: an app shows only the actions it may take. */
const ViewerRef = builder.objectRef<Principal>('Viewer').implement({
  description: 'The signed-in caller as the service sees it. The server checks every action anyway; this tells an app which to offer.',
  fields: (t) => ({
    subject: t.exposeString('subject', {
      nullable: true,
      description: "Recorded as `submittedBy` on what it submits: a JWT's `sub`, `apikey:<name>` for an API key; null when anonymous and unnamed.",
    }),
    roles: t.stringList({ resolve: (principal) => [...principal.roles] }),
    via: t.string({
      description: '`jwt`, `apiKey`, or `anonymous` (authentication is off: development mode).',
      resolve: (principal) => principal.via,
    }),
    isAdmin: t.boolean({
      description: 'Configures queues, registers procedures, manages API keys and schedules (the `admin` role, or authentication off).',
      resolve: (principal) => isAdmin(principal),
    }),
    seesEverything: t.boolean({
      description: "Sees and cancels everyone's work (admins and the `operator` role); otherwise only its own.",
      resolve: (principal) => seesEverything(principal),
    }),
  }),
});

builder.queryFields((t) => ({
  viewer: t.field({
    type: ViewerRef,
    description: 'The caller itself: who it is and what it may do.',
    resolve: (_root, _args, { principal }) => principal,
  }),
}));
