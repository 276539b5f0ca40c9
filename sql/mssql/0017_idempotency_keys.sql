-- Idempotency keys (usp_AsyncExecInvoke's @idempotencyKey; sql/postgres/0018_idempotency_keys.sql):
-- a caller that is not sure its call was submitted (its invoke timed out, its connection dropped
-- while the commit was on its way) sends it again with the same key, and gets the execution the
-- first one made: nothing is submitted twice. A key belongs to its caller (scope: submitted_by,
-- N'' for none) and lives as long as the execution's row: the purge's DELETE of the row removes
-- it (ON DELETE CASCADE, as the attempts and the progress). request_digest: what the first call
-- asked for, so that a key sent again with another call is refused (50016), not replayed.
--
-- A table of its own, not a column of AsyncExecResults with a filtered unique index: DML on a
-- table with a filtered index needs specific SET options (CREATE INDEX, "Filtered indexes"),
-- which a caller's session that invokes may not have (0001_tables.sql keeps to none for this).
-- Both columns are compared under a binary collation: under the database's (often
-- case-insensitive) one, "Order-1" and "order-1" would be one key, and "Bob" and "bob" one caller.
-- Trailing spaces are ignored by = whatever the collation ("= (String comparison or assignment)"),
-- so usp_AsyncExecInvoke refuses a key that ends with one. The primary key's 768 bytes at most
-- fit a clustered index's 900.
CREATE TABLE asyncexec.AsyncExecIdempotencyKeys (
    scope            nvarchar(256)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    idempotency_key  nvarchar(128)  COLLATE Latin1_General_100_BIN2 NOT NULL,
    execution_id     bigint         NOT NULL,
    -- the execution's token, kept here so that a replay reads this row only (not AsyncExecResults,
    -- which a versioned read may show as of an older snapshot, and the purge locks in the other order)
    execution_token  uniqueidentifier NOT NULL,
    request_digest   varbinary(32)  NOT NULL,
    CONSTRAINT PK_AsyncExecIdempotencyKeys PRIMARY KEY CLUSTERED (scope, idempotency_key),
    CONSTRAINT FK_AsyncExecIdempotencyKeys_execution FOREIGN KEY (execution_id)
        REFERENCES asyncexec.AsyncExecResults (id) ON DELETE CASCADE
);
GO

-- the cascade from a purged row finds its key by this index, not by a scan
CREATE INDEX IX_AsyncExecIdempotencyKeys_execution ON asyncexec.AsyncExecIdempotencyKeys (execution_id);
GO
