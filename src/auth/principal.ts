import { ADMIN_ROLE, OPERATOR_ROLE } from '../engine.js';

/** Who is asking, once the credentials have been verified. */
export interface Principal {
  /**
   * The caller's identity, recorded as `submittedBy`: a JWT's `sub`, `apikey:<name>` for
   * an API key; in anonymous development mode whatever `x-asyncproc-user` says (or null).
   */
  subject: string | null;
  roles: readonly string[];
  via: 'jwt' | 'apiKey' | 'anonymous';
  /** When the credentials stop being valid (a JWT's `exp`); checked again on every new subscription of a socket. */
  expiresAt: Date | null;
  /** An API key's hash (never its secret), to look the key up again while a socket or a stream lives (Authenticator.stillValid). */
  keyHash?: string;
}

/** The principal of anonymous development mode: every power, identity as the caller says. */
export function anonymous(subject: string | null): Principal {
  return { subject, roles: [], via: 'anonymous', expiresAt: null };
}

export function isAdmin(principal: Principal): boolean {
  return principal.via === 'anonymous' || principal.roles.includes(ADMIN_ROLE);
}

/** Admins and operators see and cancel everything; plain callers only their own work. */
export function seesEverything(principal: Principal): boolean {
  return isAdmin(principal) || principal.roles.includes(OPERATOR_ROLE);
}

/** The owner filter of a read: null for who sees everything, else the caller's own subject. */
export function ownerFilter(principal: Principal): string | null {
  // a verified caller always has a subject (authenticate refuses a JWT without `sub`)
  return seesEverything(principal) ? null : (principal.subject ?? '');
}

/** Whether the caller may see (and cancel) work submitted by `submittedBy`. */
export function owns(principal: Principal, submittedBy: string | null): boolean {
  return seesEverything(principal) || (principal.subject !== null && principal.subject === submittedBy);
}

/** The roles an engine checks a call against; null (not checked) in anonymous development mode. */
export function callerRoles(principal: Principal): readonly string[] | null {
  return principal.via === 'anonymous' ? null : principal.roles;
}
