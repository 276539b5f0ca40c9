/**
 * The dashboard: the Vite build in `dashboard/dist` (`npm run build:dashboard`; `npm install` runs it),
 * served at {@link DASHBOARD_PATH} on the service's own port, `/` redirecting there. Hashed assets are
 * cached for good; the page is revalidated on every load and carries a Content-Security-Policy that
 * allows scripts, styles and connections (HTTP and WebSocket) to this service only.
 */
import { readdir, readFile } from 'node:fs/promises';
import { extname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { gzipSync } from 'node:zlib';
import type { Plugin } from 'graphql-yoga';
import type { Logger } from './logger.js';

export const DASHBOARD_PATH = '/dashboard/';

/** Where the build lands, from src/ (tsx) and from dist/ (the compiled service) alike. */
export const DASHBOARD_DIST = fileURLToPath(new URL('../dashboard/dist/', import.meta.url));

const TYPES: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.svg': 'image/svg+xml',
  '.png': 'image/png',
  '.ico': 'image/x-icon',
  '.json': 'application/json',
  '.woff2': 'font/woff2',
};

interface File {
  type: string;
  body: Uint8Array<ArrayBuffer>;
  /** Text files, compressed once at load. */
  gzipped: Uint8Array<ArrayBuffer> | null;
  /** Content-hashed by the build (under assets/): never changes under its name. */
  immutable: boolean;
}

/** Every file of the build by its path below {@link DASHBOARD_PATH}; null when the dashboard was not built. */
async function loadBuild(dir: string): Promise<Map<string, File> | null> {
  let names: string[];
  try {
    names = (await readdir(dir, { recursive: true, withFileTypes: true })).filter((e) => e.isFile()).map((e) => join(e.parentPath, e.name).slice(dir.length));
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw error;
  }
  if (!names.includes('index.html')) return null;
  const files = new Map<string, File>();
  for (const name of names) {
    const path = name.split(/[\\/]/).join('/');
    const type = TYPES[extname(path)] ?? 'application/octet-stream';
    const body = new Uint8Array(await readFile(join(dir, name)));
    const gzipped = /^text\/|svg|json/.test(type) && body.length > 1024 ? new Uint8Array(gzipSync(body)) : null;
    files.set(path, { type, body, gzipped, immutable: path.startsWith('assets/') });
  }
  return files;
}

/** Only a plain host[:port] goes into the policy; anything else falls back to 'self' alone. */
const HOST = /^[A-Za-z0-9.-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$/;

/** The page's policy: nothing inline, nothing from elsewhere; graphql-ws to this host. */
export function contentSecurityPolicy(host: string | null): string {
  const sockets = host && HOST.test(host) ? ` ws://${host} wss://${host}` : '';
  return [
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "font-src 'self'",
    `connect-src 'self'${sockets}`,
    "manifest-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
  ].join('; ');
}

const NOT_BUILT = `<!doctype html><meta charset="utf-8"><title>asyncproc dashboard</title>
<p>The dashboard has not been built. Run <code>npm run build:dashboard</code> (or <code>npm install</code>) and restart the service.</p>`;

/** Serves the dashboard (and redirects `/` to it); `dir` defaults to the build folder. */
export function useDashboard(logger: Logger, dir = DASHBOARD_DIST): Plugin {
  let build: Promise<Map<string, File> | null> | undefined;
  const files = () =>
    (build ??= loadBuild(dir).then((loaded) => {
      if (!loaded) logger.warn({ dir }, 'the dashboard is not built: run npm run build:dashboard');
      return loaded;
    }));
  return {
    onRequest({ request, url, endResponse, fetchAPI }) {
      const { pathname } = url;
      if (pathname === '/' || pathname === '/dashboard') {
        endResponse(new fetchAPI.Response(null, { status: 302, headers: { location: DASHBOARD_PATH } }));
        return;
      }
      if (!pathname.startsWith(DASHBOARD_PATH)) return;
      return files().then((loaded) => endResponse(respond(request, pathname.slice(DASHBOARD_PATH.length), loaded, fetchAPI.Response)));
    },
  };
}

function respond(request: Request, path: string, files: Map<string, File> | null, Response: typeof globalThis.Response): Response {
  if (request.method !== 'GET' && request.method !== 'HEAD') return new Response('method not allowed', { status: 405, headers: { allow: 'GET, HEAD' } });
  const page = { 'content-security-policy': contentSecurityPolicy(request.headers.get('host')), 'x-content-type-options': 'nosniff', 'referrer-policy': 'no-referrer' };
  if (!files) return new Response(NOT_BUILT, { status: 503, headers: { 'content-type': TYPES['.html']!, 'cache-control': 'no-store', ...page } });
  // the app routes by hash, so only the folder itself (and index.html) is the page
  const file = files.get(path === '' ? 'index.html' : path);
  if (!file) return new Response('not found', { status: 404, headers: { 'content-type': 'text/plain; charset=utf-8', 'x-content-type-options': 'nosniff' } });
  const gzip = file.gzipped && /\bgzip\b/.test(request.headers.get('accept-encoding') ?? '');
  const body = gzip ? file.gzipped! : file.body;
  const headers: Record<string, string> = {
    'content-type': file.type,
    'content-length': String(body.length),
    'cache-control': file.immutable ? 'public, max-age=31536000, immutable' : 'no-cache',
    ...(file.gzipped ? { vary: 'accept-encoding' } : {}),
    ...(gzip ? { 'content-encoding': 'gzip' } : {}),
    ...page,
  };
  return new Response(request.method === 'HEAD' ? null : body, { headers });
}
