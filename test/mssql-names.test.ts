/**
 * Registering and invoking by name on SQL Server (issue 12, item 5), read from the
 * procedure files (SQL Server cannot run here; the conformance suite runs them when
 * MSSQL_URL is set): the same help PostgreSQL gives, adapted to T-SQL's rules.
 */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { describe, it } from 'node:test';
import { MSSQL_SQL_DIR } from '../src/engines/mssql/migrator.js';

const procedure = (name: string) => readFile(path.join(MSSQL_SQL_DIR, 'procedures', `${name}.sql`), 'utf8');

describe('SQL Server names', () => {
  it('register: a bare name is dbo.<name>; a parameter list is explained (no overloads in T-SQL)', async () => {
    const text = await procedure('usp_AsyncExecRegister');
    assert.match(text, /COALESCE\(PARSENAME\(@procedure, 2\), N'dbo'\)/, 'an unqualified name means dbo');
    assert.match(text, /CHARINDEX\(N'\(', @procedure\) > 0\s+THEN N': give its name only \(schema\.procedure\): T-SQL procedures have no overloads/);
    assert.match(text, /a name without a schema is looked up in dbo/);
  });

  it('invoke: an unqualified name that is not registered names the registered ones it may have meant', async () => {
    const text = await procedure('usp_AsyncExecInvoke');
    const hint = text.slice(text.indexOf('Registered names are schema-qualified'));
    assert.match(text, /IF @registered IS NULL AND CHARINDEX\(N'\.', @procedure\) = 0/);
    // over nvarchar(max): many matching names must not overflow STRING_AGG's 8000-byte result (error 9829)
    assert.match(hint, /STRING_AGG\(CAST\(r\.name AS nvarchar\(max\)\), N' or '\)/);
    // the name is matched literally after the dot: LIKE wildcards in it are escaped
    assert.match(hint, /r\.name LIKE N'%\.' \+ REPLACE\(REPLACE\(REPLACE\(@procedure, N'\[', N'\[\[\]'\), N'%', N'\[%\]'\), N'_', N'\[_\]'\)/);
    assert.match(hint, /HAVING COUNT\(\*\) > 0/, 'no hint when nothing matches');
    assert.ok(text.indexOf('Registered names are schema-qualified') < text.indexOf('THROW 50001, @message, 1;', text.indexOf('is not registered')));
  });
});
