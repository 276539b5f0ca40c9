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

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecRun
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
            @now datetime2(3), @resource nvarchar(255) = CONCAT(N'asyncexec/', @id), @batchId uniqueidentifier,
            @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8));

    SELECT @args = e.arguments, @registered = e.[procedure], @batchId = e.batch_id,
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

        -- A batch member locks its batch before its own row (lock order: see the header).
        IF @batchId IS NOT NULL
            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
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
            -- the outcome of a batch member may complete its stage (or fail its batch): settle
            -- it in this transaction (also after a doomed call, in the fresh transaction above)
            IF @batchId IS NOT NULL AND @status <> 'WAITING'
                EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
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
