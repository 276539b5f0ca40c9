import { createApiKey, DEFAULT_ROTATION_OVERLAP_SECONDS, rotateApiKey } from '../auth/apiKeys.js';
import { apiKeyActive, MAX_ROTATION_OVERLAP_SECONDS, type ApiKey } from '../engine.js';
import { builder } from './builder.js';
import { checkToken, guard, requireAdmin } from './errors.js';

const ApiKeyRef = builder.objectRef<ApiKey>('ApiKey').implement({
  description: 'A key a backend service sends as `Authorization: ApiKey <secret>`. Only a hash of the secret is stored.',
  fields: (t) => ({
    id: t.exposeID('id'),
    name: t.exposeString('name'),
    roles: t.exposeStringList('roles'),
    prefix: t.exposeString('prefix', { description: 'The first characters of the secret, to tell keys apart.' }),
    subject: t.string({ description: 'Who its calls are recorded as (`submittedBy`).', resolve: (k) => `apikey:${k.name}` }),
    createdAt: t.expose('createdAt', { type: 'DateTime' }),
    createdBy: t.exposeString('createdBy', { nullable: true }),
    lastUsedAt: t.expose('lastUsedAt', { type: 'DateTime', nullable: true, description: 'Updated at most once a minute.' }),
    revokedAt: t.expose('revokedAt', {
      type: 'DateTime',
      nullable: true,
      description: "When it stopped working. A rotated key's lies ahead until its overlap with its successor ends.",
    }),
    active: t.boolean({
      description: 'Whether it works now: not revoked, or rotated and still within its overlap.',
      resolve: (k) => apiKeyActive(k),
    }),
  }),
});

const CreateApiKeyInput = builder.inputType('CreateApiKeyInput', {
  fields: (t) => ({
    name: t.string({ required: true, description: '1–128 characters, unique among keys not revoked.' }),
    roles: t.stringList({ required: false, description: 'e.g. ["operator"]; none: a plain caller.' }),
  }),
});

const CreateApiKeyPayload = builder.objectRef<{ key: ApiKey; secret: string }>('CreateApiKeyPayload').implement({
  fields: (t) => ({
    apiKey: t.field({ type: ApiKeyRef, resolve: (p) => p.key }),
    secret: t.exposeString('secret', { description: 'Shown this once: it cannot be read again.' }),
  }),
});

const RotateApiKeyInput = builder.inputType('RotateApiKeyInput', {
  fields: (t) => ({
    id: t.id({ required: true, description: 'The key to rotate: live, and not rotated already.' }),
    overlapSeconds: t.int({
      required: false,
      description: `How long the old key goes on working beside the new one, 0–${MAX_ROTATION_OVERLAP_SECONDS} (30 days); 0 stops it at once. Default ${DEFAULT_ROTATION_OVERLAP_SECONDS} (one hour).`,
    }),
  }),
});

const RotateApiKeyPayload = builder.objectRef<{ key: ApiKey; previous: ApiKey; secret: string }>('RotateApiKeyPayload').implement({
  fields: (t) => ({
    apiKey: t.field({ type: ApiKeyRef, description: 'The new key: the same name and roles, so the same caller.', resolve: (p) => p.key }),
    secret: t.exposeString('secret', { description: "The new key's secret, shown this once." }),
    previous: t.field({ type: ApiKeyRef, description: 'The old key: its revokedAt says when it stops.', resolve: (p) => p.previous }),
  }),
});

const RevokeApiKeyPayload = builder.objectRef<{ key: ApiKey }>('RevokeApiKeyPayload').implement({
  fields: (t) => ({ apiKey: t.field({ type: ApiKeyRef, resolve: (p) => p.key }) }),
});

builder.queryFields((t) => ({
  apiKeys: t.field({
    type: [ApiKeyRef],
    description: 'Every API key, revoked ones too, newest first. Admins only.',
    resolve: (_root, _args, { engine, principal }) =>
      guard(async () => {
        requireAdmin(principal, 'apiKeys');
        return engine.listApiKeys();
      }),
  }),
}));

builder.mutationFields((t) => ({
  createApiKey: t.field({
    type: CreateApiKeyPayload,
    description: 'Create an API key; its secret is in the answer, once. Admins only.',
    args: { input: t.arg({ type: CreateApiKeyInput, required: true }) },
    resolve: (_root, { input }, { engine, principal }) =>
      guard(async () => {
        requireAdmin(principal, 'createApiKey');
        return createApiKey(engine, { name: input.name, roles: input.roles ?? [], createdBy: principal.subject });
      }),
  }),
  rotateApiKey: t.field({
    type: RotateApiKeyPayload,
    description:
      'Give a key a new secret without a gap: a successor with its name and roles (the same caller, `apikey:<name>`), whose secret is in the answer, once; the old key goes on working for `overlapSeconds`, then stops. Admins only.',
    args: { input: t.arg({ type: RotateApiKeyInput, required: true }) },
    resolve: (_root, { input }, { engine, principal, credentialsChanged }) =>
      guard(async () => {
        requireAdmin(principal, 'rotateApiKey');
        const rotated = await rotateApiKey(engine, { id: checkToken(String(input.id), 'API key id'), overlapSeconds: input.overlapSeconds, createdBy: principal.subject });
        // an overlap of 0 stops the old key now: what was looked up of it is forgotten, as on a revoke
        credentialsChanged?.();
        return rotated;
      }),
  }),
  revokeApiKey: t.field({
    type: RevokeApiKeyPayload,
    description: 'Revoke an API key: it stops working at once. Admins only.',
    args: { id: t.arg.id({ required: true }) },
    resolve: (_root, { id }, { engine, principal, credentialsChanged }) =>
      guard(async () => {
        requireAdmin(principal, 'revokeApiKey');
        const key = await engine.revokeApiKey(checkToken(String(id), 'API key id'));
        credentialsChanged?.();
        return { key };
      }),
  }),
}));
