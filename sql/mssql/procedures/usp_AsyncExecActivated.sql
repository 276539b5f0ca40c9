-- The reader of one queue (called by that queue's parameterless activation procedure).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecActivated
    @queue nvarchar(100)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @receive nvarchar(max), @h uniqueidentifier, @type sysname, @body varbinary(max), @id bigint,
            @status varchar(10), @runAt datetime2(3), @recoveries int, @cancel bit, @lease int, @lock int, @locked bit,
            @run bit, @end bit, @timer int, @resource nvarchar(255), @cursor varchar(18), @newStatus varchar(10), @reply xml,
            @errNumber int, @errMessage nvarchar(4000), @now datetime2(3), @concurrency int, @batchId uniqueidentifier,
            @batchStatus varchar(10), @rows int, @transactional bit, @registeredTransactional bit, @transient bit,
            @paused bit;
    DECLARE @changed TABLE (v binary(8) NULL, status varchar(10) NULL);

    SELECT @receive = N'WAITFOR (RECEIVE TOP (1) @h = conversation_handle, @type = message_type_name, @body = message_body FROM asyncexec.'
                    + QUOTENAME(queue_object) + N'), TIMEOUT 1000;',
           @concurrency = concurrency
    FROM asyncexec.AsyncExecQueues
    WHERE name = @queue;
    IF @receive IS NULL
        RETURN;

    -- Drain the queue, then return: activation starts readers (up to MAX_QUEUE_READERS)
    -- only while the queue has messages that the running readers do not keep up with,
    -- and starts one again when a new message arrives after they have all returned.
    WHILE 1 = 1
    BEGIN
        -- A lowered MAX_QUEUE_READERS "does not affect instances of the activation stored
        -- procedure currently running" (ALTER QUEUE), and a reader under steady load never
        -- finds its queue empty. So every reader started under a higher limit returns
        -- (between calls: it holds no transaction and no lock here); activation then
        -- starts readers again only up to the new limit.
        IF (SELECT concurrency FROM asyncexec.AsyncExecQueues WHERE name = @queue) < @concurrency
            RETURN;
        SELECT @h = NULL, @type = NULL, @body = NULL, @id = NULL, @status = NULL, @run = 0, @end = 0, @timer = NULL,
               @locked = 0, @resource = NULL, @errNumber = NULL, @errMessage = NULL, @newStatus = NULL, @cancel = NULL,
               @batchId = NULL;
        SELECT @transactional = NULL, @registeredTransactional = NULL, @transient = 0, @paused = NULL;
        DELETE @changed;
        BEGIN TRY
            BEGIN TRANSACTION;
            -- RECEIVE takes the next message whose conversation group no other transaction
            -- holds, and locks that group until we commit.
            EXEC sys.sp_executesql @receive, N'@h uniqueidentifier OUTPUT, @type sysname OUTPUT, @body varbinary(max) OUTPUT',
                 @h = @h OUTPUT, @type = @type OUTPUT, @body = @body OUTPUT;
            IF @h IS NULL
            BEGIN
                COMMIT TRANSACTION;
                BREAK;
            END;

            IF @type = N'asyncexec/Request'
            BEGIN
                SET @id = CAST(@body AS xml).value('(/request/@id)[1]', 'bigint');
                -- (a second request on a dialog is usp_AsyncExecCancel's wake-up call: same handle)
                UPDATE asyncexec.AsyncExecResults SET target_handle = @h
                 WHERE id = @id AND (target_handle IS NULL OR target_handle <> @h);
            END
            ELSE
                SELECT @id = id FROM asyncexec.AsyncExecResults WHERE target_handle = @h;

            SELECT @status = e.status, @runAt = e.run_at, @recoveries = e.recoveries, @batchId = e.batch_id,
                   @lease = 60 + COALESCE(CEILING(r.timeout_ms / 1000.0), 0),
                   -- how a run that starts now is made (the registration), and how the last one was
                   -- (NULL: none started, or one from before 0011_run.sql, when every run was)
                   @registeredTransactional = COALESCE(r.transactional, 1), @transactional = COALESCE(e.transactional, 1)
            FROM asyncexec.AsyncExecResults AS e
            LEFT JOIN asyncexec.AsyncExecProcedures AS r ON r.name = e.[procedure]
            WHERE e.id = @id;
            SET @lease = COALESCE(@lease, 60);

            IF @type IN (N'http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog',
                         N'http://schemas.microsoft.com/SQL/ServiceBroker/Error')
            BEGIN
                -- The other side ended first (an administrator, or a dialog error): end ours,
                -- and fail the call unless it is finished or a live reader holds it.
                IF @type = N'http://schemas.microsoft.com/SQL/ServiceBroker/Error'
                    SELECT @errNumber = b.x.value('(/*:Error/*:Code)[1]', 'int'),
                           @errMessage = b.x.value('(/*:Error/*:Description)[1]', 'nvarchar(3000)')
                    FROM (SELECT CAST(@body AS xml)) AS b (x);
                IF @status IN ('PENDING', 'WAITING', 'RUNNING')
                BEGIN
                    SET @resource = CONCAT(N'asyncexec/', @id);
                    EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0;
                    IF @lock >= 0
                    BEGIN
                        SET @locked = 1;
                        -- a batch member locks its batch before its own row (see the header)
                        IF @batchId IS NOT NULL
                            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                            WHERE id = @batchId;
                        SET @now = SYSUTCDATETIME();
                        UPDATE asyncexec.AsyncExecResults
                           SET status = 'FAILED', finished_at = @now, error_number = 50011, error_severity = 16, error_state = 1,
                               error_line = NULL, error_procedure = NULL,   -- not those of an earlier attempt's error
                               error_message = CONCAT(N'the call''s dialog ended before the call finished',
                                                      N': ' + CAST(@errNumber AS nvarchar(11)) + N' ' + @errMessage)
                        -- the status read above may be stale (usp_AsyncExecCancel): the UPDATE
                        -- checks the latest committed one
                        WHERE id = @id AND status IN ('PENDING', 'WAITING', 'RUNNING');
                        SET @rows = @@ROWCOUNT;
                        IF @rows > 0
                        BEGIN
                            -- RUNNING with its lock free: the session that ran it is gone
                            UPDATE asyncexec.AsyncExecAttempts
                               SET status = 'LOST', finished_at = @now
                             WHERE execution_id = @id AND status = 'RUNNING';
                            IF @batchId IS NOT NULL
                                EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
                        END;
                    END;
                END;
                -- Never end a dialog before the call's final status is committed: a live reader
                -- that holds a RUNNING call ends the dialog itself with the outcome it records
                -- (ending it here would take its lease timer, and leave the call RUNNING for ever
                -- if that reader then died); a call whose lock is held only for a moment (a cancel)
                -- is looked at again shortly. Ended when the call is finished, or failed above.
                IF @locked = 1 OR @status IS NULL OR @status NOT IN ('PENDING', 'WAITING', 'RUNNING')
                    SET @end = 1;
                ELSE IF @status <> 'RUNNING'
                    SET @timer = 5;
            END
            ELSE IF @status IS NULL OR @status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
            BEGIN
                SET @end = 1;   -- nothing to run: a late timer, a purged call, or a cancelled one
                -- A call cancelled while WAITING or PENDING (usp_AsyncExecCancel) never starts:
                -- its request, its timer or the cancel's own request brings it here, and its
                -- CANCELLED goes to the listener like any other outcome before the dialog ends.
                INSERT @changed (v, status)
                SELECT row_version, status FROM asyncexec.AsyncExecResults WHERE id = @id AND status = 'CANCELLED';
            END
            ELSE IF @status = 'WAITING' AND @runAt > SYSUTCDATETIME()
                -- TIMEOUT is an int of seconds: a runAt decades away would overflow it and
                -- fail this message for good. Wait at most a day; the timer is armed again
                -- when it fires early (this branch).
                SET @timer = CAST(CEILING(IIF(DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt) > 86400000, 86400000,
                                              DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt)) / 1000.0) AS int);
            ELSE
            BEGIN
                -- PENDING, WAITING and due, or RUNNING whose lease ran out: is its reader gone?
                SET @resource = CONCAT(N'asyncexec/', @id);
                EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0;
                IF @lock < 0
                    SET @timer = @lease;   -- a live reader still runs it: look again later
                ELSE
                BEGIN
                    SET @locked = 1;
                    -- Only a call RUNNING before (its run lost) can end here (FAILED after five
                    -- losses, CANCELLED after a cancel's kill): RUNNING is set and left only by
                    -- holders of the conversation group, which is ours, so the status read above
                    -- tells. A batch member then locks its batch before its row (see the header).
                    IF @batchId IS NOT NULL AND @status = 'RUNNING'
                        SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                        WHERE id = @batchId;
                    -- Read the call again, now that we hold its lock: usp_AsyncExecCancel cancels
                    -- a WAITING or PENDING call holding this lock (not the conversation group), and
                    -- usp_AsyncExecBatchSettle holding its row, so the status read above may be
                    -- stale. UPDLOCK reads the latest committed row and keeps it until we commit.
                    SELECT @status = status, @runAt = run_at, @recoveries = recoveries, @cancel = cancel_requested,
                           @transactional = COALESCE(transactional, 1)
                    FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
                    WHERE id = @id;
                    -- the queue paused (usp_AsyncExecPauseQueue), as last committed: a pause that
                    -- commits after this read lets this one start, as a claim already under way
                    SELECT @paused = paused FROM asyncexec.AsyncExecQueues WHERE name = @queue;
                    SET @newStatus = CASE WHEN @status IS NULL OR @status NOT IN ('PENDING', 'WAITING', 'RUNNING') THEN NULL
                                          WHEN @status = 'WAITING' AND @runAt > SYSUTCDATETIME() THEN 'WAITING'
                                          -- cancel asked for and its session gone (killed): never run it again
                                          WHEN @cancel = 1 THEN 'CANCELLED'
                                          WHEN @status = 'RUNNING' AND @recoveries + 1 >= 5 THEN 'FAILED'
                                          -- a non-transactional run lost mid-call may have committed part of
                                          -- its work: never run it again (RegisterOptions.transactional)
                                          WHEN @status = 'RUNNING' AND @transactional = 0 THEN 'FAILED'
                                          -- not started while its queue is paused: nothing is written, and the
                                          -- dialog's timer looks again (usp_AsyncExecPauseQueue's resume sends
                                          -- a request at once). A lost run (RUNNING) is started again: it had
                                          -- begun before, as a call running at the pause ends as it would.
                                          WHEN @status IN ('PENDING', 'WAITING') AND @paused = 1 THEN 'PAUSED'
                                          ELSE 'RUNNING' END;
                    IF @newStatus IS NULL
                    BEGIN
                        SET @end = 1;   -- cancelled (or finished) since the read above: never start it
                        INSERT @changed (v, status)
                        SELECT row_version, status FROM asyncexec.AsyncExecResults WHERE id = @id AND status = 'CANCELLED';
                    END
                    ELSE IF @newStatus = 'WAITING'
                        SET @timer = CAST(CEILING(IIF(DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt) > 86400000, 86400000,
                                                      DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt)) / 1000.0) AS int);
                    ELSE IF @newStatus = 'PAUSED'
                        -- a safety net only: the resume wakes the call at once. Long, so that a long
                        -- pause of many calls costs their reader one message each every 5 minutes.
                        SET @timer = 300;
                    ELSE
                    BEGIN
                        SET @now = SYSUTCDATETIME();
                        UPDATE asyncexec.AsyncExecResults
                           SET status = @newStatus,
                               started_at = CASE WHEN @newStatus = 'RUNNING' THEN @now ELSE started_at END,
                               finished_at = CASE WHEN @newStatus IN ('FAILED', 'CANCELLED') THEN @now END,
                               attempts = attempts + CASE WHEN @newStatus = 'RUNNING' AND status <> 'RUNNING' THEN 1 ELSE 0 END,
                               recoveries = recoveries + CASE WHEN status = 'RUNNING' THEN 1 ELSE 0 END,
                               session_id = CASE WHEN @newStatus = 'RUNNING' THEN @@SPID ELSE session_id END,
                               worker = CASE WHEN @newStatus = 'RUNNING' THEN CONCAT(N'session ', @@SPID) ELSE worker END,
                               transactional = CASE WHEN @newStatus = 'RUNNING' THEN @registeredTransactional ELSE transactional END,
                               error_number = CASE WHEN @newStatus = 'FAILED' AND @transactional = 0 THEN 50015
                                                   WHEN @newStatus = 'FAILED' THEN 50010 ELSE error_number END,
                               error_severity = CASE WHEN @newStatus = 'FAILED' THEN 16 ELSE error_severity END,
                               error_state = CASE WHEN @newStatus = 'FAILED' THEN 1 ELSE error_state END,
                               -- the 50010/50015 failure is not the earlier attempt's error: no line, no procedure
                               error_line = CASE WHEN @newStatus = 'FAILED' THEN NULL ELSE error_line END,
                               error_procedure = CASE WHEN @newStatus = 'FAILED' THEN NULL ELSE error_procedure END,
                               error_message = CASE WHEN @newStatus = 'FAILED' AND @transactional = 0
                                                    THEN N'the session running this non-transactional call was lost mid-run; it is not run again (its work may be partly committed)'
                                                    WHEN @newStatus = 'FAILED'
                                                    THEN CONCAT(N'the session running this call was lost ', @recoveries + 1, N' times')
                                                    ELSE error_message END
                        OUTPUT inserted.row_version, inserted.status INTO @changed (v, status)
                        WHERE id = @id;
                        -- The execution log, in the same transaction. A call found RUNNING with its
                        -- lock free lost its session: that attempt is LOST. A run that starts now
                        -- is the next attempt (numbers count runs, lost ones included).
                        UPDATE asyncexec.AsyncExecAttempts
                           SET status = 'LOST', finished_at = @now
                         WHERE execution_id = @id AND status = 'RUNNING';
                        IF @newStatus = 'RUNNING'
                            INSERT asyncexec.AsyncExecAttempts (execution_id, number, status, started_at, session_id, worker)
                            SELECT @id, COALESCE(MAX(a.number), 0) + 1, 'RUNNING', @now, @@SPID, CONCAT(N'session ', @@SPID)
                            FROM asyncexec.AsyncExecAttempts AS a
                            WHERE a.execution_id = @id;
                        -- a batch member that ended here (FAILED or CANCELLED) settles its batch
                        IF @batchId IS NOT NULL AND @newStatus IN ('FAILED', 'CANCELLED')
                            EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
                        IF @newStatus = 'RUNNING'
                            SELECT @run = 1, @timer = @lease;   -- the lease: brings the call back if this session dies
                        ELSE
                            SET @end = 1;
                    END;
                END;
            END;

            IF EXISTS (SELECT 1 FROM @changed)
            BEGIN
                SELECT @cursor = CONVERT(varchar(18), v, 1), @newStatus = status FROM @changed;
                SET @reply = (SELECT @id AS [@id], @newStatus AS [@status], @cursor AS [@cursor] FOR XML PATH('status'), TYPE);
                -- Messages of a conversation arrive in the order sent: RUNNING before the outcome.
                -- Not on a dialog whose other side has ended (DI) or errored (ER): SEND fails there,
                -- and the status is a hint (the results row is the truth).
                IF EXISTS (SELECT 1 FROM sys.conversation_endpoints WHERE conversation_handle = @h AND state NOT IN ('DI', 'DO', 'ER', 'CD'))
                BEGIN
                    SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
                END;
            END;
            IF @timer IS NOT NULL
            BEGIN
                BEGIN CONVERSATION TIMER (@h) TIMEOUT = @timer;
            END;
            IF @end = 1
            BEGIN
                END CONVERSATION @h;
            END;
            -- A handled message is progress: earlier failures on this dialog no longer count
            -- towards giving the call up (only consecutive ones do).
            UPDATE asyncexec.AsyncExecErrors SET strike = 0 WHERE conversation_handle = @h AND strike = 1;
            COMMIT TRANSACTION;
            IF @locked = 1 AND @run = 0
                EXEC sys.sp_releaseapplock @Resource = @resource, @LockOwner = 'Session';
        END TRY
        BEGIN CATCH
            SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
            IF XACT_STATE() <> 0
                ROLLBACK TRANSACTION;
            IF @locked = 1
                EXEC sys.sp_releaseapplock @Resource = @resource, @LockOwner = 'Session';
            -- Transient: the same message will very likely be handled on a later try, so it is
            -- no strike against the call. 1205 deadlock victim, 1222 lock request timeout,
            -- 1204 no lock resources, 9002 transaction log full, 1105 filegroup full, 701/802/
            -- 8645/8651 memory, 3960 snapshot update conflict.
            SET @transient = CASE WHEN @errNumber IN (1204, 1205, 1222, 9002, 1105, 701, 802, 8645, 8651, 3960) THEN 1 ELSE 0 END;
            INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, message_type_name, error_number, error_message, strike)
            VALUES (@queue, @id, @h, @type, @errNumber, @errMessage, CASE WHEN @transient = 1 THEN 0 ELSE 1 END);
            -- The message is back on the queue, and RECEIVE returns it first again. Poison-
            -- message handling is off on our queues (ALTER QUEUE: "allows for a custom poison
            -- message handling system to be defined by the application"), so this is ours:
            -- after five failures in a row on one dialog that are not transient (a handled
            -- message resets the count, above), give up on that call instead of letting it hold
            -- up the queue for ever. usp_AsyncExecAbandon never drops a message it cannot
            -- record: it keeps it as a dead letter.
            IF @h IS NOT NULL AND @transient = 0
               AND (SELECT COUNT(*) FROM asyncexec.AsyncExecErrors WHERE conversation_handle = @h AND strike = 1) >= 5
                EXEC asyncexec.usp_AsyncExecAbandon @queue = @queue, @h = @h, @id = @id, @errMessage = @errMessage;
            -- A transient failure (a log that is full stays full a while): pause before the
            -- message is tried again, rather than restarting on it at once.
            IF @transient = 1
                WAITFOR DELAY '00:00:01';
            -- Return instead of spinning on the message: activation starts a reader again
            -- while the queue holds messages.
            RETURN;
        END CATCH;

        IF @run = 1
        BEGIN
            BEGIN TRY
                EXEC asyncexec.usp_AsyncExecRun @id = @id, @h = @h, @lease = @lease;
            END TRY
            BEGIN CATCH
                SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
                IF XACT_STATE() <> 0
                    ROLLBACK TRANSACTION;
                IF APPLOCK_MODE('public', @resource, 'Session') <> 'NoLock'
                    EXEC sys.sp_releaseapplock @Resource = @resource, @LockOwner = 'Session';
                INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, error_number, error_message)
                VALUES (@queue, @id, @h, @errNumber, @errMessage);
            END CATCH;
        END;
    END;
END;
