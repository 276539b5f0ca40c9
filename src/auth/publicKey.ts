import { createPublicKey, type KeyObject } from 'node:crypto';

/**
 * ASYNCPROC_JWT_PUBLIC_KEY as a key: a PEM public key or certificate, in which `\n` may stand
 * for line breaks (an environment variable on one line). Throws when it is not one. The
 * configuration checks the value with it, and the JWT verifier reads it with it.
 */
export function publicKeyFromPem(pem: string): KeyObject {
  return createPublicKey(pem.replace(/\\n/g, '\n'));
}
