-- The activated side: usp_AsyncExecActivated receives, usp_AsyncExecRun runs one call.
--
-- A call goes through two transactions on its reader's session:
--   1. claim  (usp_AsyncExecActivated): RECEIVE the message, mark the call RUNNING,
--      take a session-owned application lock on it, arm the dialog's timer as a lease,
--      SEND the RUNNING change, COMMIT. The message is consumed for good here.
--   2. run    (usp_AsyncExecRun): run the call under a savepoint, record the outcome,
--      SEND it and END the dialog, COMMIT: the call's own writes, its outcome and its
--      completion message commit together.
-- Committing the claim first keeps RUNNING visible (and readers unblocked) while a
-- call runs, and means a call that dooms its transaction can never return its
-- message to the queue: Service Broker disables a queue after five rollbacks of a
-- RECEIVE in a row (poison-message handling), which is also switched off on our queues.
-- If the reader dies mid-run, its transaction rolls back, its session lock goes away,
-- and the lease timer's DialogTimer message brings the call back (counted as a recovery).
--
-- The execution log (asyncexec.AsyncExecAttempts) is written in these same transactions:
-- the claim inserts the attempt (RUNNING, next number, @@SPID); the run closes it
-- SUCCEEDED or FAILED with the outcome (FAILED also when a retry follows); a claim that
-- finds the call RUNNING with its lock free, an EndDialog/Error on a call nobody runs, and
-- usp_AsyncExecAbandon close the running attempt as LOST, and so does usp_AsyncExecSettleCancel
-- for a run killed by a cancel (see "Cancelling a call" below).

