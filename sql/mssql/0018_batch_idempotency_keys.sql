-- Idempotency keys of batches (usp_AsyncExecBatchCreate's @idempotencyKey; 0017_idempotency_keys.sql
-- for single calls, sql/postgres/0020_batch_idempotency_keys.sql): a caller that is not sure its
-- batch was submitted sends it again with the same key and gets the batch the first one made. A
-- batch's key is its caller's (scope: submitted_by, N'' for none), apart from single calls' keys,
-- and lives as long as the batch's row: the purge's DELETE of the batch removes it (ON DELETE
-- CASCADE). request_digest: the caller's digest of what the batch asked for (the procedure cannot
-- see the calls, which are invoked after it), so that the key sent again with another batch is
-- refused (50016), not replayed. A table of its own and binary collations, as 0017's and for the
-- same reasons.
CREATE TABLE asyncexec.AsyncExecBatchIdempotencyKeys (
    scope            nvarchar(256)    COLLATE Latin1_General_100_BIN2 NOT NULL,
    idempotency_key  nvarchar(128)    COLLATE Latin1_General_100_BIN2 NOT NULL,
    batch_id         uniqueidentifier NOT NULL,
    request_digest   varbinary(32)    NOT NULL,
    CONSTRAINT PK_AsyncExecBatchIdempotencyKeys PRIMARY KEY CLUSTERED (scope, idempotency_key),
    CONSTRAINT FK_AsyncExecBatchIdempotencyKeys_batch FOREIGN KEY (batch_id)
        REFERENCES asyncexec.AsyncExecBatches (id) ON DELETE CASCADE
);
GO

-- the cascade from a purged batch finds its key by this index, not by a scan
CREATE INDEX IX_AsyncExecBatchIdempotencyKeys_batch ON asyncexec.AsyncExecBatchIdempotencyKeys (batch_id);
GO
