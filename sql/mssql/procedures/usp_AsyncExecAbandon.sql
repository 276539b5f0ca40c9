-- Our poison-message handling: take a call's messages off its queue for good, fail the
-- call (50012) unless it is finished or a live reader holds it, and end the dialog, all in one
-- transaction. The dialog is never ended unless that transaction commits: when the failure
-- cannot be recorded, the message is moved to asyncexec.AsyncExecDeadLetters (RECEIVE and
-- INSERT in one transaction) and the dialog stays open, so nothing is dropped while the call
-- is unfinished. If even that fails, the message stays on the queue and is tried again.
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
    DECLARE @receive nvarchar(max), @x uniqueidentifier, @lock int, @deadReceive nvarchar(max), @deadType sysname,
            @deadBody varbinary(max), @errNumber int, @errText nvarchar(4000), @resource nvarchar(255), @cursor varchar(18), @reply xml,
            @now datetime2(3), @batchId uniqueidentifier, @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8) NULL);

    SELECT @receive = N'RECEIVE TOP (1) @x = conversation_handle FROM asyncexec.' + QUOTENAME(queue_object)
                    + N' WHERE conversation_handle = @h;',
           @deadReceive = N'RECEIVE TOP (1) @x = conversation_handle, @type = message_type_name, @body = message_body FROM asyncexec.'
                    + QUOTENAME(queue_object) + N' WHERE conversation_handle = @h;'
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
            -- not on a dialog whose other side has ended or errored: SEND fails there, and the
            -- status is a hint (the results row is the truth)
            IF EXISTS (SELECT 1 FROM sys.conversation_endpoints WHERE conversation_handle = @h AND state NOT IN ('DI', 'DO', 'ER', 'CD'))
            BEGIN
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
            END;
        END;
        -- Ending the dialog removes its remaining messages from the queue.
        END CONVERSATION @h;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        SELECT @errNumber = ERROR_NUMBER(), @errText = ERROR_MESSAGE();
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
        VALUES (@queue, @id, @h, @errNumber, @errText);
        -- The failure could not be recorded. Ending the dialog now (the old WITH ERROR fallback)
        -- would discard its messages and its timer while the call stays PENDING, WAITING or
        -- RUNNING for ever. Keep the message instead: take it off the queue into the dead
        -- letters, RECEIVE and INSERT in one transaction (either both commit or the message stays
        -- on the queue), and leave the dialog open. An operator replays it by arming the
        -- dialog's timer (docs/mssql.md, "When a call's messages cannot be handled").
        IF @deadReceive IS NOT NULL
        BEGIN
        BEGIN TRY
            BEGIN TRANSACTION;
            SELECT @x = NULL, @deadType = NULL, @deadBody = NULL;
            EXEC sys.sp_executesql @deadReceive, N'@h uniqueidentifier, @x uniqueidentifier OUTPUT, @type sysname OUTPUT, @body varbinary(max) OUTPUT',
                 @h = @h, @x = @x OUTPUT, @type = @deadType OUTPUT, @body = @deadBody OUTPUT;
            IF @x IS NOT NULL
                INSERT asyncexec.AsyncExecDeadLetters (queue, execution_id, conversation_handle, message_type_name, message_body, error_number, error_message)
                VALUES (@queue, @id, @h, @deadType, @deadBody, @errNumber, LEFT(CONCAT(@errText, N' (after: ', @errMessage, N')'), 4000));
            COMMIT TRANSACTION;
        END TRY
        BEGIN CATCH
            IF XACT_STATE() <> 0
                ROLLBACK TRANSACTION;   -- the message is back on the queue: tried again, never dropped
            INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
            VALUES (@queue, @id, @h, ERROR_NUMBER(), ERROR_MESSAGE());
        END CATCH;
        END;
    END CATCH;
END;