-- Errors recorded on calls: 50001 the procedure disappeared, 50010 the call's session
-- was lost five times, 50011 the call's dialog ended before the call finished, 50012 the
-- call's messages could not be handled five times (our own poison-message handling).
--
-- SET options: an activated procedure runs on a background session with "the default
-- options for the database" (Internal Activation Context), which are OFF for
-- ANSI_WARNINGS, ANSI_PADDING, ARITHABORT and CONCAT_NULL_YIELDS_NULL unless the
-- database was altered. xml data type methods (.value below) fail unless these are ON
-- and NUMERIC_ROUNDABORT is OFF, and our string building relies on NULL + text = NULL.
-- So every procedure here sets them itself (ANSI_NULLS and QUOTED_IDENTIFIER are fixed
-- when a procedure is created; the migrator's connection has both ON). The called
-- procedures inherit them, i.e. they run with the options an ordinary client has.

CREATE PROCEDURE asyncexec.usp_AsyncExecRun
    @id    bigint,
    @h     uniqueidentifier,   -- the target side of the call's dialog
    @lease int                 -- seconds
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;   -- a call's ordinary error must leave our transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @args nvarchar(max), @registered nvarchar(261), @target nvarchar(300), @names nvarchar(max),
            @declare nvarchar(max), @assign nvarchar(max), @execArgs nvarchar(max), @outputs nvarchar(max),
            @types nvarchar(max), @sql nvarchar(max), @result nvarchar(max), @failed bit = 0,
            @errNumber int, @errSeverity int, @errState int, @errLine int, @errProcedure nvarchar(128), @errMessage nvarchar(4000),
            @attempts int, @maxAttempts int, @cancel bit, @status varchar(10), @retryIn int, @cursor varchar(18), @reply xml,
            @now datetime2(3), @resource nvarchar(255) = CONCAT(N'asyncexec/', @id);
    DECLARE @changed TABLE (v binary(8));

    SELECT @args = e.arguments, @registered = e.[procedure],
           @target = CASE WHEN OBJECT_ID(QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name), N'P') IS NOT NULL
                          THEN QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name) END
    FROM asyncexec.AsyncExecResults AS e
    LEFT JOIN asyncexec.AsyncExecProcedures AS r ON r.name = e.[procedure]
    WHERE e.id = @id;

    -- The call as a batch of its own: one variable @p<position> per parameter, typed from
    -- sys.parameters, filled from the JSON arguments with the same conversion invoke
    -- checked; the procedure called by position (DEFAULT where an optional argument is
    -- left out). The text holds only catalog names and types (QUOTENAME'd) and our
    -- numbers; argument names and values reach it only as the parameters @__args/@__names.
    DECLARE @p TABLE (position int, idx int, name nvarchar(128), base_type nvarchar(128), type_text nvarchar(128), is_output bit, present bit);
    INSERT @p (position, idx, name, base_type, type_text, is_output, present)
    SELECT p.position, ROW_NUMBER() OVER (ORDER BY p.position) - 1, p.name, p.base_type, p.type_text, p.is_output,
           CASE WHEN EXISTS (SELECT 1 FROM OPENJSON(@args) AS a WHERE a.[key] = p.name COLLATE Latin1_General_BIN2) THEN 1 ELSE 0 END
    FROM asyncexec.AsyncExecParameters AS p
    WHERE p.[procedure] = @registered;

    SELECT
        @names = N'[' + NULLIF(STRING_AGG(CAST(N'"' + STRING_ESCAPE(name, 'json') + N'"' AS nvarchar(max)), N',')
                          WITHIN GROUP (ORDER BY position), N'') + N']',
        @declare = STRING_AGG(CAST(CONCAT(N'DECLARE @p', position, N' ', type_text, N';') AS nvarchar(max)), NCHAR(10))
                          WITHIN GROUP (ORDER BY position),
        @assign = STRING_AGG(CASE WHEN present = 1 THEN CAST(
                      CASE WHEN base_type IN (N'varbinary', N'binary')
                           -- JSON carries binary as base64, which only OPENJSON ... WITH decodes
                           THEN CONCAT(N'SELECT @p', position, N' = b.v FROM OPENJSON(@__args) AS a ',
                                       N'CROSS APPLY OPENJSON(N''["'' + a.[value] + N''"]'') WITH (v varbinary(max) N''$'') AS b ',
                                       N'WHERE a.[type] = 1 AND a.[key] = JSON_VALUE(@__names, N''$[', idx, N']'');')
                           ELSE CONCAT(N'SELECT @p', position, N' = CONVERT(', type_text, N', a.[value]) FROM OPENJSON(@__args) AS a ',
                                       N'WHERE a.[key] = JSON_VALUE(@__names, N''$[', idx, N']'');')
                      END AS nvarchar(max)) END, NCHAR(10)) WITHIN GROUP (ORDER BY position),
        @execArgs = STRING_AGG(CAST(CASE WHEN present = 1 OR is_output = 1
                                         THEN CONCAT(N'@p', position, CASE WHEN is_output = 1 THEN N' OUTPUT' END)
                                         ELSE N'DEFAULT' END AS nvarchar(max)), N', ') WITHIN GROUP (ORDER BY position),
        -- exact numerics travel as text so that JSON keeps every digit
        @outputs = NULLIF(STRING_AGG(CASE WHEN is_output = 1 THEN CAST(CONCAT(
                       CASE WHEN base_type IN (N'bigint', N'decimal', N'numeric', N'money', N'smallmoney')
                            THEN CONCAT(N'CONVERT(nvarchar(64), @p', position, N')') ELSE CONCAT(N'@p', position) END,
                       N' AS ', QUOTENAME(name)) AS nvarchar(max)) END, N', ') WITHIN GROUP (ORDER BY position), N''),
        @types = N'{' + NULLIF(STRING_AGG(CASE WHEN is_output = 1
                                        THEN CAST(N'"' + STRING_ESCAPE(name, 'json') + N'":"' + STRING_ESCAPE(type_text, 'json') + N'"' AS nvarchar(max))
                                   END, N','), N'') + N'}'
    FROM @p;

    SET @sql = CONCAT(
        @declare, NCHAR(10),
        @assign, NCHAR(10),
        N'DECLARE @__rv int, @__out nvarchar(max);', NCHAR(10),
        N'EXEC @__rv = ', @target, N' ', @execArgs, N';', NCHAR(10),
        CASE WHEN @outputs IS NOT NULL
             THEN CONCAT(N'SET @__out = (SELECT ', @outputs, N' FOR JSON PATH, WITHOUT_ARRAY_WRAPPER, INCLUDE_NULL_VALUES);', NCHAR(10)) END,
        N'SET @__result = (SELECT @__rv AS [returnValue], JSON_QUERY(@__out) AS [outputParameters], ',
        N'JSON_QUERY(@__types) AS [outputTypes], CAST(NULL AS int) AS [rows] FOR JSON PATH, WITHOUT_ARRAY_WRAPPER, INCLUDE_NULL_VALUES);');

    BEGIN TRY
        BEGIN TRANSACTION;
        -- Every statement on a dialog locks its conversation group until the transaction
        -- ends: while the call runs, no other reader can receive this call's messages.
        BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;

        IF @target IS NULL
            SELECT @failed = 1, @errNumber = 50001, @errSeverity = 16, @errState = 1,
                   @errMessage = CONCAT(N'procedure "', @registered, N'" is no longer registered or no longer exists');
        ELSE
        BEGIN
            SAVE TRANSACTION AsyncExecCall;
            BEGIN TRY
                EXEC sys.sp_executesql @sql,
                     N'@__args nvarchar(max), @__names nvarchar(max), @__types nvarchar(max), @__result nvarchar(max) OUTPUT',
                     @__args = @args, @__names = @names, @__types = @types, @__result = @result OUTPUT;
            END TRY
            BEGIN CATCH
                SELECT @failed = 1, @errNumber = ERROR_NUMBER(), @errSeverity = ERROR_SEVERITY(), @errState = ERROR_STATE(),
                       @errLine = ERROR_LINE(), @errProcedure = ERROR_PROCEDURE(), @errMessage = ERROR_MESSAGE();
                IF XACT_STATE() = 1
                    ROLLBACK TRANSACTION AsyncExecCall;   -- undo the call's writes, keep the transaction
            END CATCH;

            -- A doomed transaction (XACT_ABORT in the call, or an error that always dooms)
            -- can only be rolled back whole, and a call may have ended our transaction
            -- itself. Either way the outcome goes into a fresh transaction: the request was
            -- consumed by the committed claim, so no rollback here returns it to the queue.
            IF XACT_STATE() = -1
                ROLLBACK TRANSACTION;
            IF @@TRANCOUNT = 0
            BEGIN
                BEGIN TRANSACTION;
                BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;
            END;
            -- a call that left a transaction open has had its work undone above; close its levels
            WHILE @@TRANCOUNT > 1
                COMMIT TRANSACTION;
        END;

        -- UPDLOCK: the latest committed row (usp_AsyncExecCancel may have just asked for a
        -- cancel), kept until we commit. A call whose cancel was asked for while it ran and
        -- that failed on its own is not retried: it ends CANCELLED (its attempt FAILED).
        SELECT @attempts = attempts, @maxAttempts = max_attempts, @cancel = cancel_requested
        FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK) WHERE id = @id;
        SET @status = CASE WHEN @failed = 0 THEN 'SUCCEEDED' WHEN @attempts < @maxAttempts AND @cancel = 1 THEN 'CANCELLED'
                           WHEN @attempts < @maxAttempts THEN 'WAITING' ELSE 'FAILED' END;
        IF @status = 'WAITING'
            -- exponential backoff with jitter: about 2^attempts seconds, at most five minutes
            SET @retryIn = CEILING(IIF(@attempts > 8, 300.0, POWER(CAST(2 AS float), @attempts)) * (0.75 + RAND() / 2));

        SET @now = SYSUTCDATETIME();
        UPDATE asyncexec.AsyncExecResults
           SET status = @status,
               finished_at = CASE WHEN @status = 'WAITING' THEN NULL ELSE @now END,
               run_at = CASE WHEN @status = 'WAITING' THEN DATEADD(second, @retryIn, @now) ELSE run_at END,
               result = CASE WHEN @failed = 0 THEN @result END,
               error_number = @errNumber, error_severity = @errSeverity, error_state = @errState,
               error_line = @errLine, error_procedure = @errProcedure, error_message = @errMessage
        OUTPUT inserted.row_version INTO @changed (v)
        WHERE id = @id AND status = 'RUNNING';

        IF EXISTS (SELECT 1 FROM @changed)
        BEGIN
            -- The execution log, in the same transaction: this attempt ends SUCCEEDED or
            -- FAILED (also when a retry follows: the call goes back to WAITING).
            UPDATE asyncexec.AsyncExecAttempts
               SET status = CASE WHEN @failed = 0 THEN 'SUCCEEDED' ELSE 'FAILED' END,
                   finished_at = @now,
                   error_number = @errNumber, error_severity = @errSeverity, error_state = @errState,
                   error_line = @errLine, error_procedure = @errProcedure, error_message = @errMessage
             WHERE execution_id = @id AND status = 'RUNNING';
            SELECT @cursor = CONVERT(varchar(18), v, 1) FROM @changed;
            SET @reply = (SELECT @id AS [@id], @status AS [@status], @cursor AS [@cursor] FOR XML PATH('status'), TYPE);
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
        END;
        IF @status = 'WAITING'
        BEGIN
            BEGIN CONVERSATION TIMER (@h) TIMEOUT = @retryIn;   -- the retry arrives as a DialogTimer message
        END
        ELSE
        BEGIN
            END CONVERSATION @h;                                -- the listener ends the other side
        END;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        -- The outcome could not be recorded: undo it all. The lease armed by the claim
        -- brings the call back once this session's lock is released.
        SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
        VALUES (@id, @h, @errNumber, @errMessage);
    END CATCH;

    EXEC sys.sp_releaseapplock @Resource = @resource, @LockOwner = 'Session';
