-- usp_AsyncExecReplay: the execution a caller's idempotency key made (0017_idempotency_keys.sql),
-- for usp_AsyncExecInvoke. @id and @token: that execution; NULL when the key is new. The key sent
-- with another call than the one that made it (another @digest) is refused (50016), naming the
-- execution it made: a caller reusing a key by mistake learns which call holds it.
-- @batch = 1: the same for a batch's key (0018_batch_idempotency_keys.sql), for
-- usp_AsyncExecBatchCreate: @batchId is the batch the key made, and its keys and their locks are
-- apart from single calls'.
--
-- The read never waits. A key row another transaction is inserting (or deleting) is locked by it:
-- with LOCK_TIMEOUT 0 the read fails at once with 1222 ("SET LOCK_TIMEOUT": "a value of 0 means
-- to not wait at all and return a message as soon as a lock is encountered"), answered here with
-- 50017: the key is in use, send the call again shortly. (Waiting, a held key made every invoke
-- of it wait for the holder's transaction, holding the waiter's connection.)
--
-- @lock = 1 (usp_AsyncExecInvoke, inside its transaction, before it may insert the key): first the
-- key's application lock, held to the end of the transaction (@LockOwner = 'Transaction'), never
-- waited for (@LockTimeout = 0: "returns -1 ... if the lock cannot be granted immediately",
-- sp_getapplock; no error is raised for any result). Every transaction that inserts the key holds
-- it, so under it no other can be inserting the key, and one that finds it held is refused at once
-- (50017). The key's own lock, nothing of a range: another new key never waits for this one. READ COMMITTED for the read: under SNAPSHOT a read is
-- of the transaction's snapshot, and a key another session committed since would not be seen;
-- under READ_COMMITTED_SNAPSHOT a READ COMMITTED read is of the last committed version and never
-- waits. SET options and the isolation level set in a procedure hold until it returns ("SET
-- TRANSACTION ISOLATION LEVEL", Remarks; "SET Statements", considerations), and a SNAPSHOT
-- transaction may switch to another level and back.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecReplay
    @scope  nvarchar(256),
    @key    nvarchar(129),     -- one longer than a key may be: see the check of its rules below
    @digest varbinary(32),
    @lock   bit = 0,
    @id     bigint = NULL OUTPUT,
    @token  uniqueidentifier = NULL OUTPUT,
    @batch  bit = 0,
    @batchId uniqueidentifier = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    SET LOCK_TIMEOUT 0;
    -- The lock's name: 72 bits of a SHA-256 of the caller and the key, within 32 characters as the
    -- calls' locks are (0005_activated.sql: sys.dm_tran_locks shows it whole); two keys whose bits
    -- agree would only refuse each other while both are held. The hash is of their bytes, so case
    -- counts, as in the table; the scope's length first, so no two (scope, key) pairs are one text;
    -- RTRIM: the table's = ignores trailing blanks of the scope, so must the lock. A batch's key is
    -- hashed with a leading N'b' (a call's text begins with a digit), so it never names a call's lock.
    DECLARE @madeDigest varbinary(32), @message nvarchar(2048), @lockResult int, @inUse bit = 0,
            @resource nvarchar(32) = N'asyncexec.key/' + LEFT(CONVERT(nvarchar(64), HASHBYTES('SHA2_256',
                CONCAT(CASE WHEN @batch = 1 THEN N'b' END, LEN(@scope), N':', RTRIM(@scope), NCHAR(1), @key)), 2), 18);
    -- a SELECT that finds no row assigns nothing: the outputs start empty
    SELECT @id = NULL, @token = NULL, @batchId = NULL;
    -- The key's rules (50005), for both callers. DATALENGTH, not LEN: LEN ignores trailing blanks.
    -- A trailing blank is refused because = ignores it, whatever the collation ("= (String
    -- comparison or assignment)"): "k " would be the key "k". A leading blank is refused as the
    -- service refuses it (engine.ts checkIdempotencyKey), by its code point: = would compare it
    -- under the database's collation. The callers' parameter is nvarchar(129): a key cut to it is
    -- refused here, where one cut to 128 would have been another key.
    IF @key IS NULL OR DATALENGTH(@key) NOT BETWEEN 2 AND 256 OR DATALENGTH(@key) <> DATALENGTH(RTRIM(@key))
       OR UNICODE(@key) = 32
    BEGIN
        SET @message = N'an idempotency key is 1 to 128 characters, and does not begin or end with a blank';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @lock = 1
    BEGIN
        -- 0 granted; -1 not at once (held); other negative results are faults of the call
        EXEC @lockResult = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
        IF @lockResult < -1
        BEGIN
            SET @message = CONCAT(N'usp_AsyncExecReplay: sp_getapplock returned ', @lockResult, N' for an idempotency key');
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50025, @message, 1;
        END;
        IF @lockResult = -1
            SET @inUse = 1;
    END;
    IF @inUse = 0
    BEGIN
        BEGIN TRY
            IF @batch = 1
                SELECT @batchId = k.batch_id, @madeDigest = k.request_digest
                FROM asyncexec.AsyncExecBatchIdempotencyKeys AS k
                WHERE k.scope = @scope AND k.idempotency_key = @key;
            ELSE
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
            SET @inUse = 1;
        END CATCH;
    END;
    IF @inUse = 1
    BEGIN
        SET @message = CONCAT(N'idempotency key "', @key, N'" is in use by a transaction that has not ended: send the ',
                              CASE WHEN @batch = 1 THEN N'batch' ELSE N'call' END, N' again in a moment');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50017, @message, 1;
    END;
    -- @madeDigest is set exactly when the key was found (request_digest is NOT NULL in both tables)
    IF @madeDigest IS NULL
        RETURN;
    IF @madeDigest <> @digest
    BEGIN
        SET @message = CASE WHEN @batch = 1
            THEN CONCAT(N'idempotency key "', @key, N'" was sent before with another batch (batch ',
                        LOWER(CONVERT(nchar(36), @batchId)), N'): send a new key for a new batch')
            ELSE CONCAT(N'idempotency key "', @key, N'" was sent before with another call (execution ',
                        LOWER(CONVERT(nchar(36), @token)), N'): send a new key for a new call') END;
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50016, @message, 1;
    END;
END;
