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
-- usp_AsyncExecAbandon close the running attempt as LOST.

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
            @attempts int, @maxAttempts int, @status varchar(10), @retryIn int, @cursor varchar(18), @reply xml,
            @now datetime2(3), @resource nvarchar(255) = CONCAT(N'asyncexec/execution/', @id);
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

        SELECT @attempts = attempts, @maxAttempts = max_attempts FROM asyncexec.AsyncExecResults WHERE id = @id;
        SET @status = CASE WHEN @failed = 0 THEN 'SUCCEEDED' WHEN @attempts < @maxAttempts THEN 'WAITING' ELSE 'FAILED' END;
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
            SET @resource = CONCAT(N'asyncexec/execution/', @id);
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
            @status varchar(10), @runAt datetime2(3), @recoveries int, @lease int, @lock int, @locked bit,
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
               @locked = 0, @resource = NULL, @errNumber = NULL, @errMessage = NULL;
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
                UPDATE asyncexec.AsyncExecResults SET target_handle = @h WHERE id = @id;
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
                    SET @resource = CONCAT(N'asyncexec/execution/', @id);
                    EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0;
                    IF @lock >= 0
                    BEGIN
                        SET @locked = 1;
                        SET @now = SYSUTCDATETIME();
                        UPDATE asyncexec.AsyncExecResults
                           SET status = 'FAILED', finished_at = @now, error_number = 50011, error_severity = 16, error_state = 1,
                               error_message = CONCAT(N'the call''s dialog ended before the call finished',
                                                      N': ' + CAST(@errNumber AS nvarchar(11)) + N' ' + @errMessage)
                        WHERE id = @id;
                        -- RUNNING with its lock free: the session that ran it is gone
                        UPDATE asyncexec.AsyncExecAttempts
                           SET status = 'LOST', finished_at = @now
                         WHERE execution_id = @id AND status = 'RUNNING';
                    END;
                END;
                SET @end = 1;
            END
            ELSE IF @status IS NULL OR @status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
                SET @end = 1;   -- nothing to run: a late timer, or a purged call
            ELSE IF @status = 'WAITING' AND @runAt > SYSUTCDATETIME()
                -- TIMEOUT is an int of seconds: a runAt decades away would overflow it and
                -- fail this message for good. Wait at most a day; the timer is armed again
                -- when it fires early (this branch).
                SET @timer = CAST(CEILING(IIF(DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt) > 86400000, 86400000,
                                              DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), @runAt)) / 1000.0) AS int);
            ELSE
            BEGIN
                -- PENDING, WAITING and due, or RUNNING whose lease ran out: is its reader gone?
                SET @resource = CONCAT(N'asyncexec/execution/', @id);
                EXEC @lock = sys.sp_getapplock @Resource = @resource, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0;
                IF @lock < 0
                    SET @timer = @lease;   -- a live reader still runs it: look again later
                ELSE
                BEGIN
                    SET @locked = 1;
                    SET @newStatus = CASE WHEN @status = 'RUNNING' AND @recoveries + 1 >= 5 THEN 'FAILED' ELSE 'RUNNING' END;
                    SET @now = SYSUTCDATETIME();
                    UPDATE asyncexec.AsyncExecResults
                       SET status = @newStatus,
                           started_at = CASE WHEN @newStatus = 'RUNNING' THEN @now ELSE started_at END,
                           finished_at = CASE WHEN @newStatus = 'FAILED' THEN @now END,
                           attempts = attempts + CASE WHEN status = 'RUNNING' THEN 0 ELSE 1 END,
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

-- The default queue; more with EXEC asyncexec.usp_AsyncExecCreateQueue @name, @concurrency.
EXEC asyncexec.usp_AsyncExecCreateQueue @name = N'default', @concurrency = 10;
GO
