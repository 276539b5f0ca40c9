/**
 * GraphiQL with no internet. Yoga's built-in page loads GraphiQL from a CDN; this one serves
 * the same build (`@graphql-yoga/render-graphiql`, which carries every asset as a string)
 * from the service itself: a small HTML page at the GraphQL endpoint and content-hashed,
 * immutable, gzip-able files under {@link GRAPHIQL_ASSETS_PATH}. Subscriptions keep using
 * whatever `subscriptionsProtocol` the page is given (graphql-ws on the same path here).
 */
import { createHash } from 'node:crypto';
import { promisify } from 'node:util';
import { gzip } from 'node:zlib';
import type { GraphiQLOptions, Plugin } from 'graphql-yoga';

export const GRAPHIQL_ASSETS_PATH = '/graphiql/assets/';

interface Asset {
  file: string;
  type: string;
  body: Uint8Array<ArrayBuffer>;
  gzipped?: Promise<Uint8Array<ArrayBuffer>>;
}

interface Assets {
  byFile: Map<string, Asset>;
  /** Each asset's URL path by role. */
  url: { js: string; css: string; favicon: string; editorWorkerService: string; json: string; graphql: string };
}

const gzipAsync = promisify(gzip);
let loaded: Promise<Assets> | undefined;

/** Loaded on first use: the bundle is 9 MB of strings that a service with GraphiQL off never needs. */
function loadAssets(): Promise<Assets> {
  return (loaded ??= import('@graphql-yoga/render-graphiql/graphiql').then((bundle) => {
    const byFile = new Map<string, Asset>();
    const add = (name: string, ext: string, type: string, body: Uint8Array<ArrayBuffer>) => {
      const file = `${name}-${createHash('sha256').update(body).digest('hex').slice(0, 16)}.${ext}`;
      byFile.set(file, { file, type, body });
      return GRAPHIQL_ASSETS_PATH + file;
    };
    const js = 'text/javascript; charset=utf-8';
    const favicon = /^data:image\/x-icon;base64,(.*)$/s.exec(bundle.favicon);
    return {
      byFile,
      url: {
        js: add('graphiql', 'js', js, Buffer.from(bundle.js)),
        css: add('graphiql', 'css', 'text/css; charset=utf-8', Buffer.from(bundle.css)),
        // the bundle's favicon is a data: URL; served as a file it stays out of every page load
        favicon: favicon ? add('favicon', 'ico', 'image/x-icon', Buffer.from(favicon[1]!, 'base64')) : bundle.favicon,
        editorWorkerService: add('editor.worker', 'js', js, Buffer.from(bundle.editorWorkerService)),
        json: add('json.worker', 'js', js, Buffer.from(bundle.jsonWorker)),
        graphql: add('graphql.worker', 'js', js, Buffer.from(bundle.graphqlWorker)),
      },
    };
  }));
}

const escapeHtml = (text: string) =>
  text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
/** JSON that cannot close the <script> element it sits in. */
const scriptJson = (value: unknown) => JSON.stringify(value).replace(/</g, '\\u003c');

/** The page for yoga's `renderGraphiQL` option: what render-graphiql renders, with files instead of inlined strings. */
export async function renderGraphiQL(options: GraphiQLOptions = {}): Promise<string> {
  const { url } = await loadAssets();
  const workers = { editorWorkerService: url.editorWorkerService, json: url.json, graphql: url.graphql };
  return `<!doctype html>
<html lang="en">
  <head>
    <meta charset="utf-8" />
    <title>${escapeHtml(options.title || 'Yoga GraphiQL')}</title>
    <link rel="icon" href="${escapeHtml(options.favicon || url.favicon)}" />
    <link rel="stylesheet" href="${url.css}" />
  </head>
  <body id="body" class="no-focus-outline">
    <noscript>You need to enable JavaScript to run this app.</noscript>
    <div id="root"></div>
    <script>
      const workers = ${scriptJson(workers)};
      self.MonacoEnvironment = { globalAPI: false, getWorkerUrl: (moduleId, label) => workers[label] };
    </script>
    <script src="${url.js}"></script>
    <script>
      YogaGraphiQL.renderYogaGraphiQL(document.querySelector('#root'), ${scriptJson(options)});
    </script>
  </body>
</html>
`;
}

/**
 * Serves GraphiQL's files under {@link GRAPHIQL_ASSETS_PATH}. Names carry a content hash,
 * so a browser keeps them for a year and a new package version gets new names.
 * @param enabled false (GraphiQL off) serves nothing
 */
export function useGraphiQLAssets(enabled = true): Plugin {
  if (!enabled) return {};
  return {
    onRequest({ request, url, endResponse, fetchAPI }) {
      if (!url.pathname.startsWith(GRAPHIQL_ASSETS_PATH)) return;
      return assetResponse(request, url.pathname.slice(GRAPHIQL_ASSETS_PATH.length), fetchAPI.Response).then(endResponse);
    },
    // the page itself: no other site may frame it (a click-jacked GraphiQL runs the mutations
    // typed into it, with the headers typed in), its type is not sniffed, and no address of it
    // leaves as a referrer. Its scripts are left to the page (GraphiQL's editor builds styles
    // and workers at run time), unlike the dashboard's whole policy.
    onResponse({ response }) {
      // (a page with a policy of its own, the dashboard's, keeps it)
      if (!/^text\/html\b/.test(response.headers.get('content-type') ?? '') || response.headers.has('content-security-policy')) return;
      response.headers.set('content-security-policy', "frame-ancestors 'none'; base-uri 'none'; form-action 'none'");
      response.headers.set('x-frame-options', 'DENY');
      response.headers.set('x-content-type-options', 'nosniff');
      response.headers.set('referrer-policy', 'no-referrer');
      response.headers.set('cache-control', 'no-store');
    },
  };
}

async function assetResponse(request: Request, file: string, Response: typeof globalThis.Response): Promise<Response> {
  const asset = (await loadAssets()).byFile.get(file);
  if (!asset) return new Response('not found', { status: 404 });
  if (request.method !== 'GET' && request.method !== 'HEAD') return new Response('method not allowed', { status: 405 });
  const headers: Record<string, string> = {
    'content-type': asset.type,
    'cache-control': 'public, max-age=31536000, immutable',
    vary: 'accept-encoding',
    'x-content-type-options': 'nosniff',
  };
  let body = asset.body;
  if (asset.type !== 'image/x-icon' && /\bgzip\b/.test(request.headers.get('accept-encoding') ?? '')) {
    body = await (asset.gzipped ??= gzipAsync(asset.body).then((gzipped) => new Uint8Array(gzipped)));
    headers['content-encoding'] = 'gzip';
  }
  headers['content-length'] = String(body.length);
  return new Response(request.method === 'HEAD' ? null : body, { headers });
}
