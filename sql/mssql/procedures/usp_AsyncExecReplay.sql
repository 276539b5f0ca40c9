-- usp_AsyncExecReplay: the execution a caller's idempotency key made (0017_idempotency_keys.sql),
-- for usp_AsyncExecInvoke. @id and @token: that execution; NULL when the key is new. The key sent
-- with another call than the one that made it (another @digest) is refused (50016), naming the
-- execution it made: a caller reusing a key by mistake learns which call holds it.
--
-- The read never waits. A key row another transaction is inserting (or deleting) is locked by it:
-- with LOCK_TIMEOUT 0 the read fails at once with 1222 ("SET LOCK_TIMEOUT": "a value of 0 means
-- to not wait at all and return a message as soon as a lock is encountered"), answered here with
-- 50017: the key is in use, send the call again shortly. (Waiting, a held key made every invoke
-- of it wait for the holder's transaction, holding the waiter's connection.) usp_AsyncExecInvoke
-- takes an application lock on the key before it reads it inside its transaction, so no other
-- transaction can be inserting the key then. READ COMMITTED for the read: under SNAPSHOT a read is
-- of the transaction's snapshot, and a key another session committed since would not be seen;
-- under READ_COMMITTED_SNAPSHOT a READ COMMITTED read is of the last committed version and never
-- waits. SET options and the isolation level set in a procedure hold until it returns ("SET
-- TRANSACTION ISOLATION LEVEL", Remarks; "SET Statements", considerations), and a SNAPSHOT
-- transaction may switch to another level and back.
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
    SET LOCK_TIMEOUT 0;
    DECLARE @madeDigest varbinary(32), @message nvarchar(2048);
    -- a SELECT that finds no row assigns nothing: the outputs start empty
    SELECT @id = NULL, @token = NULL;
    BEGIN TRY
        SELECT @id = k.execution_id, @token = k.execution_token, @madeDigest = k.request_digest
        FROM asyncexec.AsyncExecIdempotencyKeys AS k
        WHERE k.scope = @scope AND k.idempotency_key = @key;
    END TRY
    BEGIN CATCH
        -- 1222 does not end the transaction it happens in ("Lock time-out"); anything else is rethrown
        IF ERROR_NUMBER() <> 1222
        BEGIN
            THROW;
        END;
        SET @message = CONCAT(N'idempotency key "', @key, N'" is in use by a transaction that has not ended: send the call again in a moment');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50017, @message, 1;
    END CATCH;
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
