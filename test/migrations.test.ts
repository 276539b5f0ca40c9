/**
 * A migration never changes once it has landed: a database that applied it will not apply
 * it again, so a change would reach new installs only. Each landed script is pinned by its
 * SHA-256 here; a change goes into a new, higher-numbered script instead.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readdir, readFile } from 'node:fs/promises';
import { describe, it } from 'node:test';

const LANDED: Record<string, string> = {
  'postgres/0001_core.sql': '51ca8699bb3bdf44f770f7779b631948402bfa9b37ba982a35ffb75523e5be75',
  'postgres/0002_batches.sql': '240ec99eaad158fa82092fb853a85b7947f3cd0d6ca080cb47ec1e88c2e61fd6',
  'postgres/0003_change_feed.sql': '62a78aac757c7ce137b2128d79227a76be959b905cf829ea3bd5619bb8be67fb',
  'postgres/0004_results.sql': '2d12aaa3eabb7c34ef2414bc74891f9f647a433cf7dd80a10bd50e4083bc8f14',
  'postgres/0005_permissions.sql': 'fc5d1b65aa66e7426723ab410465c06b6260195c224463a95d43af44474e25cb',
  'postgres/0006_identity.sql': 'ad79918157bc4e7bb44b870e3406001ea948abca6cf98aa5f4f3a053b1c03b6a',
  'postgres/0007_autocommit.sql': 'a47a0b7da5bbfb905d4f834f9d2642da9dfd03b30a5cc1114e50d15df863c08c',
  'postgres/0009_schedules.sql': '403e337483f3129a1822f260778d2d4c813c79ec4305eccf1eda9a5888057ca9',
  'postgres/0010_progress.sql': 'd2752cecca75f775906e25765b9cfa440878e589949410c20f3532ed01d0cbdd',
  'postgres/0011_stamp_by_writers.sql': '3cda310f144ea0e6cd9ed0d17b2cacbdbd1c069f7832b481c398d086249c798f',
  'postgres/0012_settle_by_writers.sql': '19091b32f5be668bb36994f1e5d0c099e8917f121330b54a105c617de09ac74d',
  'postgres/0013_due_index.sql': '9491618e8ec0effa69937475df710c018ecdb36cb64c41341a0556492a1a9d3b',
  'postgres/0014_grouped_commits.sql': 'b5de653b58771408b1fda27e6e072a5e73dead526e0522984101236b9d8d69ba',
  'postgres/0015_purge_horizon.sql': 'd7c7708b38648c4374208651e41d003a5e2ce134099c1a0c34683a8683f4add6',
  'postgres/0016_routines_revision.sql': '51a5c7e761996b9a33fefac301361bc232676900b4a4c001aab70dd4fe1adcfb',
  'postgres/0017_json_arguments_as_sent.sql': '70edda184b2bd0ec306f531e7a8edc7e3639944e12994777ce8be5c93afe5289',
  'postgres/0018_idempotency_keys.sql': '611dd1618436309aaf3adae0ee2ec9f61b269bbae7efb51783912f275ec493fa',
  'mssql/0001_tables.sql': '172e7b6b08d0b476ca8e1b3b8c8f0f5f67252734267328edb8df9f077b24b5f4',
  'mssql/0002_broker.sql': '93787f26ccf577695d6eded861c5acfbaa069ba7fd473679a398385d9cb2b1ef',
  'mssql/0003_catalog.sql': '7d6a089bd3e2df2a09e43a8fd6f4b8aa44409772afdb38e9e0ec0bb41bc3c093',
  'mssql/0004_invoke.sql': '6dab4b8e2230ca1991870b0ca95f1e6b2512861e511e71055fee1926f5896474',
  'mssql/0005_activated.sql': 'ef641cc09f19ee2f6c6ba5e08e36f66f7471543e17125ea8aac7e3892689e3e6',
  'mssql/0006_views.sql': 'b477d106454f5484b197cdb4c22ab94a30004a3ae1efdc09d8fca0abd9dc57c7',
  'mssql/0007_batches.sql': '480cb26f6bb071cdad547945c2c2692d4e841ef7f1a66f3c80a7bc3833dacdc2',
  'mssql/0008_cancel_batch.sql': 'a7162cbe4b4ffaaa3f3de2b371e488d9b6b9e7ad206bed933b368a7cf8fe158f',
  'mssql/0009_identity.sql': '46d6dc3ee21e269b34f104a8aa24d3c02f1af6923c532927c922bab54e4b02d0',
  'mssql/0010_routines.sql': 'c4219a1dbfe29126ef63655f175e1021175de9358a239ea3239e0f9736a948b4',
  'mssql/0011_run.sql': '5d15b1c8fb834abef9d58eea06cf2106b0dfd6142a4b392ade56d8a07610b3a9',
  'mssql/0012_listeners.sql': 'f5ec109efcfe2fefb3ec7f2b15835f60e969c7d22087fa3ed51ba6280e9a22e9',
  'mssql/0013_schedules.sql': '4ec042a9d1092caf41fdfabe68280751f3069d6c317970e060ab14fa86a8bc63',
  'mssql/0014_progress.sql': '0ebc5c9559386559d28840b8699e255d1dc7b0303614c713587386a6dc3260b0',
  'mssql/0015_purge_horizon.sql': '22b801c1afdaf13d1e0c402769c4d87fa425de035affd688a84b1b5aab9cc2d8',
  'mssql/0016_routines_revision.sql': 'ac3790e91d3b70f83e365db3c77e8f2269452c0525b3b571640adc9f48960d1c',
  'mssql/0017_idempotency_keys.sql': '1bec56554936ceb12a040b162a311f5b5aacd176c00e62aaf9a624a895055dc5',
  'postgres/0019_queue_pause.sql': '171bd775730f4afb2c8db07b872d40048a23d9212c0e3393574ccd6ddb05c67f',
  'postgres/0020_batch_idempotency_keys.sql': 'c444ed476d735d7c551ed97f44c53cac90edfd92246873a79d3915acc6b90229',
  'mssql/0018_batch_idempotency_keys.sql': '35c6ab9a10914fb4a0f4e9dbf7697a6f48bbf127198b37a021dd103f92703508',
  'mssql/0019_queue_pause.sql': 'c6f5bd4d06a18b5fa01393ab53bf013430b965bfb902c30f2d00297f6e01462f',
};

/**
 * The routine files (sql/postgres/routines/*.sql, sql/mssql/procedures/*.sql) as of their
 * revision (the folder's REVISION): a database records the revision it runs, and a process of an
 * older one may not replace them (0016_routines_revision.sql). Any change of a file raises it.
 */
