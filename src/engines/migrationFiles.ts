import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';

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

/**
 * The revision of the routine files in `dir` (sql/postgres/routines/, sql/mssql/procedures/): its
 * REVISION file, raised with every change of them (test/migrations.test.ts pins it with their digest).
 */
export async function routinesRevision(dir: string): Promise<number> {
  const revision = Number((await readFile(path.join(dir, 'REVISION'), 'utf8')).trim());
  if (!Number.isInteger(revision) || revision < 1) throw new Error(`${path.join(dir, 'REVISION')} must hold a positive integer`);
  return revision;
}

/**
 * Refuses, before anything is applied, to replace the `what` ("routines", "procedures") a newer
 * release installed (the database's revision, 0016_routines_revision.sql, above this release's).
 */
export function refuseOlderRevision(what: string, installed: number | undefined, revision: number): void {
  if (installed !== undefined && installed > revision) {
    throw new Error(
      `the ${what} of this database are revision ${installed}, installed by a newer asyncproc; this release's are revision ${revision}: ` +
        'run the newer release (a downgrade is not supported: migrations cannot be undone)',
    );
  }
}
