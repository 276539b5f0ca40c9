-- Pause a queue (@paused = 1) or resume it (@paused = 0) (0019_queue_pause.sql; docs/mssql.md,
-- "Pausing a queue"). A paused queue still takes calls: usp_AsyncExecInvoke sends their requests
-- as ever, and the queue's reader (usp_AsyncExecActivated) receives them and every other message
-- of the queue (cancels, the lease and runAt timers), but starts no call of it: it arms the call's
-- dialog timer instead (5 minutes), and writes nothing. Calls running at the pause end as they would.
-- A resume of a paused queue commits the flag first, then wakes each waiting call of the queue at
-- once, as usp_AsyncExecCancel wakes a call: a request on its dialog, in transactions of @chunk
-- calls. Messages sent in a transaction are delivered once it commits, after the flag's, so the
-- reader that receives one reads the queue as resumed. The wake-ups stop after @budgetMs (counted
-- from the flag's commit), below the driver's request timeout; a call not woken then starts when its
-- timer fires. @woken: how many were woken.
-- Errors: 50005 @paused NULL, or @chunk or @budgetMs not positive; 50006 no queue of that name
-- (nothing changes); 50020 the configuration lock was not granted within 10 s (as
-- usp_AsyncExecCreateQueue: try again).
-- EXECUTE AS OWNER, as usp_AsyncExecInvoke: the wake-ups read sys.conversation_endpoints, which
-- shows a caller without rights on the dialogs nothing (a resume would then wake no call).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPauseQueue
    @name     nvarchar(100),
    @paused   bit,
    @chunk    int = 500,
    @budgetMs int = 8000,
    @woken    int = NULL OUTPUT
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    -- any error rolls its transaction back, a client's attention included (see
    -- usp_AsyncExecCreateQueue: an attention is not caught by TRY...CATCH)
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @lock int, @initiator uniqueidentifier, @id bigint, @after bigint = 0,
            @body xml, @deadline datetime2(3), @n int, @sent int, @state char(2);
    DECLARE @waiting TABLE (id bigint PRIMARY KEY, initiator uniqueidentifier NOT NULL);
    DECLARE @was TABLE (paused bit NOT NULL);
    SET @woken = 0;
    IF @paused IS NULL OR @chunk IS NULL OR @chunk < 1 OR @budgetMs IS NULL OR @budgetMs < 1
    BEGIN
        SET @message = N'@paused is 1 (pause) or 0 (resume); @chunk and @budgetMs are positive';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    BEGIN TRANSACTION;
    -- one change of a queue's settings at a time, with usp_AsyncExecCreateQueue's (its resource)
    EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/configure-queue', @LockMode = 'Exclusive',
                                   @LockOwner = 'Transaction', @LockTimeout = 10000;
    IF @lock < 0
    BEGIN
        SET @message = N'could not take the queue configuration lock within 10 seconds (another configuration is running): try again';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50020, @message, 1;
    END;
    UPDATE asyncexec.AsyncExecQueues SET paused = @paused OUTPUT deleted.paused INTO @was (paused) WHERE name = @name;
    IF @@ROWCOUNT = 0
    BEGIN
        SET @message = CONCAT(N'no queue named "', @name, N'"');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50006, @message, 1;
    END;
    COMMIT TRANSACTION;
    -- a pause, or a resume of a queue that was not paused: nothing waits to be woken
    IF @paused = 1 OR NOT EXISTS (SELECT 1 FROM @was WHERE paused = 1)
        RETURN;

    -- Wake every call of the queue a paused reader may have left waiting on its timer: PENDING, or
    -- WAITING and due, not held by its batch stage (a held call has no dialog yet). Its request goes
    -- on the initiator side, which usp_AsyncExecInvoke (or the recovery) began. As in
    -- usp_AsyncExecCancel, each SEND is made only while that side is open (STARTED_OUTBOUND or
    -- CONVERSING: read again just before it, the dialog may have ended since the chunk was read),
    -- under a savepoint with XACT_ABORT OFF, so a SEND that fails anyway rolls back alone and is
    -- logged, and the other wake-ups go on. A call woken that a reader started meanwhile takes the
    -- request as a cancel's wake-up: its reader sees it RUNNING and holds it. No attention can come
    -- here: the budget ends the loop well within the driver's request timeout.
    SET XACT_ABORT OFF;
    SET @deadline = DATEADD(millisecond, @budgetMs, SYSUTCDATETIME());
    WHILE SYSUTCDATETIME() < @deadline
    BEGIN
        DELETE @waiting;
        INSERT @waiting (id, initiator)
        SELECT TOP (@chunk) e.id, e.initiator_handle
        FROM asyncexec.AsyncExecResults AS e
        WHERE e.queue = @name AND e.id > @after AND e.held = 0 AND e.initiator_handle IS NOT NULL
          AND (e.status = 'PENDING' OR (e.status = 'WAITING' AND e.run_at <= SYSUTCDATETIME()))
        ORDER BY e.id;
        SET @n = @@ROWCOUNT;
        IF @n = 0
            BREAK;
        SET @sent = 0;
        BEGIN TRANSACTION;
        WHILE 1 = 1
        BEGIN
            SELECT TOP (1) @id = w.id, @initiator = w.initiator FROM @waiting AS w WHERE w.id > @after ORDER BY w.id;
            IF @@ROWCOUNT = 0
                BREAK;
            SET @after = @id;
            SET @state = NULL;
            SELECT @state = state FROM sys.conversation_endpoints WHERE conversation_handle = @initiator;
            IF @state NOT IN ('SO', 'CO') OR @state IS NULL
                CONTINUE;
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            SAVE TRANSACTION usp_AsyncExecPauseQueue;
            BEGIN TRY
                SEND ON CONVERSATION @initiator MESSAGE TYPE [asyncexec/Request] (@body);
                SET @sent += 1;
            END TRY
            BEGIN CATCH
                -- doomed: only a full rollback is possible, and the calls of this chunk wait for their timers;
                -- an error that ended the transaction itself (XACT_STATE() = 0) leaves no savepoint to return to
                IF XACT_STATE() = -1
                    ROLLBACK TRANSACTION;
                ELSE IF XACT_STATE() = 1
                    ROLLBACK TRANSACTION usp_AsyncExecPauseQueue;
                INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
                VALUES (@name, @id, @initiator, ERROR_NUMBER(), ERROR_MESSAGE());
                IF @@TRANCOUNT = 0
                    RETURN;
            END CATCH;
        END;
        COMMIT TRANSACTION;
        SET @woken += @sent;
        IF @n < @chunk
            BREAK;
    END;
END;
