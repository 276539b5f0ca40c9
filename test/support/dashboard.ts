import { execFileSync } from 'node:child_process';
import { readdirSync, statSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { DASHBOARD_DIST } from '../../src/dashboard.js';

const root = fileURLToPath(new URL('../..', import.meta.url));

/** `npm install` builds the dashboard (prepare); a checkout that skipped it, or sources changed since, build here. */
export function ensureDashboardBuilt() {
  const modified = (path: string) => statSync(path, { throwIfNoEntry: false })?.mtimeMs ?? -1;
  const built = modified(`${DASHBOARD_DIST}index.html`);
  const sources = ['dashboard/index.html', 'dashboard/vite.config.ts', ...readdirSync(`${root}dashboard/src`, { recursive: true }).map((f) => `dashboard/src/${f}`)];
  if (sources.some((file) => modified(`${root}${file}`) > built)) execFileSync(process.execPath, ['dashboard/prepare.mjs'], { cwd: root, stdio: 'inherit' });
}
