-- Cancelling a call (the service's cancelExecution; docs/mssql.md, "Cancelling a call").
--
-- Locks, in the order every path takes them (none waits for a lock while holding a later one):
--   1. the conversation group of the call's activated side: RECEIVE (a reader's claim, the
--      run's BEGIN CONVERSATION TIMER, usp_AsyncExecAbandon) and usp_AsyncExecSettleCancel;
--      usp_AsyncExecCancel never touches it (it SENDs on the initiator side, whose group only
--      the listener's short RECEIVE transactions take);
--   2. the call's application lock N'asyncexec/<id>': readers take it with a zero timeout
--      (they never wait for it); only usp_AsyncExecCancel waits for it, holding nothing else;
--   3. the call's row in asyncexec.AsyncExecResults.
-- Every status change of a WAITING, PENDING or RUNNING call is made holding the call's
-- application lock, and a reader's claim reads the call again after taking that lock, so a
-- call cancelled while WAITING or PENDING can never be started. A RUNNING call's lock is
-- held by its reader for the whole run: its cancel is recorded in cancel_requested, the
-- reader's session is killed (usp_AsyncExecKill, from the service, outside any
-- transaction), and whoever next holds the lock records CANCELLED instead of running it.
-- The resource name is kept within 32 characters (sp_getapplock: "only the first 32
-- characters can be retrieved in plain text"), so sys.dm_tran_locks shows it whole.

-- Errors (THROW, severity 16), mapped one to one by the service:
--   50006 NOT_FOUND         no call has this token
--   50007 ALREADY_FINISHED  the call is SUCCEEDED, FAILED or CANCELLED already
--   50008 FORBIDDEN         the call is RUNNING and @allowKill is 0, or the caller lacks the
--                           rights the kill needs (ALTER ANY CONNECTION, VIEW SERVER STATE)
-- @status: CANCELLED (done), RUNNING (cancel recorded and committed: the service kills the
-- session next), BUSY (a reader is claiming the call right now: try again).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecCancel
    @token     uniqueidentifier,
    @allowKill bit = 0,
    @id        bigint = NULL OUTPUT,
    @status    varchar(10) = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @name nvarchar(60) = LOWER(CONVERT(nvarchar(36), @token)), @resource nvarchar(255),
            @lock int, @wait int, @initiator uniqueidentifier, @state char(2), @body xml, @now datetime2(3),
            @batchId uniqueidentifier, @batchStatus varchar(10);
    SELECT @id = NULL, @status = NULL;

    SELECT @id = id, @status = status, @batchId = batch_id FROM asyncexec.AsyncExecResults WHERE token = @token;
    IF @id IS NULL
    BEGIN
        SET @message = CONCAT(N'execution ', @name, N' does not exist');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50006, @message, 1;
    END;
    SET @resource = CONCAT(N'asyncexec/', @id);
    -- the reader of a RUNNING call holds its lock for the whole run: do not wait for it
    SET @wait = CASE WHEN @status = 'RUNNING' THEN 0 ELSE 5000 END;

    BEGIN TRY
        BEGIN TRANSACTION;
        EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = @wait;
        -- a batch member that may end here locks its batch before its own row (lock order above)
        IF @batchId IS NOT NULL AND @lock >= 0
            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
        -- UPDLOCK: the latest committed row (whatever the isolation level), kept until we end
        SELECT @status = status, @initiator = initiator_handle
        FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
        WHERE id = @id;

        IF @status IS NULL
        BEGIN
            SET @message = CONCAT(N'execution ', @name, N' does not exist');
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50006, @message, 1;
        END;
        IF @status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        BEGIN
            SET @message = CONCAT(N'execution ', @name, N' has already finished (', @status, N')');
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50007, @message, 1;
        END;

        IF @status = 'RUNNING'
        BEGIN
            IF COALESCE(@allowKill, 0) = 0
            BEGIN
                SET @message = CONCAT(N'execution ', @name, N' is RUNNING: cancelling it KILLs the SQL Server session that runs it, ',
                                      N'which this service does only when configured with allowKill=true');
                SET @message = REPLACE(@message, N'%', N'%%');
                THROW 50008, @message, 1;
            END;
            IF COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'ALTER ANY CONNECTION'), 0) = 0
               OR (COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER STATE'), 0) = 0
                   AND COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER PERFORMANCE STATE'), 0) = 0)
            BEGIN
                SET @message = CONCAT(N'execution ', @name, N' is RUNNING and allowKill=true, but the login lacks ALTER ANY CONNECTION ',
                                      N'(for KILL) or VIEW SERVER STATE (for sys.dm_tran_locks): nothing was changed');
                SET @message = REPLACE(@message, N'%', N'%%');
                THROW 50008, @message, 1;
            END;
            -- Committed before any KILL: the killed run rolls back, and whoever next holds the
            -- call's lock (usp_AsyncExecSettleCancel, or a reader on the lease timer) records
            -- CANCELLED instead of running it again; a run that ends on its own first keeps its
            -- outcome, but a failure is not retried (usp_AsyncExecRun).
            UPDATE asyncexec.AsyncExecResults SET cancel_requested = 1 WHERE id = @id AND cancel_requested = 0;
            COMMIT TRANSACTION;
            RETURN;
        END;

        IF @lock < 0
        BEGIN
            -- a reader holds the call this very moment (claiming it, or recording a retry)
            ROLLBACK TRANSACTION;
            SET @status = 'BUSY';
            RETURN;
        END;

        -- WAITING or PENDING, and no reader holds the call: a claim that follows takes the
        -- lock first and reads the call again under it, so it can never start it.
        SET @now = SYSUTCDATETIME();
        -- held = 0: a held batch member that ends is no longer waiting for its stage (as on PostgreSQL)
        UPDATE asyncexec.AsyncExecResults
           SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0
         WHERE id = @id AND status IN ('WAITING', 'PENDING');
        SET @status = 'CANCELLED';

        -- Wake the activated side now rather than at runAt or the retry backoff: a second
        -- request on the dialog (the contract lets the initiator send Request). The reader
        -- that receives it (or the first request, or the timer) finds the call CANCELLED,
        -- sends CANCELLED to the listener like any outcome, and ends the dialog, which also
        -- drops its timer and remaining messages. SEND needs the initiator side open
        -- (STARTED_OUTBOUND or CONVERSING); otherwise the dialog is ending already.
        SELECT @state = state FROM sys.conversation_endpoints WHERE conversation_handle = @initiator;
        IF @state IN ('SO', 'CO')
        BEGIN
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            SAVE TRANSACTION usp_AsyncExecCancel;
            BEGIN TRY
                SEND ON CONVERSATION @initiator MESSAGE TYPE [asyncexec/Request] (@body);
            END TRY
            BEGIN CATCH
                -- the cancel stands without the wake-up call: the dialog's own request or
                -- timer ends it later
                -- doomed (-1), or ended by the error itself (0): no savepoint is left to return to
                IF XACT_STATE() <> 1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION usp_AsyncExecCancel;
                INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
                VALUES (@id, @initiator, ERROR_NUMBER(), ERROR_MESSAGE());
            END CATCH;
        END;
        -- a cancelled batch member may complete its stage, or (onFailure CANCEL) cancel its batch
        IF @batchId IS NOT NULL
            EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
