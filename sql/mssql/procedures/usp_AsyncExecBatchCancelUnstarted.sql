-- Cancel every member of a batch that has not started (WAITING, held or not, and PENDING),
-- with @reason as its error message, and wake the activated side of each that has a dialog:
-- the one copy of what usp_AsyncExecBatchSettle's CANCEL branch and usp_AsyncExecCancelBatch
-- (0008_cancel_batch.sql) do to those members. RUNNING members are not touched here.
-- Called only inside its caller's transaction (never a transaction of its own; 50024
-- otherwise), by a caller that holds the batch row WITH (UPDLOCK, HOLDLOCK, ROWLOCK) and
-- settles the batch before it commits (usp_AsyncExecBatchSettle is such a caller itself).
-- Locks: as the settle, this changes members holding only their rows (see the settle below).
-- It reads the candidates first, with no update lock, and then updates each one by its
-- primary key, its status checked again by that UPDATE: so it locks a member's clustered row
-- before that row's IX_AsyncExecResults_batch key, the order a reader's claim takes them
-- (the claim updates the row by id, then its status in every index that carries it). An
-- UPDATE ... WHERE batch_id = @batchId would seek IX_AsyncExecResults_batch with update locks
-- on its keys and then ask for each clustered row: the reverse order, and a deadlock (1205)
-- with a claim of another member of the batch. (Lock Modes: an UPDATE takes U locks on what
-- it reads to find its rows and converts them to X on the rows it changes; SQL Server
-- Deadlocks Guide: take resources in one order.)
-- The SET options are the settle's: activation runs this through the settle.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecBatchCancelUnstarted
    @batchId uniqueidentifier,
    @reason  nvarchar(4000)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;   -- a failed SEND below must leave the caller's transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @now datetime2(3), @id bigint, @h uniqueidentifier, @state char(2), @body xml;
    DECLARE @candidates TABLE (id bigint PRIMARY KEY);
    DECLARE @cancelled TABLE (id bigint PRIMARY KEY, initiator_handle uniqueidentifier NULL);

    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'usp_AsyncExecBatchCancelUnstarted runs in its caller''s transaction, which holds the batch row';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50024, @message, 1;
    END;

    -- As usp_AsyncExecCancel cancels a WAITING or PENDING call (cancel_requested, so a
    -- reader never starts it); the error of an earlier failed attempt gives way to why.
    -- 1. The candidates, read with no update lock (a plain read: under READ_COMMITTED_SNAPSHOT
    --    the committed version, under locking READ COMMITTED shared locks released row by row).
    --    None is missed: whoever makes a member WAITING or PENDING (a retry, a stage release,
    --    a new call of the batch) holds this batch's row first, which our caller holds.
    INSERT @candidates (id)
    SELECT id FROM asyncexec.AsyncExecResults
    WHERE batch_id = @batchId AND status IN ('WAITING', 'PENDING');

    -- 2. Each by primary key, the status checked again by the UPDATE itself: a member being
    --    claimed is waited for (its row is locked) and then found RUNNING, and left alone.
    SET @now = SYSUTCDATETIME();
    SET @id = 0;
    WHILE 1 = 1
    BEGIN
        SELECT TOP (1) @id = id FROM @candidates WHERE id > @id ORDER BY id;
        IF @@ROWCOUNT = 0
            BREAK;
        UPDATE asyncexec.AsyncExecResults
           SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0,
               error_number = NULL, error_severity = NULL, error_state = NULL, error_line = NULL, error_procedure = NULL,
               error_message = @reason
        OUTPUT inserted.id, inserted.initiator_handle INTO @cancelled (id, initiator_handle)
        WHERE id = @id AND batch_id = @batchId AND status IN ('WAITING', 'PENDING');
    END;

    -- Wake the activated side of each cancelled call that has a dialog (held ones have
    -- none), as usp_AsyncExecCancel does: its reader finds it CANCELLED, reports it to
    -- the listener and ends the dialog, instead of waiting for runAt or a retry. SEND
    -- needs the initiator side open (STARTED_OUTBOUND or CONVERSING).
    SET @id = 0;
    WHILE 1 = 1
    BEGIN
        SELECT TOP (1) @id = id, @h = initiator_handle FROM @cancelled
        WHERE id > @id AND initiator_handle IS NOT NULL ORDER BY id;
        IF @@ROWCOUNT = 0
            BREAK;
        SET @state = NULL;
        SELECT @state = state FROM sys.conversation_endpoints WHERE conversation_handle = @h;
        IF @state IN ('SO', 'CO')
        BEGIN
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            -- a savepoint name of our own (at most 32 characters): the caller's may be on the stack
            SAVE TRANSACTION AsyncExecBatchCancelUnstarted;
            BEGIN TRY
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);
            END TRY
            BEGIN CATCH
                -- the cancel stands without the wake-up: the call's own request or timer ends it
                -- doomed (-1), or ended by the error itself (0): no savepoint is left to return to
                IF XACT_STATE() <> 1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION AsyncExecBatchCancelUnstarted;
                INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
                VALUES (@id, @h, ERROR_NUMBER(), ERROR_MESSAGE());
            END CATCH;
        END;
    END;
END;
