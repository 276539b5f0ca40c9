-- Recovery of calls whose dialog is gone (docs/mssql.md, "Restored copies and lost
-- conversations"). The service runs it at start-up and then periodically (src/engines/mssql/
-- sweeper.ts); a DBA may run it by hand: EXEC asyncexec.usp_AsyncExecRecover;
--
-- Why. Everything that moves an unfinished call forward arrives on its dialog: the request,
-- the DialogTimer of runAt, of a retry's backoff and of the lease, and the EndDialog/Error that
-- fails it (usp_AsyncExecActivated). Three things remove a call's dialog without a word:
--   * ALTER DATABASE ... SET NEW_BROKER (docs/mssql.md recommends it for restored copies):
--     a new broker identifier, and every conversation endpoint of the database is ended with
--     cleanup; no message is sent to any endpoint (ALTER DATABASE SET Options, "Service
--     Broker options"; ServiceBrokerOption.NewBroker);
--   * an administrator's END CONVERSATION ... WITH CLEANUP: "Removes all messages and catalog
--     view entries for one side of a conversation [...] The other side of the conversation
--     is not notified of the cleanup. SQL Server drops the conversation endpoint, all messages
--     for the conversation in the transmission queue, and all messages for the conversation
--     in the service queue" (END CONVERSATION);
--   * a client timeout during usp_AsyncExecInvoke: the client's attention ends the batch where
--     it is, TRY...CATCH never sees it, so the invoke's savepoint is not rolled back; a caller
--     that catches the timeout and commits (XACT_ABORT OFF) commits the results row without
--     its request (the dialog begun, nothing sent: state SO, no target endpoint).
-- The row stays PENDING, WAITING or RUNNING for ever. This procedure finds such rows and
-- gives each a new dialog and request, exactly as usp_AsyncExecInvoke (and the batch
-- settle's release) begin one: the reader then treats the call as it treats any request.
--
-- Which calls are lost: PENDING, WAITING or RUNNING, not held by their batch stage (held
-- calls have no dialog yet, by design), submitted at least @minAgeSeconds ago, and whose
-- dialog can no longer bring them forward: its target (activated) side is gone or closed and
-- nothing of it waits for delivery (asyncexec.AsyncExecDialogGone, which says why).

-- RUNNING calls. A live reader runs a RUNNING call holding the call's session-owned
-- application lock (usp_AsyncExecActivated, claim); we take that lock with a zero timeout and
-- leave the call alone while anyone holds it: never a second run while the first is alive.
-- A RUNNING call whose lock is free lost its session; its run's writes were rolled back with
-- it, since the call's own writes and its outcome commit in one transaction
-- (usp_AsyncExecRun). The new request brings it to a reader, whose claim applies the rules of
-- the lease recovery and no others: recoveries + 1 and run again, FAILED 50010 after five
-- losses, CANCELLED when its cancel was asked for. So this sweeper decides nothing about
-- running again; whatever the claim decides for a call whose effects may already be committed
-- (a procedure registered to run without a transaction) holds here too.
--
-- Locks, in the claim's order (usp_AsyncExecCancel's header): the call's application lock
-- (zero timeout: we never wait for it, a claim never waits for ours), then its row
-- WITH (UPDLOCK), which waits for an uncommitted claim and reads the latest committed row.
-- The dialog check is made again under both, so a call a reader or usp_AsyncExecCancel moved
-- on meanwhile (new target_handle, a finished status) is left alone. We hold no batch row and
-- change no status, so no batch needs settling. The new dialog is a new conversation group
-- (BEGIN DIALOG without RELATED_CONVERSATION): no conversation group of anyone else is taken.
-- The candidates are read WITH (READPAST): rows an open transaction holds (an invoke not yet
-- committed, under locking READ COMMITTED) are skipped rather than waited for; "READPAST ...
-- skips rows locked by other transactions" (Table Hints). They come back on the next sweep.
--
-- The old endpoints: an initiator side left open (its target gone) is ended, so that the
-- listener never waits on it and the endpoint does not stay for ever; its EndDialog has no
-- live target and is discarded with it or shows in sys.transmission_queue (what a DBA who
-- cleaned up one side should clean up on the other). A message the old target still sends
-- can only be the RUNNING or outcome of a run that was alive, and that run's reader uses
-- the handle it claimed on; a request or timer of the old dialog that turns up later finds
-- target_handle changed, finds no call, and only ends its dialog (usp_AsyncExecActivated).
--
-- Permissions: sys.conversation_endpoints and sys.transmission_queue show only what the
-- current user owns or has a permission on (catalog metadata visibility), and the dialogs
-- are begun by usp_AsyncExecInvoke, which runs as owner. Under EXECUTE AS OWNER (dbo), this
-- procedure and the function it calls see every endpoint of the database, and may SEND on our
-- services and END our conversations, whoever calls it: the service's login needs only EXECUTE
-- on this procedure.
--
-- Output: one row (examined, recovered, skipped: held by a live reader or changed meanwhile,
-- failed: could not be given a dialog, logged to asyncexec.AsyncExecErrors without a
-- message type, so it never counts as a reader's failure on a dialog).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecRecover
    @limit         int = 500,   -- calls examined per run (the oldest first)
    @minAgeSeconds int = 5      -- leave calls submitted this recently alone
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
    SET XACT_ABORT OFF;   -- a failed BEGIN DIALOG or SEND must leave our transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @id bigint, @status varchar(10), @service nvarchar(256), @queue nvarchar(100),
            @initiator uniqueidentifier, @h uniqueidentifier, @body xml, @lock int, @resource nvarchar(255),
            @lost bit, @oldState char(2), @examined int = 0, @recovered int = 0, @skipped int = 0, @failed int = 0,
            @errNumber int, @errMessage nvarchar(4000);
    DECLARE @candidates TABLE (id bigint PRIMARY KEY);

    IF @@TRANCOUNT > 0
    BEGIN
        SET @message = N'usp_AsyncExecRecover runs each call in a transaction of its own: call it outside a transaction';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50042, @message, 1;
    END;
    SET @limit = COALESCE(@limit, 500);
    SET @minAgeSeconds = COALESCE(@minAgeSeconds, 5);

    -- 1. Candidates: unfinished, not held, old enough, their dialog's target side gone.
    INSERT @candidates (id)
    SELECT TOP (@limit) e.id
    FROM asyncexec.AsyncExecResults AS e WITH (READPAST)
    WHERE e.status IN ('PENDING', 'WAITING', 'RUNNING') AND e.held = 0
      AND e.submitted_at < DATEADD(second, -@minAgeSeconds, SYSUTCDATETIME())
      AND EXISTS (SELECT 1 FROM asyncexec.AsyncExecDialogGone(e.initiator_handle, e.target_handle))
    ORDER BY e.id;

    -- 2. Each in a transaction of its own.
    SET @id = 0;
    WHILE 1 = 1
    BEGIN
        SELECT TOP (1) @id = id FROM @candidates WHERE id > @id ORDER BY id;
        IF @@ROWCOUNT = 0
            BREAK;
        SELECT @examined += 1, @status = NULL, @initiator = NULL, @service = NULL, @queue = NULL, @h = NULL, @lost = 0,
               @oldState = NULL, @resource = CONCAT(N'asyncexec/', @id);
        BEGIN TRY
            BEGIN TRANSACTION;
            -- the lock every status change of an unfinished call is made under; a reader that
            -- runs the call holds it (session-owned) for the whole run: then leave the call
            EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 0;
            IF @lock < 0
            BEGIN
                ROLLBACK TRANSACTION;
                SET @skipped += 1;
                CONTINUE;
            END;
            -- UPDLOCK: the latest committed row (a claim may have just recorded a new target_handle), kept until we commit
            SELECT @status = e.status, @initiator = e.initiator_handle, @queue = e.queue, @service = q.service_name,
                   @lost = CASE WHEN e.status IN ('PENDING', 'WAITING', 'RUNNING') AND e.held = 0
                                 AND EXISTS (SELECT 1 FROM asyncexec.AsyncExecDialogGone(e.initiator_handle, e.target_handle))
                                THEN 1 ELSE 0 END
            FROM asyncexec.AsyncExecResults AS e WITH (UPDLOCK, ROWLOCK)
            LEFT JOIN asyncexec.AsyncExecQueues AS q ON q.name = e.queue
            WHERE e.id = @id;
            IF @lost = 0
            BEGIN
                ROLLBACK TRANSACTION;   -- finished, purged, or its dialog is back (a reader moved it on)
                SET @skipped += 1;
                CONTINUE;
            END;
            IF @service IS NULL
            BEGIN
                SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
                SET @message = REPLACE(@message, N'%', N'%%');
                THROW 50003, @message, 1;
            END;

            -- A new dialog and request, as usp_AsyncExecInvoke begins one (same services,
            -- contract and options). The reader arms the timer for runAt or a retry's backoff
            -- (run_at) when the request finds the call WAITING, and a RUNNING call whose lock is
            -- free is recovered by its claim.
            BEGIN DIALOG CONVERSATION @h
                FROM SERVICE [asyncexec/NotifyService]
                TO SERVICE @service, 'CURRENT DATABASE'
                ON CONTRACT [asyncexec/Contract]
                WITH ENCRYPTION = OFF;
            -- target_handle NULL: the next RECEIVE of the request records the new one, and
            -- a message of the old dialog no longer finds this call
            UPDATE asyncexec.AsyncExecResults
               SET initiator_handle = @h, target_handle = NULL
             WHERE id = @id;
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);

            -- the old initiator side, if it is still open, has no target left: end it
            SELECT @oldState = state FROM sys.conversation_endpoints WHERE conversation_handle = @initiator;
            IF @oldState IS NOT NULL AND @oldState <> 'CD'
            BEGIN
                -- a savepoint name of our own (at most 32 characters)
                SAVE TRANSACTION AsyncExecRecoverOld;
                BEGIN TRY
                    END CONVERSATION @initiator;
                END TRY
                BEGIN CATCH
                    -- the new dialog stands without it; the old endpoint is only a leftover
                    -- doomed (-1), or ended by the error itself (0): no savepoint is left to return to
                    IF XACT_STATE() <> 1
                    BEGIN
                        THROW;
                    END;
                    ROLLBACK TRANSACTION AsyncExecRecoverOld;
                    INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
                    VALUES (@queue, @id, @initiator, ERROR_NUMBER(), ERROR_MESSAGE());
                END CATCH;
            END;
            COMMIT TRANSACTION;
            SET @recovered += 1;
        END TRY
        BEGIN CATCH
            SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
            IF XACT_STATE() <> 0
                ROLLBACK TRANSACTION;
            -- logged with no message type: a reader's failures on a dialog are counted by those
            -- that have one (usp_AsyncExecActivated), and this is none of them
            INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
            VALUES (@queue, @id, @initiator, @errNumber,
                    LEFT(CONCAT(N'usp_AsyncExecRecover could not give the call a new dialog: ', @errMessage), 4000));
            SET @failed += 1;
        END CATCH;
    END;

    SELECT @examined AS examined, @recovered AS recovered, @skipped AS skipped, @failed AS failed;
END;
