// `npm install` (prepare) builds the dashboard; a production install (`npm ci --omit=dev`) has no Vite and skips it.
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const vite = await import('vite').catch(() => null);
if (!vite) {
  const built = existsSync(fileURLToPath(new URL('./dist/index.html', import.meta.url)));
  console.log(`dashboard: Vite is not installed (a production install); ${built ? 'using the build in dashboard/dist' : 'not built'}`);
} else {
  const started = Date.now();
  await vite.build({ configFile: fileURLToPath(new URL('./vite.config.ts', import.meta.url)) });
  console.log(`dashboard: built into dashboard/dist in ${Date.now() - started} ms`);
}
