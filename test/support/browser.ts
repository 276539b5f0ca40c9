import { access } from 'node:fs/promises';
import { chromium, type Browser } from 'playwright-core';

export const CHROMIUM = '/usr/bin/chromium';

/**
 * Debian's headless Chromium. Missing Chromium fails the test (CI installs it, .ci/run).
 * Playwright gives each launch a fresh temporary profile; the flags keep Chromium from
 * calling home, which on a closed network stalls it.
 */
export async function launchChromium(): Promise<Browser> {
  try {
    await access(CHROMIUM);
  } catch (error) {
    throw new Error(`no Chromium at ${CHROMIUM}: apt-get install chromium (as .ci/run does)`, { cause: error });
  }
  return chromium.launch({
    executablePath: CHROMIUM,
    timeout: 60_000,
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      '--no-first-run',
    ],
  });
}
