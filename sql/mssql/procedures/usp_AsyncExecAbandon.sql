-- Our poison-message handling: take a call's messages off its queue for good, fail the
-- call (50012) unless it is finished or a live reader holds it, and end the dialog.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecAbandon
    @queue      nvarchar(100),
    @h          uniqueidentifier,   -- the target side of the call's dialog
    @id         bigint = NULL,
    @errMessage nvarchar(4000) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @receive nvarchar(max), @x uniqueidentifier, @lock int, @resource nvarchar(255), @cursor varchar(18), @reply xml,
            @now datetime2(3), @batchId uniqueidentifier, @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8));

    SELECT @receive = N'RECEIVE TOP (1) @x = conversation_handle FROM asyncexec.' + QUOTENAME(queue_object)
                    + N' WHERE conversation_handle = @h;'
    FROM asyncexec.AsyncExecQueues
    WHERE name = @queue;
    IF @id IS NULL
        SELECT @id = id FROM asyncexec.AsyncExecResults WHERE target_handle = @h;
    SELECT @batchId = batch_id FROM asyncexec.AsyncExecResults WHERE id = @id;

    BEGIN TRY
        BEGIN TRANSACTION;
        -- RECEIVE first: it locks the dialog's conversation group before the results row,
        -- in the same order as a reader's claim.
        IF @receive IS NOT NULL
            EXEC sys.sp_executesql @receive, N'@h uniqueidentifier, @x uniqueidentifier OUTPUT', @h = @h, @x = @x OUTPUT;
        IF @id IS NOT NULL
        BEGIN
            SET @resource = CONCAT(N'asyncexec/', @id);
            EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
            IF @lock < 0
            BEGIN
                -- a live reader runs the call: it ends the dialog itself
                ROLLBACK TRANSACTION;
                RETURN;
            END;
            -- a batch member locks its batch before its own row (see the header)
            IF @batchId IS NOT NULL
                SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
            SET @now = SYSUTCDATETIME();
            UPDATE asyncexec.AsyncExecResults
               SET status = 'FAILED', finished_at = @now, error_number = 50012, error_severity = 16, error_state = 1,
                   error_line = NULL, error_procedure = NULL,
                   error_message = LEFT(CONCAT(N'the call''s messages could not be handled: ', @errMessage), 4000)
            OUTPUT inserted.row_version INTO @changed (v)
            WHERE id = @id AND status IN ('WAITING', 'PENDING', 'RUNNING');
            -- A RUNNING call whose lock we hold has no live reader: its attempt was lost.
            UPDATE asyncexec.AsyncExecAttempts
               SET status = 'LOST', finished_at = @now
             WHERE execution_id = @id AND status = 'RUNNING';
        END;
        IF EXISTS (SELECT 1 FROM @changed)
        BEGIN
            IF @batchId IS NOT NULL
                EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
            SELECT @cursor = CONVERT(varchar(18), v, 1) FROM @changed;
            SET @reply = (SELECT @id AS [@id], 'FAILED' AS [@status], @cursor AS [@cursor] FOR XML PATH('status'), TYPE);
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
        END;
        -- Ending the dialog removes its remaining messages from the queue.
        END CONVERSATION @h;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
        VALUES (@queue, @id, @h, ERROR_NUMBER(), ERROR_MESSAGE());
        -- Last resort: end the dialog with an error, which also discards its messages
        -- (the listener ends the other side on the Error message).
        BEGIN TRY
            END CONVERSATION @h WITH ERROR = 50012 DESCRIPTION = N'asyncexec could not handle this call''s messages';
        END TRY
        BEGIN CATCH
            INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
            VALUES (@queue, @id, @h, ERROR_NUMBER(), ERROR_MESSAGE());
        END CATCH;
    END CATCH;
END;
