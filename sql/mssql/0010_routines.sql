-- Procedures, functions and views live one to a file in sql/mssql/procedures/ (CREATE OR
-- ALTER), applied by the migrator after the numbered migrations whenever a file's content
-- changed. This table records what was applied: one row per file, with the SHA-256 (hex) of
-- the text applied. Migrations 0001-0009 still create the first versions of those objects;
-- the files then bring each to the definition that counts.
CREATE TABLE asyncexec.AsyncExecRoutines (
    name        nvarchar(260) NOT NULL CONSTRAINT PK_AsyncExecRoutines PRIMARY KEY,   -- file name, e.g. usp_AsyncExecRun.sql
    sha256      char(64)      NOT NULL,
    applied_at  datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecRoutines_applied DEFAULT (SYSUTCDATETIME())
);
GO
