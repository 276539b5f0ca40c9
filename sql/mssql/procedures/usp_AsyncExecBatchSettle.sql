-- Settle a batch after one of its members has ended, in the transaction that recorded that
-- outcome (the caller's; never a transaction of its own):
--   * onFailure CANCEL and a member ended FAILED or CANCELLED: cancel every member still
--     WAITING or PENDING (held or not) as usp_AsyncExecCancel does (usp_AsyncExecBatchCancelUnstarted,
--     above); RUNNING ones run to their end. The batch ends once nothing is left to end.
--   * otherwise, while every member of the stages released so far has ended: end the batch
--     after its last stage, or release the next stage (enqueue its held calls as
--     usp_AsyncExecInvoke would). A stage whose members were all cancelled already is passed.
-- The batch ends FAILED if a member failed, else CANCELLED if one was cancelled, else SUCCEEDED.
--
-- Why exactly one finisher sees a stage complete, under locking READ COMMITTED or RCSI:
--   1. The batch row is read WITH (UPDLOCK, HOLDLOCK): update locks are incompatible with one
--      another and are held to the end of the transaction, so the settles of one batch run
--      one after the other, each to its commit.
--   2. Every transaction that ends a member changes the member's row before it commits, and
--      takes this same lock before committing (the early lock in each caller, and again here).
--      So when a settle holds the lock, every other member outcome is either committed or
--      not yet written: none is written-but-uncommitted by someone who already passed us.
--   3. The counts below read WITH (READCOMMITTEDLOCK), i.e. with shared locks even under RCSI:
--      they see the latest committed state and wait for any change still uncommitted (a
--      reader's claim marking a member RUNNING) rather than read the version before it.
--      (Under RCSI a plain read would also be right by 1 and 2, since its snapshot is taken
--      when the statement starts, after the lock was granted; the hint keeps the counts right
--      even for a writer that forgot the early lock.)
--   Of two members ending at once, the first settle sees the other still non-terminal and
--   returns; the second waits for the first to commit and then sees both ended: only it
--   releases the next stage. The counts cannot deadlock: nobody waits for the batch lock
--   while holding an uncommitted member change, since each caller takes the batch lock
--   before it touches its own member's row.
-- Locks: see "Cancelling a call" in 0005_activated.sql. This procedure changes other
-- members' rows holding only their row locks (not their application locks): a reader's claim
-- reads its call again WITH (UPDLOCK) after taking the application lock, which waits for us,
-- so it never starts a member cancelled here, and it never sees a held member (no message).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecBatchSettle
    @batchId uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;   -- a failed SEND below must leave the caller's transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @status varchar(10), @onFailure varchar(8), @stageCount int, @currentStage int,
            @end bit = 0, @final varchar(10), @now datetime2(3), @id bigint, @service nvarchar(256), @queue nvarchar(100),
            @h uniqueidentifier, @body xml, @errNumber int, @errMessage nvarchar(4000);
    DECLARE @release TABLE (id bigint PRIMARY KEY, queue nvarchar(100) NULL, service_name nvarchar(256) NULL);

    IF @batchId IS NULL
        RETURN;
    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'usp_AsyncExecBatchSettle runs in the transaction that records a member''s outcome';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50022, @message, 1;
    END;

    SELECT @status = status, @onFailure = on_failure, @stageCount = stage_count, @currentStage = current_stage
    FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
    WHERE id = @batchId;
    IF @status IS NULL OR @status <> 'RUNNING'
        RETURN;

    WHILE 1 = 1
    BEGIN
        IF @onFailure = 'CANCEL'
           AND EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                        WHERE batch_id = @batchId AND status IN ('FAILED', 'CANCELLED'))
        BEGIN
            -- every member not yet started ends CANCELLED, and the dialogs of those that have
            -- one get a wake-up request; RUNNING ones run to their end
            EXEC asyncexec.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId,
                 @reason = N'cancelled: an execution of its batch did not succeed';

            IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                            WHERE batch_id = @batchId AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
                SET @end = 1;
            BREAK;
        END;

        IF EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                    WHERE batch_id = @batchId AND stage <= @currentStage AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
            BREAK;   -- the stage released last is still running
        IF @currentStage >= @stageCount
        BEGIN
            SET @end = 1;
            BREAK;
        END;

        -- Release the next stage: each held call is enqueued exactly as usp_AsyncExecInvoke
        -- enqueues one (a dialog and its request now; PENDING, or WAITING until its own runAt,
        -- for which the reader arms the dialog's timer).
        SET @currentStage += 1;
        UPDATE asyncexec.AsyncExecBatches SET current_stage = @currentStage WHERE id = @batchId;
        DELETE @release;
        INSERT @release (id, queue, service_name)
        SELECT e.id, e.queue, q.service_name
        FROM asyncexec.AsyncExecResults AS e WITH (READCOMMITTEDLOCK)
        LEFT JOIN asyncexec.AsyncExecQueues AS q ON q.name = e.queue
        WHERE e.batch_id = @batchId AND e.stage = @currentStage AND e.held = 1 AND e.status = 'WAITING';

        SET @id = 0;
        WHILE 1 = 1
        BEGIN
            SELECT TOP (1) @id = id, @queue = queue, @service = service_name FROM @release WHERE id > @id ORDER BY id;
            IF @@ROWCOUNT = 0
                BREAK;
            SELECT @h = NULL, @now = SYSUTCDATETIME();
            -- A call that cannot be enqueued (its queue gone, the broker refusing the dialog)
            -- fails alone instead of undoing the outcome that released its stage: that outcome
            -- would otherwise roll back, run again and fail here again for ever.
            SAVE TRANSACTION usp_AsyncExecBatchSettle;
            BEGIN TRY
                IF @service IS NULL
                BEGIN
                    SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
                    SET @message = REPLACE(@message, N'%', N'%%');
                    THROW 50003, @message, 1;
                END;
                BEGIN DIALOG CONVERSATION @h
                    FROM SERVICE [asyncexec/NotifyService]
                    TO SERVICE @service, 'CURRENT DATABASE'
                    ON CONTRACT [asyncexec/Contract]
                    WITH ENCRYPTION = OFF;
                UPDATE asyncexec.AsyncExecResults
                   SET held = 0, initiator_handle = @h,
                       status = CASE WHEN run_at > @now THEN 'WAITING' ELSE 'PENDING' END
                 WHERE id = @id AND held = 1 AND status = 'WAITING';
                SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);
            END TRY
            BEGIN CATCH
                SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
                -- doomed (-1), or ended by the error itself (0): no savepoint is left to return to
                IF XACT_STATE() <> 1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION usp_AsyncExecBatchSettle;
                UPDATE asyncexec.AsyncExecResults
                   SET held = 0, status = 'FAILED', finished_at = @now,
                       error_number = 50013, error_severity = 16, error_state = 1, error_line = NULL, error_procedure = NULL,
                       error_message = LEFT(CONCAT(N'its stage was released but the call could not be enqueued: ',
                                                   @errNumber, N' ', @errMessage), 4000)
                 WHERE id = @id AND held = 1 AND status = 'WAITING';
                INSERT asyncexec.AsyncExecErrors (queue, execution_id, error_number, error_message)
                VALUES (@queue, @id, @errNumber, @errMessage);
            END CATCH;
        END;
        -- and again: the stage just released may have nothing left to run (its members all
        -- cancelled one by one, or failed to enqueue), and a failure may cancel the batch
    END;

    IF @end = 1
    BEGIN
        SET @final = CASE
            WHEN EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                          WHERE batch_id = @batchId AND status = 'FAILED') THEN 'FAILED'
            WHEN EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                          WHERE batch_id = @batchId AND status = 'CANCELLED') THEN 'CANCELLED'
            ELSE 'SUCCEEDED' END;
        UPDATE asyncexec.AsyncExecBatches
           SET status = @final, finished_at = SYSUTCDATETIME()
         WHERE id = @batchId AND status = 'RUNNING';
    END;
END;
