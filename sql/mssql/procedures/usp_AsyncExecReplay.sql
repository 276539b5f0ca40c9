-- usp_AsyncExecReplay: the execution a caller's idempotency key made (0017_idempotency_keys.sql),
-- for usp_AsyncExecInvoke. @id and @token: that execution; NULL when the key is new. The key sent
-- with another call than the one that made it (another @digest) is refused (50016), naming the
-- execution it made: a caller reusing a key by mistake learns which call holds it.
--
-- UPDLOCK, HOLDLOCK: HOLDLOCK is SERIALIZABLE for this table ("Table hints (Transact-SQL)"), so the
-- key's row, or the key range where it would go when there is none, stays locked until the
-- transaction ends (key-range locking, "Transaction locking and row versioning guide"); with
-- UPDLOCK the lock is an update lock (U; RangeS-U on a range), and update locks are not compatible
-- with one another: a second invoke of the same key waits here until the first one's transaction
-- ends, then reads the key (a replay) if it committed, or finds it new if it rolled back. Outside a
-- transaction the locks last as long as the statement (the caller checks again in its own).
-- READ COMMITTED for the read: under SNAPSHOT a read is of the transaction's snapshot, and a key
-- another session committed since would not be seen (then 2627 at the INSERT, or 3960). A level
-- set in a procedure holds until it returns ("SET TRANSACTION ISOLATION LEVEL", Remarks), and a
-- SNAPSHOT transaction may switch to another level and back; READCOMMITTEDLOCK would not do, as
-- it is ignored beside UPDLOCK ("Table hints"). Under READ_COMMITTED_SNAPSHOT the hinted read is
-- a locking one anyway.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecReplay
    @scope  nvarchar(256),
    @key    nvarchar(128),
    @digest varbinary(32),
    @id     bigint = NULL OUTPUT,
    @token  uniqueidentifier = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    DECLARE @madeDigest varbinary(32), @message nvarchar(2048);
    -- a SELECT that finds no row assigns nothing: the outputs start empty
    SELECT @id = NULL, @token = NULL;
    SELECT @id = k.execution_id, @token = k.execution_token, @madeDigest = k.request_digest
    FROM asyncexec.AsyncExecIdempotencyKeys AS k WITH (UPDLOCK, HOLDLOCK)
    WHERE k.scope = @scope AND k.idempotency_key = @key;
    IF @id IS NULL
        RETURN;
    IF @madeDigest <> @digest
    BEGIN
        SET @message = CONCAT(N'idempotency key "', @key, N'" was sent before with another call (execution ',
                              LOWER(CONVERT(nchar(36), @token)), N'): send a new key for a new call');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50016, @message, 1;
    END;
END;
