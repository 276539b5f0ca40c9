-- Create a batch of @stageCount stages inside the caller's transaction; its calls are then
-- invoked with usp_AsyncExecInvoke @batchId = @batchId, @stage = 1 … @stageCount, before the
-- caller commits. A later stage left without calls is skipped when the stage before it
-- ends; but stage 1 must have calls: a batch whose first stage has none is settled only
-- when a call of it ends, so it stays RUNNING, its later calls held, until one is added.
-- With @idempotencyKey (0018_batch_idempotency_keys.sql), a key this caller sent before with the
-- same batch (@requestDigest, the caller's SHA-256 of what the batch asks for: the service's is of
-- its calls in order and its failure policy; @stageCount and @onFailure are compared with it)
-- returns that batch in @replayedBatchId, and writes nothing: the caller then invokes none of its
-- calls. @batchId stays NULL then, so that a caller that invokes them anyway is refused (50005,
-- no such batch) rather than adding a second copy of its calls to the first batch. The same key
-- with another batch is refused (50016); one that another transaction holds, at once (50017).
-- Errors: 50005 bad stage count or failure policy, no open transaction, a malformed key, or a key
-- without a digest; 50016, 50017 as above.
-- EXECUTE AS OWNER, as usp_AsyncExecInvoke: callers need only EXECUTE on the two procedures.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecBatchCreate
    @stageCount  int,
    @onFailure   varchar(8) = 'CANCEL',
    @submittedBy nvarchar(256) = NULL,
    @batchId     uniqueidentifier = NULL OUTPUT,
    -- 1 to 128 characters; declared one longer, as usp_AsyncExecInvoke's: a longer value passed is
    -- cut to the parameter's length without an error, and a key cut to 128 would be another key
    @idempotencyKey nvarchar(129) = NULL,
    -- one longer than a SHA-256, for the same reason: "When truncation occurs in any conversion to
    -- or from binary or varbinary data, no warning or error is issued" (SET ANSI_WARNINGS), and a
    -- longer digest cut to 32 bytes would pass for one
    @requestDigest  varbinary(33) = NULL,
    @replayedBatchId uniqueidentifier = NULL OUTPUT
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048), @scope nvarchar(256) = COALESCE(@submittedBy, N''), @digest varbinary(32);
    SELECT @batchId = NULL, @replayedBatchId = NULL;
    -- Stored as the service reads it: T-SQL compares case-insensitively (usual collations) and
    -- ignores trailing blanks, so 'cancel' or 'CANCEL ' would pass the checks below as they are.
    SET @onFailure = UPPER(RTRIM(COALESCE(@onFailure, 'CANCEL')));
    IF @stageCount IS NULL OR @stageCount < 1
    BEGIN
        SET @message = CONCAT(N'a batch has at least one stage, not ', COALESCE(CAST(@stageCount AS nvarchar(11)), N'NULL'));
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @onFailure NOT IN ('CANCEL', 'CONTINUE')
    BEGIN
        SET @message = CONCAT(N'onFailure must be CANCEL or CONTINUE, not ', @onFailure);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    -- Outside a transaction the first stage could finish, and the batch end, before the
    -- calls of the later stages were added.
    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'create a batch and invoke its calls in one transaction';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    IF @idempotencyKey IS NOT NULL
    BEGIN
        IF @requestDigest IS NULL OR DATALENGTH(@requestDigest) <> 32
        BEGIN
            SET @message = N'a batch''s idempotency key needs @requestDigest: the SHA-256 (32 bytes) of what the batch asks for';
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50005, @message, 1;
        END;
        -- what is kept and compared: the caller's digest with the stage count and the policy
        -- (style 1: 0x and hex digits)
        SET @digest = HASHBYTES('SHA2_256', CONCAT(CONVERT(nvarchar(68), @requestDigest, 1), NCHAR(31), @stageCount, NCHAR(31), @onFailure));
        -- the key checked (50005), and read under its application lock, held to the end of the
        -- caller's transaction (open: checked above), so that no other transaction is inserting the
        -- key meanwhile; 50017 at once when another holds it, 50016 when it was sent with another batch
        EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @lock = 1, @batch = 1, @batchId = @replayedBatchId OUTPUT;
        IF @replayedBatchId IS NOT NULL
            RETURN;
    END;

    SET @batchId = NEWID();
    INSERT asyncexec.AsyncExecBatches (id, on_failure, stage_count, submitted_by, submitted_login)
    VALUES (@batchId, @onFailure, @stageCount, @submittedBy, ORIGINAL_LOGIN());
    IF @idempotencyKey IS NOT NULL
        INSERT asyncexec.AsyncExecBatchIdempotencyKeys (scope, idempotency_key, batch_id, request_digest)
        VALUES (@scope, @idempotencyKey, @batchId, @digest);
END;