END;
GO

-- Our poison-message handling: take a call's messages off its queue for good, fail the
-- call (50012) unless it is finished or a live reader holds it, and end the dialog.
CREATE PROCEDURE asyncexec.usp_AsyncExecAbandon
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
            @now datetime2(3);
    DECLARE @changed TABLE (v binary(8));

    SELECT @receive = N'RECEIVE TOP (1) @x = conversation_handle FROM asyncexec.' + QUOTENAME(queue_object)
                    + N' WHERE conversation_handle = @h;'
    FROM asyncexec.AsyncExecQueues
    WHERE name = @queue;
    IF @id IS NULL
        SELECT @id = id FROM asyncexec.AsyncExecResults WHERE target_handle = @h;

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
GO

-- The reader of one queue (called by that queue's parameterless activation procedure).
CREATE PROCEDURE asyncexec.usp_AsyncExecActivated
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
            @errNumber int, @errMessage nvarchar(4000), @now datetime2(3), @concurrency int;
    DECLARE @changed TABLE (v binary(8), status varchar(10));

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
               @locked = 0, @resource = NULL, @errNumber = NULL, @errMessage = NULL, @newStatus = NULL, @cancel = NULL;
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

            SELECT @status = e.status, @runAt = e.run_at, @recoveries = e.recoveries,
                   @lease = 60 + COALESCE(CEILING(r.timeout_ms / 1000.0), 0)
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
                        SET @now = SYSUTCDATETIME();
                        UPDATE asyncexec.AsyncExecResults
                           SET status = 'FAILED', finished_at = @now, error_number = 50011, error_severity = 16, error_state = 1,
                               error_message = CONCAT(N'the call''s dialog ended before the call finished',
                                                      N': ' + CAST(@errNumber AS nvarchar(11)) + N' ' + @errMessage)
                        -- the status read above may be stale (usp_AsyncExecCancel): the UPDATE
                        -- checks the latest committed one
                        WHERE id = @id AND status IN ('PENDING', 'WAITING', 'RUNNING');
                        -- RUNNING with its lock free: the session that ran it is gone
                        IF @@ROWCOUNT > 0
                            UPDATE asyncexec.AsyncExecAttempts
                               SET status = 'LOST', finished_at = @now
                             WHERE execution_id = @id AND status = 'RUNNING';
                    END;
                END;
                SET @end = 1;
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
                    -- Read the call again, now that we hold its lock: usp_AsyncExecCancel cancels
                    -- a WAITING or PENDING call holding this lock (not the conversation group), so
                    -- the status read above may be stale. UPDLOCK reads the latest committed row
                    -- and keeps it until we commit.
                    SELECT @status = status, @runAt = run_at, @recoveries = recoveries, @cancel = cancel_requested
                    FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
                    WHERE id = @id;
                    SET @newStatus = CASE WHEN @status IS NULL OR @status NOT IN ('PENDING', 'WAITING', 'RUNNING') THEN NULL
                                          WHEN @status = 'WAITING' AND @runAt > SYSUTCDATETIME() THEN 'WAITING'
                                          -- cancel asked for and its session gone (killed): never run it again
                                          WHEN @cancel = 1 THEN 'CANCELLED'
                                          WHEN @status = 'RUNNING' AND @recoveries + 1 >= 5 THEN 'FAILED'
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
                               error_number = CASE WHEN @newStatus = 'FAILED' THEN 50010 ELSE error_number END,
                               error_severity = CASE WHEN @newStatus = 'FAILED' THEN 16 ELSE error_severity END,
                               error_state = CASE WHEN @newStatus = 'FAILED' THEN 1 ELSE error_state END,
                               error_message = CASE WHEN @newStatus = 'FAILED'
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
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
            END;
            IF @timer IS NOT NULL
            BEGIN
                BEGIN CONVERSATION TIMER (@h) TIMEOUT = @timer;
            END;
            IF @end = 1
            BEGIN
                END CONVERSATION @h;
            END;
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
            INSERT asyncexec.AsyncExecErrors (queue, execution_id, conversation_handle, message_type_name, error_number, error_message)
            VALUES (@queue, @id, @h, @type, @errNumber, @errMessage);
            -- The message is back on the queue, and RECEIVE returns it first again. Poison-
            -- message handling is off on our queues (ALTER QUEUE: "allows for a custom poison
            -- message handling system to be defined by the application"), so this is ours:
            -- after five failures on one dialog, give up on that call instead of letting it
            -- hold up the queue for ever.
            IF @h IS NOT NULL
               AND (SELECT COUNT(*) FROM asyncexec.AsyncExecErrors
                     WHERE conversation_handle = @h AND message_type_name IS NOT NULL) >= 5
                EXEC asyncexec.usp_AsyncExecAbandon @queue = @queue, @h = @h, @id = @id, @errMessage = @errMessage;
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
GO

-- Cancelling a call (the service's cancelExecution; docs/mssql.md, "Cancelling a call").
--
-- Locks, in the order every path takes them (none waits for a lock while holding a later one):
--   1. the conversation group of the call's activated side: RECEIVE (a reader's claim, the
--      run's BEGIN CONVERSATION TIMER, usp_AsyncExecAbandon) and usp_AsyncExecSettleCancel;
--      usp_AsyncExecCancel never touches it (it SENDs on the initiator side, whose group only
--      the listener's short RECEIVE transactions take);
--   2. the call's application lock N'asyncexec/<id>': readers take it with a zero timeout
--      (they never wait for it); only usp_AsyncExecCancel waits for it, holding nothing else;
--   3. the call's row in asyncexec.AsyncExecResults.
-- Every status change of a WAITING, PENDING or RUNNING call is made holding the call's
-- application lock, and a reader's claim reads the call again after taking that lock, so a
-- call cancelled while WAITING or PENDING can never be started. A RUNNING call's lock is
-- held by its reader for the whole run: its cancel is recorded in cancel_requested, the
-- reader's session is killed (usp_AsyncExecKill, from the service, outside any
-- transaction), and whoever next holds the lock records CANCELLED instead of running it.
-- The resource name is kept within 32 characters (sp_getapplock: "only the first 32
-- characters can be retrieved in plain text"), so sys.dm_tran_locks shows it whole.

-- Errors (THROW, severity 16), mapped one to one by the service:
--   50006 NOT_FOUND         no call has this token
--   50007 ALREADY_FINISHED  the call is SUCCEEDED, FAILED or CANCELLED already
--   50008 FORBIDDEN         the call is RUNNING and @allowKill is 0, or the caller lacks the
--                           rights the kill needs (ALTER ANY CONNECTION, VIEW SERVER STATE)
-- @status: CANCELLED (done), RUNNING (cancel recorded and committed: the service kills the
-- session next), BUSY (a reader is claiming the call right now: try again).
CREATE PROCEDURE asyncexec.usp_AsyncExecCancel
    @token     uniqueidentifier,
    @allowKill bit = 0,
    @id        bigint = NULL OUTPUT,
    @status    varchar(10) = NULL OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @name nvarchar(60) = LOWER(CONVERT(nvarchar(36), @token)), @resource nvarchar(255),
            @lock int, @wait int, @initiator uniqueidentifier, @state char(2), @body xml, @now datetime2(3);
    SELECT @id = NULL, @status = NULL;

    SELECT @id = id, @status = status FROM asyncexec.AsyncExecResults WHERE token = @token;
    IF @id IS NULL
    BEGIN
        SET @message = CONCAT(N'execution ', @name, N' does not exist');
        THROW 50006, @message, 1;
    END;
    SET @resource = CONCAT(N'asyncexec/', @id);
    -- the reader of a RUNNING call holds its lock for the whole run: do not wait for it
    SET @wait = CASE WHEN @status = 'RUNNING' THEN 0 ELSE 5000 END;

    BEGIN TRY
        BEGIN TRANSACTION;
        EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = @wait;
        -- UPDLOCK: the latest committed row (whatever the isolation level), kept until we end
        SELECT @status = status, @initiator = initiator_handle
        FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
        WHERE id = @id;

        IF @status IS NULL
        BEGIN
            SET @message = CONCAT(N'execution ', @name, N' does not exist');
            THROW 50006, @message, 1;
        END;
        IF @status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        BEGIN
            SET @message = CONCAT(N'execution ', @name, N' has already finished (', @status, N')');
            THROW 50007, @message, 1;
        END;

        IF @status = 'RUNNING'
        BEGIN
            IF COALESCE(@allowKill, 0) = 0
            BEGIN
                SET @message = CONCAT(N'execution ', @name, N' is RUNNING: cancelling it KILLs the SQL Server session that runs it, ',
                                      N'which this service does only when configured with allowKill=true');
                THROW 50008, @message, 1;
            END;
            IF COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'ALTER ANY CONNECTION'), 0) = 0
               OR (COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER STATE'), 0) = 0
                   AND COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER PERFORMANCE STATE'), 0) = 0)
            BEGIN
                SET @message = CONCAT(N'execution ', @name, N' is RUNNING and allowKill=true, but the login lacks ALTER ANY CONNECTION ',
                                      N'(for KILL) or VIEW SERVER STATE (for sys.dm_tran_locks): nothing was changed');
                THROW 50008, @message, 1;
            END;
            -- Committed before any KILL: the killed run rolls back, and whoever next holds the
            -- call's lock (usp_AsyncExecSettleCancel, or a reader on the lease timer) records
            -- CANCELLED instead of running it again; a run that ends on its own first keeps its
            -- outcome, but a failure is not retried (usp_AsyncExecRun).
            UPDATE asyncexec.AsyncExecResults SET cancel_requested = 1 WHERE id = @id AND cancel_requested = 0;
            COMMIT TRANSACTION;
            RETURN;
        END;

        IF @lock < 0
        BEGIN
            -- a reader holds the call this very moment (claiming it, or recording a retry)
            ROLLBACK TRANSACTION;
            SET @status = 'BUSY';
            RETURN;
        END;

        -- WAITING or PENDING, and no reader holds the call: a claim that follows takes the
        -- lock first and reads the call again under it, so it can never start it.
        SET @now = SYSUTCDATETIME();
        UPDATE asyncexec.AsyncExecResults
           SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1
         WHERE id = @id AND status IN ('WAITING', 'PENDING');
        SET @status = 'CANCELLED';

        -- Wake the activated side now rather than at runAt or the retry backoff: a second
        -- request on the dialog (the contract lets the initiator send Request). The reader
        -- that receives it (or the first request, or the timer) finds the call CANCELLED,
        -- sends CANCELLED to the listener like any outcome, and ends the dialog, which also
        -- drops its timer and remaining messages. SEND needs the initiator side open
        -- (STARTED_OUTBOUND or CONVERSING); otherwise the dialog is ending already.
        SELECT @state = state FROM sys.conversation_endpoints WHERE conversation_handle = @initiator;
        IF @state IN ('SO', 'CO')
        BEGIN
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            SAVE TRANSACTION usp_AsyncExecCancel;
            BEGIN TRY
                SEND ON CONVERSATION @initiator MESSAGE TYPE [asyncexec/Request] (@body);
            END TRY
            BEGIN CATCH
                -- the cancel stands without the wake-up call: the dialog's own request or
                -- timer ends it later
                IF XACT_STATE() = -1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION usp_AsyncExecCancel;
                INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
                VALUES (@id, @initiator, ERROR_NUMBER(), ERROR_MESSAGE());
            END CATCH;
        END;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- KILL the session running a call, only if it still holds the call's application lock
-- (the reader running it holds it, session-owned, from its claim until its outcome has
-- committed). The service calls this outside any transaction (KILL cannot run inside one)
-- while another of its connections holds the call's row with UPDLOCK: the reader cannot
-- record an outcome meanwhile, so it cannot have moved on to another call. A session that
-- is gone holds no lock, so a reused session id never matches. Needs ALTER ANY CONNECTION
-- (KILL) and VIEW SERVER STATE (sys.dm_tran_locks, sys.dm_exec_requests).
CREATE PROCEDURE asyncexec.usp_AsyncExecKill
    @id        bigint,
    @sessionId int,
    @killed    bit = 0 OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @resource nvarchar(255) = CONCAT(N'asyncexec/', @id), @kill nvarchar(100), @message nvarchar(2048);
    SET @killed = 0;
    IF @@TRANCOUNT > 0
    BEGIN
        SET @message = N'usp_AsyncExecKill must run outside a transaction';
        THROW 50021, @message, 1;
    END;
    IF @id IS NULL OR @sessionId IS NULL OR @sessionId = @@SPID   -- "You can't kill your own process"
        RETURN;

    -- resource_description of an APPLICATION lock: <DbPrincipalId>:<up to 32 characters>:(<hash>)
    -- (the name shown bracketed by current versions; both spellings are accepted).
    IF EXISTS (SELECT 1
                 FROM sys.dm_tran_locks AS l
                WHERE l.request_session_id = @sessionId
                  AND l.resource_type = N'APPLICATION'
                  AND l.resource_database_id = DB_ID()
                  AND l.request_owner_type = N'SESSION'
                  AND l.request_mode = N'X'
                  AND l.request_status IN (N'GRANT', N'GRANTED')
                  AND (l.resource_description LIKE N'%:' + @resource + N':(%'
                       OR l.resource_description LIKE N'%:\[' + @resource + N']:(%' ESCAPE N'\'))
       -- already killed and rolling back: KILL again would only report progress, and the
       -- KILL documentation warns against repeating it (the id may be reassigned meanwhile)
       AND NOT EXISTS (SELECT 1 FROM sys.dm_exec_requests AS r
                        WHERE r.session_id = @sessionId AND r.command = N'KILLED/ROLLBACK')
    BEGIN
        SET @kill = CONCAT(N'KILL ', @sessionId, N';');   -- KILL takes no variable: an int from the catalog
        EXEC sys.sp_executesql @kill;
        SET @killed = 1;
    END;
END;
GO

-- Record CANCELLED for a RUNNING call whose cancel was asked for (usp_AsyncExecCancel) once
-- its session is gone (killed): the killed run has rolled back, the attempt was LOST, and
-- the dialog ends with a CANCELLED status to the listener, as a reader's recovery on the
-- lease timer would do (this does it at once, without waiting for the lease or for a
-- free reader). Takes the locks in the claim's order: the conversation group, then the
-- call's application lock without waiting, then the row. Does nothing while the killed
-- session still holds the lock; @status is the call's status afterwards.
CREATE PROCEDURE asyncexec.usp_AsyncExecSettleCancel
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
            @now datetime2(3), @cursor varchar(18), @reply xml;
    DECLARE @changed TABLE (v binary(8));
    SET @status = NULL;

    SELECT @status = e.status, @cancel = e.cancel_requested, @h = e.target_handle,
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
GO

-- The default queue; more with EXEC asyncexec.usp_AsyncExecCreateQueue @name, @concurrency.
EXEC asyncexec.usp_AsyncExecCreateQueue @name = N'default', @concurrency = 10;
GO
