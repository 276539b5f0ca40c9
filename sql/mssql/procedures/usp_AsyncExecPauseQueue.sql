-- Pause a queue (@paused = 1) or resume it (@paused = 0) (0019_queue_pause.sql; docs/mssql.md,
-- "Pausing a queue"). A paused queue still takes calls: usp_AsyncExecInvoke sends their requests
-- as ever, and the queue's reader (usp_AsyncExecActivated) receives them and every other message
-- of the queue (cancels, the lease and runAt timers), but starts no call of it: it arms the call's
-- dialog timer instead (5 minutes), and writes nothing. Calls running at the pause end as they would.
-- A resume commits the flag first, then wakes each waiting call of the queue at once, as
-- usp_AsyncExecCancel wakes a call: a request on its dialog, in transactions of @chunk calls.
-- Messages sent in a transaction are delivered once it commits, after the flag's, so the reader
-- that receives one reads the queue as resumed. The wake-ups stop after @budgetMs, below the
-- driver's request timeout; a call not woken then starts when its timer fires.
-- Errors: 50005 @paused NULL; 50006 no queue of that name (nothing changes); 50020 the
-- configuration lock was not granted within 10 s (as usp_AsyncExecCreateQueue: try again).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPauseQueue
    @name     nvarchar(100),
    @paused   bit,
    @chunk    int = 500,
    @budgetMs int = 8000
AS
BEGIN
    SET NOCOUNT ON;
    -- any error rolls its transaction back, a client's attention included (see
    -- usp_AsyncExecCreateQueue: an attention is not caught by TRY...CATCH)
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @lock int, @initiator uniqueidentifier, @id bigint, @after bigint = 0,
            @body xml, @deadline datetime2(3) = DATEADD(millisecond, @budgetMs, SYSUTCDATETIME()), @n int;
    DECLARE @waiting TABLE (id bigint PRIMARY KEY, initiator uniqueidentifier NOT NULL);
    IF @paused IS NULL
    BEGIN
        SET @message = N'@paused is 1 (pause) or 0 (resume)';
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
    UPDATE asyncexec.AsyncExecQueues SET paused = @paused WHERE name = @name;
    IF @@ROWCOUNT = 0
    BEGIN
        SET @message = CONCAT(N'no queue named "', @name, N'"');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50006, @message, 1;
    END;
    COMMIT TRANSACTION;

    -- Wake every call of the queue a paused reader may have left waiting on its timer: PENDING, or
    -- WAITING and due, not held by its batch stage (a held call has no dialog yet). Its request goes
    -- on the initiator side, which usp_AsyncExecInvoke (or the recovery) began; SEND needs that side
    -- open (STARTED_OUTBOUND or CONVERSING), as in usp_AsyncExecCancel: otherwise the dialog is
    -- ending, and its call is not waiting for a request. A call woken that a reader started
    -- meanwhile takes the request as a cancel's wake-up: its reader sees it RUNNING and holds it.
    -- A fault of a wake-up (a dialog ended under it) rolls back that chunk's requests alone and
    -- stops the wake-ups, logged in AsyncExecErrors as usp_AsyncExecCancel logs one: the resume
    -- stands (committed above), and those calls start when their timers fire.
    BEGIN TRY
    WHILE @paused = 0 AND SYSUTCDATETIME() < @deadline
    BEGIN
        DELETE @waiting;
        INSERT @waiting (id, initiator)
        SELECT TOP (@chunk) e.id, e.initiator_handle
        FROM asyncexec.AsyncExecResults AS e
        JOIN sys.conversation_endpoints AS c ON c.conversation_handle = e.initiator_handle
        WHERE e.queue = @name AND e.id > @after AND e.held = 0 AND c.state IN ('SO', 'CO')
          AND (e.status = 'PENDING' OR (e.status = 'WAITING' AND e.run_at <= SYSUTCDATETIME()))
        ORDER BY e.id;
        SET @n = @@ROWCOUNT;
        IF @n = 0
            BREAK;
        BEGIN TRANSACTION;
        WHILE 1 = 1
        BEGIN
            SELECT TOP (1) @id = w.id, @initiator = w.initiator FROM @waiting AS w WHERE w.id > @after ORDER BY w.id;
            IF @@ROWCOUNT = 0
                BREAK;
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            SEND ON CONVERSATION @initiator MESSAGE TYPE [asyncexec/Request] (@body);
            SET @after = @id;
        END;
        COMMIT TRANSACTION;
        IF @n < @chunk
            BREAK;
    END;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
        VALUES (@name, @id, @initiator, ERROR_NUMBER(), ERROR_MESSAGE());
    END CATCH;
END;
