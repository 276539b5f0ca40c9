import { readdir } from 'node:fs/promises';

const highest = new Map<string, Promise<number>>();

/** The highest NNNN of the `NNNN_*.sql` migrations in `dir`, read once per folder (the files do not change under a running service). */
export function highestMigration(dir: string): Promise<number> {
  let version = highest.get(dir);
  if (!version) {
    version = readdir(dir).then((files) => Math.max(0, ...files.filter((f) => /^\d{4}_.+\.sql$/.test(f)).map((f) => Number(f.slice(0, 4)))));
    // a failed read is tried again next time
    version.catch(() => highest.delete(dir));
    highest.set(dir, version);
  }
  return version;
}
