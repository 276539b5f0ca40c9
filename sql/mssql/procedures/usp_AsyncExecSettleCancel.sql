-- Record CANCELLED for a RUNNING call whose cancel was asked for (usp_AsyncExecCancel) once
-- its session is gone (killed): the killed run has rolled back, the attempt was LOST, and
-- the dialog ends with a CANCELLED status to the listener, as a reader's recovery on the
-- lease timer would do (this does it at once, without waiting for the lease or for a
-- free reader). Takes the locks in the claim's order: the conversation group, then the
-- call's application lock without waiting, then the row. Does nothing while the killed
-- session still holds the lock; @status is the call's status afterwards.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecSettleCancel
    @id     bigint,
    @status varchar(10) = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @h uniqueidentifier, @cancel bit, @lease int, @resource nvarchar(255) = CONCAT(N'asyncexec/', @id), @lock int,
            @now datetime2(3), @cursor varchar(18), @reply xml, @batchId uniqueidentifier, @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8) NULL);
    SET @status = NULL;

    SELECT @status = e.status, @cancel = e.cancel_requested, @h = e.target_handle, @batchId = e.batch_id,
           @lease = 60 + COALESCE(CEILING(r.timeout_ms / 1000.0), 0)
    FROM asyncexec.AsyncExecResults AS e
    LEFT JOIN asyncexec.AsyncExecProcedures AS r ON r.name = e.[procedure]
    WHERE e.id = @id;
    -- a killed session keeps its session-owned lock until it has rolled back and ended
    IF @status IS NULL OR @status <> 'RUNNING' OR COALESCE(@cancel, 0) = 0 OR @h IS NULL
       OR APPLOCK_TEST('public', @resource, 'Exclusive', 'Session') = 0
        RETURN;

    BEGIN TRY
        BEGIN TRANSACTION;
        -- the conversation group first, as a reader's RECEIVE takes it (every statement on a
        -- dialog locks its group); re-arming the lease is harmless if nothing changes below
        BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;
        EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
        IF @lock >= 0
        BEGIN
            -- a batch member locks its batch before its own row (lock order above)
            IF @batchId IS NOT NULL
                SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
            SET @now = SYSUTCDATETIME();
            UPDATE asyncexec.AsyncExecResults
               SET status = 'CANCELLED', finished_at = @now,
                   recoveries = recoveries + 1   -- the killed run was lost with its session
            OUTPUT inserted.row_version INTO @changed (v)
            WHERE id = @id AND status = 'RUNNING' AND cancel_requested = 1;
            IF EXISTS (SELECT 1 FROM @changed)
            BEGIN
                -- the execution log, in the same transaction: the killed attempt is LOST
                UPDATE asyncexec.AsyncExecAttempts
                   SET status = 'LOST', finished_at = @now
                 WHERE execution_id = @id AND status = 'RUNNING';
                IF @batchId IS NOT NULL
                    EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
                SELECT @cursor = CONVERT(varchar(18), v, 1) FROM @changed;
                SET @reply = (SELECT @id AS [@id], 'CANCELLED' AS [@status], @cursor AS [@cursor] FOR XML PATH('status'), TYPE);
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
                END CONVERSATION @h;   -- the listener ends the other side
            END;
        END;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        -- a reader that recorded CANCELLED first has ended the dialog: nothing to log then
        IF EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WHERE id = @id AND status = 'RUNNING')
            INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
            VALUES (@id, @h, ERROR_NUMBER(), ERROR_MESSAGE());
    END CATCH;
    SELECT @status = status FROM asyncexec.AsyncExecResults WHERE id = @id;
END;