const ROUTINES: Record<string, { revision: number; sha256: string }> = {
  'postgres/routines': { revision: 7, sha256: 'aba469b8a47db24e45f6b013baf3530f201541d152eae6d00a881bc3efea2ea2' },
  'mssql/procedures': { revision: 7, sha256: 'c393cc8d3c0fffcafe7e3eb788185bdd4b139b07676f71bcbedea22100244b99' },
};

describe('routines revision', () => {
  for (const [folder, pinned] of Object.entries(ROUTINES)) {
    it(`${folder}: raised with every change of its files`, async () => {
      const dir = new URL(`../sql/${folder}/`, import.meta.url);
      const hash = createHash('sha256');
      for (const file of (await readdir(dir)).filter((f) => f.endsWith('.sql')).sort()) {
        hash.update(`${file}\0`).update(await readFile(new URL(file, dir))).update('\0');
      }
      const revision = Number((await readFile(new URL('REVISION', dir), 'utf8')).trim());
      assert.equal(revision, pinned.revision, `sql/${folder}/REVISION and the pin here agree`);
      assert.equal(
        hash.digest('hex'),
        pinned.sha256,
        `the files of sql/${folder} changed: raise its REVISION to ${pinned.revision + 1} and pin their new digest here (a database at an older revision is upgraded; a process of an older one refuses to replace them)`,
      );
    });
  }
});

describe('landed migrations', () => {
  for (const [file, digest] of Object.entries(LANDED)) {
    it(`${file} is unchanged`, async () => {
      const text = await readFile(new URL(`../sql/${file}`, import.meta.url));
      assert.equal(createHash('sha256').update(text).digest('hex'), digest, `${file} changed: add a new migration instead`);
    });
  }

  it('every numbered migration is pinned', async () => {
    for (const engine of ['postgres', 'mssql']) {
      for (const file of (await readdir(new URL(`../sql/${engine}/`, import.meta.url))).filter((f) => /^\d{4}_.+\.sql$/.test(f))) {
        assert.ok(`${engine}/${file}` in LANDED, `sql/${engine}/${file} is not pinned in test/migrations.test.ts`);
      }
    }
  });
});
