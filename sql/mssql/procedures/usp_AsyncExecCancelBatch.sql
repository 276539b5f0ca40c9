-- Cancelling a whole batch (the service's cancelBatch; docs/mssql.md, "Batches").
--
-- Step one, usp_AsyncExecCancelBatch, in ONE transaction of its own:
--   1. lock the batch row WITH (UPDLOCK, HOLDLOCK, ROWLOCK), as usp_AsyncExecBatchSettle does;
--      no such batch: @outcome NOT_FOUND; the batch is no longer RUNNING: @outcome FINISHED
--      (nothing changed either way);
--   2. every member that has not started (WAITING, held or not, and PENDING) ends CANCELLED
--      exactly as the settle's CANCEL branch ends it, by the same procedure,
--      usp_AsyncExecBatchCancelUnstarted (0007_batches.sql: finished_at, cancel_requested,
--      held = 0, the error of an earlier failed attempt cleared, here the message 'cancelled
--      with its batch'), and the dialog of each that has one gets usp_AsyncExecCancel's
--      wake-up request;
--   3. every RUNNING member gets cancel_requested = 1 (only that; its status is not touched):
--      a run that then fails is not retried but ends CANCELLED (usp_AsyncExecRun), and a run
--      lost with its session is never started again (the reader's claim), as after
--      usp_AsyncExecCancel; a run that succeeds keeps SUCCEEDED;
--   4. usp_AsyncExecBatchSettle, in the same transaction: the batch ends now (CANCELLED, or
--      FAILED if a member had failed) unless a member is still RUNNING; @outcome CANCELLED.
-- Step two is the service's, after this transaction has committed and never while holding
-- the batch row: each RUNNING member is cancelled as cancelExecution cancels one
-- (usp_AsyncExecCancel, then KILL only with allowKill=true, then usp_AsyncExecSettleCancel);
-- without allowKill they run to their end. Whatever ends them (usp_AsyncExecRun,
-- usp_AsyncExecSettleCancel, the reader) settles the batch, which then ends.
--
-- Locks. The documented order is: a call's conversation group, its application lock, the
-- batch row, the call's row (0005_activated.sql, "Cancelling a call"; 0007_batches.sql).
-- usp_AsyncExecCancel takes one call's application lock (waiting up to five seconds) and
-- only then the batch row. Taking the application lock of every member here, one after the
-- other, would either wait for application locks while holding earlier ones (and, if taken
-- after the batch row, invert the order against usp_AsyncExecCancel, usp_AsyncExecAbandon
-- and the reader, who hold a call's lock while they wait for the batch row: a deadlock).
-- So this procedure takes NO application lock at all: it holds the batch row and changes
-- members holding only their rows, exactly as usp_AsyncExecBatchSettle's CANCEL branch does
-- (through the same usp_AsyncExecBatchCancelUnstarted).
-- That is safe for the same reason: a reader's claim takes the call's application lock and
-- then reads the call again WITH (UPDLOCK), which waits for our uncommitted change and then
-- finds CANCELLED, so it never starts a member cancelled here; a held member has no message,
-- so no reader ever sees it. Every path that ends a member takes the batch row before the
-- member's row, so while we hold the batch row nobody holds (or waits for) a member row of
-- ours while waiting for the batch.
-- A claim (PENDING or due WAITING to RUNNING) never asks for the batch row, but it DOES take
-- locks step 2 needs: it locks the member's clustered row first (its UPDATE by id) and then
-- the member's key in IX_AsyncExecResults_batch (that index INCLUDEs status). The comment of
-- 0008_cancel_batch.sql said "the only member-row locks we can wait for are a claim's ... it
-- never asks for the batch row and commits at once", i.e. that a claim never takes a lock we
-- need; that was wrong while step 2 was one UPDATE ... WHERE batch_id = @batchId, which took
-- update locks on IX_AsyncExecResults_batch keys before the clustered rows: the reverse order,
-- a deadlock (1205) with a claim of another member (issue 11, item 3). Migrations never
-- change once landed, so 0008 keeps that text; this file is the definition that counts.
-- usp_AsyncExecBatchCancelUnstarted now reads the candidates with no update lock and updates
-- each by primary key (clustered row first, the claim's order), its status checked again.
-- Step 3 may keep its UPDATE by batch_id: once step 2 has left no member WAITING or PENDING,
-- no claim can start on this batch, and every other path that changes a RUNNING member (its
-- run's outcome, a recovering claim, usp_AsyncExecCancel) takes the batch row, ours, before
-- the member's row; the service's kill step holds a RUNNING row (UPDLOCK) but waits for
-- nothing of ours. Under READ_COMMITTED_SNAPSHOT too, an UPDATE selects its rows with a
-- blocking scan that takes update locks, so a member being claimed is seen as it is
-- committed (RUNNING), not as the version before (PENDING); step 2's candidate read may see
-- the version before, and its UPDATE by id checks the status again.
--
-- Errors (THROW, severity 16): 50005 BAD_USER_INPUT no batch id; 50023 called inside an open
-- transaction (a fault of the caller: the RUNNING members must be cancelled after the commit).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecCancelBatch
    @batchId uniqueidentifier,
    @outcome varchar(10) = NULL OUTPUT   -- CANCELLED, FINISHED or NOT_FOUND
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
    SET XACT_ABORT OFF;   -- a failed wake-up SEND (step 2) must leave our transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @status varchar(10);
    SET @outcome = NULL;

    IF @batchId IS NULL
    BEGIN
        SET @message = N'a batch id is required';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @@TRANCOUNT > 0
    BEGIN
        SET @message = N'usp_AsyncExecCancelBatch runs in a transaction of its own (its running members are cancelled after it commits)';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50023, @message, 1;
    END;

    BEGIN TRY
        BEGIN TRANSACTION;
        -- 1. the batch row, before any member row (lock order above)
        SELECT @status = status
        FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE id = @batchId;
        IF @status IS NULL OR @status <> 'RUNNING'
        BEGIN
            ROLLBACK TRANSACTION;   -- nothing changed
            SET @outcome = CASE WHEN @status IS NULL THEN 'NOT_FOUND' ELSE 'FINISHED' END;
            RETURN;
        END;

        -- 2. every member not yet started, as the settle's CANCEL branch cancels it (the same
        --    procedure: cancel_requested, so a reader never starts it; a wake-up request on
        --    the dialog of each that has one)
        EXEC asyncexec.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId, @reason = N'cancelled with its batch';

        -- 3. RUNNING members: no retry after a failure, no new run after a lost session. Step 2
        --    left no member WAITING or PENDING, so none can start now; and whoever ends,
        --    retries or adds a member takes the batch row (ours) first: these are exactly the
        --    members RUNNING when step 2's UPDATE ended, before its wake-up requests.
        UPDATE asyncexec.AsyncExecResults
           SET cancel_requested = 1
         WHERE batch_id = @batchId AND status = 'RUNNING' AND cancel_requested = 0;

        -- 4. the batch ends here unless a member is still RUNNING (then whoever ends the
        --    last one settles it); the settle finds the batch row locked by us already
        EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
        COMMIT TRANSACTION;
        SET @outcome = 'CANCELLED';
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
