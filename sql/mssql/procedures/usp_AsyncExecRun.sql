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
-- call's messages could not be handled five times (our own poison-message handling),
-- 50014 the called procedure ended (COMMIT or ROLLBACK) the transaction it was called in
-- (never retried), 50015 the session running a non-transactional call was lost mid-run
-- (never run again).
--
-- Non-transactional calls (AsyncExecResults.transactional = 0, copied from the registration
-- by the claim): the claim has committed the RECEIVE, RUNNING and the lease, and holds the
-- call's application lock session-owned ("the lock is released ... when the session ends":
-- sp_getapplock @LockOwner = 'Session'), so exclusion outlives the transactions; the call runs
-- with no transaction open (BACKUP, ALTER DATABASE and full-text DDL may then run: they are
-- not allowed in an explicit transaction), and the outcome is recorded after it in a
-- transaction of its own. A session lost mid-call leaves the call RUNNING with its lock free:
-- the lease's reader fails it (50015), never runs it again.
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
    -- @target: two QUOTENAMEd sysnames (up to 258 characters each, every ] doubled) and a dot
    DECLARE @args nvarchar(max), @registered nvarchar(261), @target nvarchar(600), @names nvarchar(max),
            @declare nvarchar(max), @assign nvarchar(max), @execArgs nvarchar(max), @outputs nvarchar(max),
            @types nvarchar(max), @sql nvarchar(max), @result nvarchar(max), @failed bit = 0,
            @errNumber int, @errSeverity int, @errState int, @errLine int, @errProcedure nvarchar(128), @errMessage nvarchar(4000),
            @attempts int, @maxAttempts int, @cancel bit, @status varchar(10), @retryIn int, @cursor varchar(18), @reply xml,
            @now datetime2(3), @resource nvarchar(255) = CONCAT(N'asyncexec/', @id), @batchId uniqueidentifier,
            @batchStatus varchar(10), @transactional bit, @tranId bigint, @ended bit = 0, @fresh bit = 0;
    DECLARE @changed TABLE (v binary(8) NULL);

    SELECT @args = e.arguments, @registered = e.[procedure], @batchId = e.batch_id, @transactional = COALESCE(e.transactional, 1),
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
    DECLARE @p TABLE (position int NULL, idx int NULL, name nvarchar(128) NULL, base_type nvarchar(128) NULL, type_text nvarchar(128) NULL, is_output bit NULL, present bit NULL);
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
                           -- the expression usp_AsyncExecInvoke checked with (TRY_ there): the same reading
                           -- of dates in both sessions, whatever their language and DATEFORMAT
                           ELSE CONCAT(N'SELECT @p', position, N' = ', asyncexec.ArgumentConversion(base_type, type_text, N'a.[value]', 0),
                                       N' FROM OPENJSON(@__args) AS a ',
                                       N'WHERE a.[key] = JSON_VALUE(@__names, N''$[', idx, N']'');')
                      END AS nvarchar(max)) END, NCHAR(10)) WITHIN GROUP (ORDER BY position),
        @execArgs = STRING_AGG(CAST(CASE WHEN present = 1 OR is_output = 1
                                         THEN CONCAT(N'@p', position, CASE WHEN is_output = 1 THEN N' OUTPUT' END)
                                         ELSE N'DEFAULT' END AS nvarchar(max)), N', ') WITHIN GROUP (ORDER BY position),
        -- exact numerics travel as text so that JSON keeps every digit; money and smallmoney with
        -- style 2, "no commas every three digits to the left of the decimal point, and four digits
        -- to the right" (CAST and CONVERT: style 0, the default, keeps only two)
        @outputs = NULLIF(STRING_AGG(CASE WHEN is_output = 1 THEN CAST(CONCAT(
                       CASE WHEN base_type IN (N'money', N'smallmoney')
                            THEN CONCAT(N'CONVERT(nvarchar(64), @p', position, N', 2)')
                            WHEN base_type IN (N'bigint', N'decimal', N'numeric')
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
        IF @transactional = 1
        BEGIN
            BEGIN TRANSACTION;
            -- Every statement on a dialog locks its conversation group until the transaction
            -- ends: while the call runs, no other reader can receive this call's messages.
            BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;
            -- "the transaction ID of the current transaction in the current session" (any user
            -- may read it): a callee that COMMITs or ROLLBACKs ours and begins another leaves
            -- @@TRANCOUNT as it was, but not this id.
            SET @tranId = CURRENT_TRANSACTION_ID();
        END;
        -- (non-transactional: no transaction is open here; the claim committed its own, and the
        -- conversation group is not held while the call runs: a lease timer that fires meanwhile
        -- finds the call's session lock held and looks again later)

        IF @target IS NULL
            SELECT @failed = 1, @errNumber = 50001, @errSeverity = 16, @errState = 1,
                   @errMessage = CONCAT(N'procedure "', @registered, N'" is no longer registered or no longer exists');
        ELSE
        BEGIN
            IF @transactional = 1
                SAVE TRANSACTION AsyncExecCall;
            -- Progress (usp_AsyncExecProgress): its reports name this call. The session context
            -- is this session's own ("any user can set a session context for their session",
            -- sp_set_session_context); CONTEXT_INFO is cleared of an earlier call's last report,
            -- which "persists after the stored procedure ... is completed" (SET CONTEXT_INFO).
            -- 0x00: "you cannot supply a null value".
            -- The session context can refuse: a called procedure runs on this session and may
            -- have set our key with @read_only = 1 ("the value for the specified key can't be
            -- changed again on this logical connection") or filled it ("the total size of the
            -- session context is limited to 1 MB ... the statement fails"). That costs this
            -- call's live progress (its reports name another call, which the readers' guard
            -- refuses), never the call: without the TRY every later call of this reader would
            -- fail here. Only a doomed transaction ("can only request a full rollback",
            -- XACT_STATE) goes on to the outer CATCH.
            BEGIN TRY
                EXEC sys.sp_set_session_context @key = N'asyncexec.execution', @value = @id;
            END TRY
            BEGIN CATCH
                IF XACT_STATE() = -1
                BEGIN
                    THROW;
                END;
            END CATCH;
            SET CONTEXT_INFO 0x00;
            BEGIN TRY
                EXEC sys.sp_executesql @sql,
                     N'@__args nvarchar(max), @__names nvarchar(max), @__types nvarchar(max), @__result nvarchar(max) OUTPUT',
                     @__args = @args, @__names = @names, @__types = @types, @__result = @result OUTPUT;
            END TRY
            BEGIN CATCH
                SELECT @failed = 1, @errNumber = ERROR_NUMBER(), @errSeverity = ERROR_SEVERITY(), @errState = ERROR_STATE(),
                       @errLine = ERROR_LINE(), @errProcedure = ERROR_PROCEDURE(), @errMessage = ERROR_MESSAGE();
                -- undo the call's writes, keep the transaction; only while it is still ours (the
                -- savepoint belongs to it)
                IF @transactional = 1 AND XACT_STATE() = 1 AND CURRENT_TRANSACTION_ID() = @tranId
                    ROLLBACK TRANSACTION AsyncExecCall;
            END CATCH;

            -- A callee that COMMITs or ROLLBACKs the transaction it was called in: @@TRANCOUNT
            -- below the 1 it started with (a procedure that returns so raises 266, "Transaction
            -- count after EXECUTE indicates a mismatching number of BEGIN and COMMIT
            -- statements"), or another transaction than ours. Part of its work (and our lease)
            -- may be committed already: record 50014 and never run it again, whatever its
            -- attempts (a retry would repeat what was committed).
            IF @transactional = 1 AND (@@TRANCOUNT = 0 OR CURRENT_TRANSACTION_ID() <> @tranId)
            BEGIN
                SET @errMessage = LEFT(CONCAT(N'the called procedure ended the transaction it was called in (COMMIT or ROLLBACK); ',
                                              N'it is not run again', CASE WHEN @errNumber IS NOT NULL
                                              THEN CONCAT(N' (error ', @errNumber, N': ', @errMessage, N')') END), 4000);
                SELECT @ended = 1, @failed = 1, @errNumber = 50014, @errSeverity = 16, @errState = 1,
                       @errLine = NULL, @errProcedure = NULL;
            END;

            -- A doomed transaction (XACT_ABORT in the call, or an error that always dooms)
            -- can only be rolled back whole; so is one the callee began after ending ours, and
            -- one a non-transactional callee left open (its uncommitted work). Either way the
            -- outcome goes into a fresh transaction: the request was consumed by the committed
            -- claim, so no rollback here returns it to the queue.
            IF XACT_STATE() = -1 OR (@ended = 1 AND @@TRANCOUNT > 0) OR (@transactional = 0 AND @@TRANCOUNT > 0)
                ROLLBACK TRANSACTION;
            -- a call that left a transaction open has had its work undone above; close its levels
            WHILE @@TRANCOUNT > 1
                COMMIT TRANSACTION;
        END;
        IF @@TRANCOUNT = 0
        BEGIN
            BEGIN TRANSACTION;
            BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;
            SET @fresh = 1;   -- none of the call's work is in this transaction
        END;

        -- The call's last progress report is kept with its outcome, even one made just before
        -- it ended that no progress reader saw (usp_AsyncExecProgressRead takes the progress
        -- row before the call's row, as here). Only when this session's CONTEXT_INFO holds a
        -- report of ours ("the new context value is returned by the CONTEXT_INFO function
        -- when it is run in the same batch as the SET statement"): a call that never reported
        -- costs no procedure call and no key-range lock here.
        -- An ordinary failure there (a lock timeout) costs the report, not the outcome. But
        -- the outcome may only be written in a transaction: if the error doomed ours
        -- (XACT_STATE -1, "can only request a full rollback") or ended it (XACT_STATE 0, "no
        -- active user transaction": a deadlock victim's transaction is rolled back), going on
        -- would write the outcome in autocommit mode. If that transaction held the call's own
        -- writes, they are lost with it: THROW, the outer CATCH rolls back what is left and the
        -- lease runs the call again. If it was the fresh one above (the call's work committed
        -- already, or undone already), nothing of the call is lost: open it again without the
        -- report and record the outcome (otherwise a non-transactional call that succeeded
        -- would end 50015).
        IF SUBSTRING(CONTEXT_INFO(), 1, 4) = 0x41455031
        BEGIN
            BEGIN TRY
                EXEC asyncexec.usp_AsyncExecProgressRead @id = @id;
            END TRY
            BEGIN CATCH
                IF XACT_STATE() <> 1 AND @fresh = 0
                BEGIN
                    THROW;
                END;
                IF XACT_STATE() = -1
                    ROLLBACK TRANSACTION;
                IF @@TRANCOUNT = 0
                BEGIN
                    BEGIN TRANSACTION;
                    BEGIN CONVERSATION TIMER (@h) TIMEOUT = @lease;
                END;
            END CATCH;
        END;

        -- A batch member locks its batch before its own row (lock order: see the header).
        IF @batchId IS NOT NULL
            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
        -- UPDLOCK: the latest committed row (usp_AsyncExecCancel may have just asked for a
        -- cancel), kept until we commit. A call whose cancel was asked for while it ran and
        -- that failed on its own is not retried: it ends CANCELLED (its attempt FAILED).
        SELECT @attempts = attempts, @maxAttempts = max_attempts, @cancel = cancel_requested
        FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK) WHERE id = @id;
        SET @status = CASE WHEN @failed = 0 THEN 'SUCCEEDED' WHEN @ended = 1 THEN 'FAILED'
                           WHEN @attempts < @maxAttempts AND @cancel = 1 THEN 'CANCELLED'
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
        -- only the run that holds the call: RUNNING, by this session (a stale run never
        -- overwrites an outcome; while this session lives, its lock keeps every other away)
        WHERE id = @id AND status = 'RUNNING' AND session_id = @@SPID;

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
            -- not on a dialog whose other side has ended or errored: SEND fails there, and the
            -- status is a hint (the results row is the truth); the outcome must still commit
            IF EXISTS (SELECT 1 FROM sys.conversation_endpoints WHERE conversation_handle = @h AND state NOT IN ('DI', 'DO', 'ER', 'CD'))
            BEGIN
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Status] (@reply);
            END;
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
        -- brings the call back once this session's lock is released (a transactional call is
        -- run again, its work undone with ours; a non-transactional one is failed, 50015).
        SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        INSERT asyncexec.AsyncExecErrors (execution_id, conversation_handle, error_number, error_message)
        VALUES (@id, @h, @errNumber, @errMessage);
    END CATCH;

    -- the session goes back to reading its queue: no report may be taken for this call any more.
    -- The session context may refuse (a read_only key, see above): that must not keep the
    -- application lock from being released (an error here would pass control to the CATCH of
    -- usp_AsyncExecActivated, skipping what follows); "BEGIN CATCH [ { sql_statement |
    -- statement_block } ] END CATCH" (TRY...CATCH): the block may be empty.
    SET CONTEXT_INFO 0x00;
    BEGIN TRY
        EXEC sys.sp_set_session_context @key = N'asyncexec.execution', @value = NULL;   -- "setting a value of NULL frees the memory"
    END TRY
    BEGIN CATCH
    END CATCH;
    EXEC sys.sp_releaseapplock @Resource = @resource, @LockOwner = 'Session';
END;
