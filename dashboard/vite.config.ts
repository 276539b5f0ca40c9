import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vite';

/** The dashboard's build: served by the service at /dashboard/ (src/dashboard.ts), so no inline script and no data: URLs. */
export default defineConfig({
  root: fileURLToPath(new URL('.', import.meta.url)),
  base: '/dashboard/',
  logLevel: 'warn',
  oxc: { jsx: { runtime: 'automatic', importSource: 'preact' } },
  build: {
    outDir: 'dist',
    emptyOutDir: true,
    target: 'es2022',
    assetsInlineLimit: 0,
    // the polyfill would be an inline script, which the page's policy refuses
    modulePreload: { polyfill: false },
  },
});
