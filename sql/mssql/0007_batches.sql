-- Batches: executions grouped in ordered stages (docs/mssql.md, "Batches").
--
-- A batch is submitted in one transaction: usp_AsyncExecBatchCreate makes its row, then each
-- call goes through usp_AsyncExecInvoke with @batchId and @stage. Stage 1 is enqueued as
-- usual; the calls of later stages are held (WAITING, held = 1, no dialog, no message).
-- A stage is released by whoever records the last outcome of the stage before it, in the
-- same transaction: every path that ends a batch member (usp_AsyncExecRun, the reader's
-- lost/EndDialog handling, usp_AsyncExecAbandon, usp_AsyncExecCancel,
-- usp_AsyncExecSettleCancel) calls usp_AsyncExecBatchSettle before it commits. No reader
-- ever waits for a stage.
--
-- Recorded on calls: 50013, a held call whose stage was released but that could not be
-- enqueued (its queue gone). Thrown: 50005 (BAD_USER_INPUT) by usp_AsyncExecBatchCreate;
-- 50022 when usp_AsyncExecBatchSettle, 50024 when usp_AsyncExecBatchCancelUnstarted is
-- called outside a transaction (faults of ours).
--
-- Migrations never change once landed, so this script also brings what batches need into
-- the objects of 0001-0006: the held column and its checks on AsyncExecResults, a covering
-- index for the recent outcome counts, and new versions (CREATE OR ALTER) of the procedures
-- that enqueue a call or end one. Each of those, before it ends a member of a batch, locks
-- the batch row (UPDLOCK, HOLDLOCK) and then calls usp_AsyncExecBatchSettle in the same
-- transaction; lock order: the call's application lock, then the batch row, then the call's
-- row. usp_AsyncExecBatchSettle alone (and usp_AsyncExecCancelBatch of 0008; both hold the
-- batch row, and cancel through usp_AsyncExecBatchCancelUnstarted) changes other members
-- holding their rows only; a reader's claim reads its call again WITH (UPDLOCK) after taking
-- the application lock, which waits for it. ALTER drops an ADD SIGNATURE: sign the
-- procedures again (docs/mssql.md).

-- A member of a stage not yet released is held: WAITING, with no dialog and no message yet;
-- usp_AsyncExecBatchSettle enqueues it when its stage is released.
ALTER TABLE asyncexec.AsyncExecResults
    ADD held bit NOT NULL CONSTRAINT DF_AsyncExecResults_held DEFAULT (0);
GO
ALTER TABLE asyncexec.AsyncExecResults
    ADD CONSTRAINT CK_AsyncExecResults_batch CHECK ((batch_id IS NULL AND stage IS NULL AND held = 0)
                                                    OR (batch_id IS NOT NULL AND stage >= 1));
GO
-- purge, and the recent outcome counts of listQueues (covered: no lookups)
CREATE INDEX IX_AsyncExecResults_finished ON asyncexec.AsyncExecResults (finished_at) INCLUDE (queue, status)
    WITH (DROP_EXISTING = ON);
GO

CREATE TABLE asyncexec.AsyncExecBatches (
    id               uniqueidentifier NOT NULL CONSTRAINT PK_AsyncExecBatches PRIMARY KEY,
    status           varchar(10)      NOT NULL CONSTRAINT DF_AsyncExecBatches_status DEFAULT ('RUNNING'),
    -- CANCEL: the first member that ends FAILED or CANCELLED cancels every member not yet
    -- started; CONTINUE: later stages are released anyway
    on_failure       varchar(8)       NOT NULL CONSTRAINT DF_AsyncExecBatches_on_failure DEFAULT ('CANCEL'),
    stage_count      int              NOT NULL,
    current_stage    int              NOT NULL CONSTRAINT DF_AsyncExecBatches_current_stage DEFAULT (1),   -- released last
    submitted_at     datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecBatches_submitted DEFAULT (SYSUTCDATETIME()),
    finished_at      datetime2(3)     NULL,
    submitted_by     nvarchar(256)    NULL,
    submitted_login  nvarchar(128)    NULL,
    CONSTRAINT CK_AsyncExecBatches_status CHECK (status IN ('RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    CONSTRAINT CK_AsyncExecBatches_on_failure CHECK (on_failure IN ('CANCEL', 'CONTINUE')),
    CONSTRAINT CK_AsyncExecBatches_stages CHECK (stage_count >= 1 AND current_stage BETWEEN 1 AND stage_count),
    CONSTRAINT CK_AsyncExecBatches_finished CHECK ((status = 'RUNNING' AND finished_at IS NULL)
                                                   OR (status <> 'RUNNING' AND finished_at IS NOT NULL))
);
GO

-- usp_AsyncExecPurge deletes finished batches whose members are all gone
CREATE INDEX IX_AsyncExecBatches_finished ON asyncexec.AsyncExecBatches (finished_at);
GO

ALTER TABLE asyncexec.AsyncExecResults
    ADD CONSTRAINT FK_AsyncExecResults_batch FOREIGN KEY (batch_id) REFERENCES asyncexec.AsyncExecBatches (id);
GO
-- the settle's counts, getBatch and getBatchExecutions; the foreign key's check on delete
CREATE INDEX IX_AsyncExecResults_batch ON asyncexec.AsyncExecResults (batch_id, stage) INCLUDE (status);
GO

-- Create a batch of @stageCount stages inside the caller's transaction; its calls are then
-- invoked with usp_AsyncExecInvoke @batchId = @batchId, @stage = 1 … @stageCount, before the
-- caller commits. A later stage left without calls is skipped when the stage before it
-- ends; but stage 1 must have calls: a batch whose first stage has none is settled only
-- when a call of it ends, so it stays RUNNING, its later calls held, until one is added.
-- Errors: 50005 bad stage count or failure policy, or no open transaction.
-- EXECUTE AS OWNER, as usp_AsyncExecInvoke: callers need only EXECUTE on the two procedures.
CREATE PROCEDURE asyncexec.usp_AsyncExecBatchCreate
    @stageCount  int,
    @onFailure   varchar(8) = 'CANCEL',
    @submittedBy nvarchar(256) = NULL,
    @batchId     uniqueidentifier = NULL OUTPUT
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048);
    SET @batchId = NULL;
    -- Stored as the service reads it: T-SQL compares case-insensitively (usual collations) and
    -- ignores trailing blanks, so 'cancel' or 'CANCEL ' would pass the checks below as they are.
    SET @onFailure = UPPER(RTRIM(COALESCE(@onFailure, 'CANCEL')));
    IF @stageCount IS NULL OR @stageCount < 1
    BEGIN
        SET @message = CONCAT(N'a batch has at least one stage, not ', COALESCE(CAST(@stageCount AS nvarchar(11)), N'NULL'));
        THROW 50005, @message, 1;
    END;
    IF @onFailure NOT IN ('CANCEL', 'CONTINUE')
    BEGIN
        SET @message = CONCAT(N'onFailure must be CANCEL or CONTINUE, not ', @onFailure);
        THROW 50005, @message, 1;
    END;
    -- Outside a transaction the first stage could finish, and the batch end, before the
    -- calls of the later stages were added.
    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'create a batch and invoke its calls in one transaction';
        THROW 50005, @message, 1;
    END;

    SET @batchId = NEWID();
    INSERT asyncexec.AsyncExecBatches (id, on_failure, stage_count, submitted_by, submitted_login)
    VALUES (@batchId, @onFailure, @stageCount, @submittedBy, ORIGINAL_LOGIN());
END;
GO

-- Cancel every member of a batch that has not started (WAITING, held or not, and PENDING),
-- with @reason as its error message, and wake the activated side of each that has a dialog:
-- the one copy of what usp_AsyncExecBatchSettle's CANCEL branch and usp_AsyncExecCancelBatch
-- (0008_cancel_batch.sql) do to those members. RUNNING members are not touched here.
-- Called only inside its caller's transaction (never a transaction of its own; 50024
-- otherwise), by a caller that holds the batch row WITH (UPDLOCK, HOLDLOCK, ROWLOCK) and
-- settles the batch before it commits (usp_AsyncExecBatchSettle is such a caller itself).
-- Locks: as the settle, this changes members holding only their rows (see the settle below).
-- The SET options are the settle's: activation runs this through the settle.
CREATE PROCEDURE asyncexec.usp_AsyncExecBatchCancelUnstarted
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
    DECLARE @cancelled TABLE (id bigint PRIMARY KEY, initiator_handle uniqueidentifier NULL);

    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'usp_AsyncExecBatchCancelUnstarted runs in its caller''s transaction, which holds the batch row';
        THROW 50024, @message, 1;
    END;

    -- As usp_AsyncExecCancel cancels a WAITING or PENDING call (cancel_requested, so a
    -- reader never starts it); the error of an earlier failed attempt gives way to why.
    SET @now = SYSUTCDATETIME();
    UPDATE asyncexec.AsyncExecResults
       SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0,
           error_number = NULL, error_severity = NULL, error_state = NULL, error_line = NULL, error_procedure = NULL,
           error_message = @reason
    OUTPUT inserted.id, inserted.initiator_handle INTO @cancelled (id, initiator_handle)
    WHERE batch_id = @batchId AND status IN ('WAITING', 'PENDING');

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
                IF XACT_STATE() = -1
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
GO

-- Settle a batch after one of its members has ended, in the transaction that recorded that
-- outcome (the caller's; never a transaction of its own):
--   * onFailure CANCEL and a member ended FAILED or CANCELLED: cancel every member still
--     WAITING or PENDING (held or not) as usp_AsyncExecCancel does (usp_AsyncExecBatchCancelUnstarted,
--     above); RUNNING ones run to their end. The batch ends once nothing is left to end.
--   * otherwise, while every member of the stages released so far has ended: end the batch
--     after its last stage, or release the next stage (enqueue its held calls as
--     usp_AsyncExecInvoke would). A stage whose members were all cancelled already is passed.
-- The batch ends FAILED if a member failed, else CANCELLED if one was cancelled, else SUCCEEDED.
--
-- Why exactly one finisher sees a stage complete, under locking READ COMMITTED or RCSI:
--   1. The batch row is read WITH (UPDLOCK, HOLDLOCK): update locks are incompatible with one
--      another and are held to the end of the transaction, so the settles of one batch run
--      one after the other, each to its commit.
--   2. Every transaction that ends a member changes the member's row before it commits, and
--      takes this same lock before committing (the early lock in each caller, and again here).
--      So when a settle holds the lock, every other member outcome is either committed or
--      not yet written: none is written-but-uncommitted by someone who already passed us.
--   3. The counts below read WITH (READCOMMITTEDLOCK), i.e. with shared locks even under RCSI:
--      they see the latest committed state and wait for any change still uncommitted (a
--      reader's claim marking a member RUNNING) rather than read the version before it.
--      (Under RCSI a plain read would also be right by 1 and 2, since its snapshot is taken
--      when the statement starts, after the lock was granted; the hint keeps the counts right
--      even for a writer that forgot the early lock.)
--   Of two members ending at once, the first settle sees the other still non-terminal and
--   returns; the second waits for the first to commit and then sees both ended: only it
--   releases the next stage. The counts cannot deadlock: nobody waits for the batch lock
--   while holding an uncommitted member change, since each caller takes the batch lock
--   before it touches its own member's row.
-- Locks: see "Cancelling a call" in 0005_activated.sql. This procedure changes other
-- members' rows holding only their row locks (not their application locks): a reader's claim
-- reads its call again WITH (UPDLOCK) after taking the application lock, which waits for us,
-- so it never starts a member cancelled here, and it never sees a held member (no message).
CREATE PROCEDURE asyncexec.usp_AsyncExecBatchSettle
    @batchId uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;   -- a failed SEND below must leave the caller's transaction usable
    SET ANSI_WARNINGS ON;
    SET ANSI_PADDING ON;
    SET ARITHABORT ON;
    SET CONCAT_NULL_YIELDS_NULL ON;
    SET NUMERIC_ROUNDABORT OFF;
    DECLARE @message nvarchar(2048), @status varchar(10), @onFailure varchar(8), @stageCount int, @currentStage int,
            @end bit = 0, @final varchar(10), @now datetime2(3), @id bigint, @service nvarchar(256), @queue nvarchar(100),
            @h uniqueidentifier, @body xml, @errNumber int, @errMessage nvarchar(4000);
    DECLARE @release TABLE (id bigint PRIMARY KEY, queue nvarchar(100), service_name nvarchar(256) NULL);

    IF @batchId IS NULL
        RETURN;
    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'usp_AsyncExecBatchSettle runs in the transaction that records a member''s outcome';
        THROW 50022, @message, 1;
    END;

    SELECT @status = status, @onFailure = on_failure, @stageCount = stage_count, @currentStage = current_stage
    FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
    WHERE id = @batchId;
    IF @status IS NULL OR @status <> 'RUNNING'
        RETURN;

    WHILE 1 = 1
    BEGIN
        IF @onFailure = 'CANCEL'
           AND EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                        WHERE batch_id = @batchId AND status IN ('FAILED', 'CANCELLED'))
        BEGIN
            -- every member not yet started ends CANCELLED, and the dialogs of those that have
            -- one get a wake-up request; RUNNING ones run to their end
            EXEC asyncexec.usp_AsyncExecBatchCancelUnstarted @batchId = @batchId,
                 @reason = N'cancelled: an execution of its batch did not succeed';

            IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                            WHERE batch_id = @batchId AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
                SET @end = 1;
            BREAK;
        END;

        IF EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                    WHERE batch_id = @batchId AND stage <= @currentStage AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
            BREAK;   -- the stage released last is still running
        IF @currentStage >= @stageCount
        BEGIN
            SET @end = 1;
            BREAK;
        END;

        -- Release the next stage: each held call is enqueued exactly as usp_AsyncExecInvoke
        -- enqueues one (a dialog and its request now; PENDING, or WAITING until its own runAt,
        -- for which the reader arms the dialog's timer).
        SET @currentStage += 1;
        UPDATE asyncexec.AsyncExecBatches SET current_stage = @currentStage WHERE id = @batchId;
        DELETE @release;
        INSERT @release (id, queue, service_name)
        SELECT e.id, e.queue, q.service_name
        FROM asyncexec.AsyncExecResults AS e WITH (READCOMMITTEDLOCK)
        LEFT JOIN asyncexec.AsyncExecQueues AS q ON q.name = e.queue
        WHERE e.batch_id = @batchId AND e.stage = @currentStage AND e.held = 1 AND e.status = 'WAITING';

        SET @id = 0;
        WHILE 1 = 1
        BEGIN
            SELECT TOP (1) @id = id, @queue = queue, @service = service_name FROM @release WHERE id > @id ORDER BY id;
            IF @@ROWCOUNT = 0
                BREAK;
            SELECT @h = NULL, @now = SYSUTCDATETIME();
            -- A call that cannot be enqueued (its queue gone, the broker refusing the dialog)
            -- fails alone instead of undoing the outcome that released its stage: that outcome
            -- would otherwise roll back, run again and fail here again for ever.
            SAVE TRANSACTION usp_AsyncExecBatchSettle;
            BEGIN TRY
                IF @service IS NULL
                BEGIN
                    SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
                    THROW 50003, @message, 1;
                END;
                BEGIN DIALOG CONVERSATION @h
                    FROM SERVICE [asyncexec/NotifyService]
                    TO SERVICE @service, 'CURRENT DATABASE'
                    ON CONTRACT [asyncexec/Contract]
                    WITH ENCRYPTION = OFF;
                UPDATE asyncexec.AsyncExecResults
                   SET held = 0, initiator_handle = @h,
                       status = CASE WHEN run_at > @now THEN 'WAITING' ELSE 'PENDING' END
                 WHERE id = @id AND held = 1 AND status = 'WAITING';
                SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
                SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);
            END TRY
            BEGIN CATCH
                SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
                IF XACT_STATE() = -1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION usp_AsyncExecBatchSettle;
                UPDATE asyncexec.AsyncExecResults
                   SET held = 0, status = 'FAILED', finished_at = @now,
                       error_number = 50013, error_severity = 16, error_state = 1, error_line = NULL, error_procedure = NULL,
                       error_message = LEFT(CONCAT(N'its stage was released but the call could not be enqueued: ',
                                                   @errNumber, N' ', @errMessage), 4000)
                 WHERE id = @id AND held = 1 AND status = 'WAITING';
                INSERT asyncexec.AsyncExecErrors (queue, execution_id, error_number, error_message)
                VALUES (@queue, @id, @errNumber, @errMessage);
            END CATCH;
        END;
        -- and again: the stage just released may have nothing left to run (its members all
        -- cancelled one by one, or failed to enqueue), and a failure may cancel the batch
    END;

    IF @end = 1
    BEGIN
        SET @final = CASE
            WHEN EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                          WHERE batch_id = @batchId AND status = 'FAILED') THEN 'FAILED'
            WHEN EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults WITH (READCOMMITTEDLOCK)
                          WHERE batch_id = @batchId AND status = 'CANCELLED') THEN 'CANCELLED'
            ELSE 'SUCCEEDED' END;
        UPDATE asyncexec.AsyncExecBatches
           SET status = @final, finished_at = SYSUTCDATETIME()
         WHERE id = @batchId AND status = 'RUNNING';
    END;
END;
GO


-- New versions of the procedures of 0004-0006 that enqueue or end a call (see the top).

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecInvoke
    @procedure   nvarchar(261),
    @arguments   nvarchar(max) = N'{}',
    @queue       nvarchar(100) = NULL,
    @runAt       datetime2(3) = NULL,      -- UTC; later than now means WAITING until then
    @maxAttempts int = NULL,
    @submittedBy nvarchar(256) = NULL,
    @token       uniqueidentifier = NULL OUTPUT,
    @id          bigint = NULL OUTPUT,
    @batchId     uniqueidentifier = NULL,  -- the batch it belongs to (usp_AsyncExecBatchCreate)
    @stage       int = NULL                -- its 1-based stage in that batch
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048), @problems nvarchar(max), @registered nvarchar(261), @registeredQueue nvarchar(100),
            @registeredAttempts int, @object int, @service nvarchar(256), @status varchar(10),
            @batchStatus varchar(10), @currentStage int, @stageCount int, @held bit = 0;
    SET @arguments = COALESCE(@arguments, N'{}');

    SELECT @registered = r.name, @registeredQueue = r.queue, @registeredAttempts = r.max_attempts,
           @object = OBJECT_ID(QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name), N'P')
    FROM asyncexec.AsyncExecProcedures AS r
    WHERE r.name = @procedure;
    IF @registered IS NULL OR @object IS NULL
    BEGIN
        SET @message = CONCAT(N'procedure "', @procedure, N'" is not registered',
                              CASE WHEN @registered IS NOT NULL THEN N' (it no longer exists)' END);
        THROW 50001, @message, 1;
    END;

    -- ISJSON first: OPENJSON on malformed text raises an error instead of answering.
    IF ISJSON(@arguments) = 0
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        THROW 50002, @message, 1;
    END;
    IF (SELECT TOP (1) [type] FROM OPENJSON(N'[' + @arguments + N']')) <> 5   -- 5: object
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        THROW 50002, @message, 1;
    END;
    IF @maxAttempts IS NOT NULL AND @maxAttempts NOT BETWEEN 1 AND 100
    BEGIN
        SET @message = N'maxAttempts must be between 1 and 100';
        THROW 50002, @message, 1;
    END;

    DECLARE @args TABLE ([key] nvarchar(4000) COLLATE Latin1_General_BIN2, [value] nvarchar(max), [type] tinyint);
    INSERT @args ([key], [value], [type]) SELECT [key], [value], [type] FROM OPENJSON(@arguments);

    DECLARE @params TABLE (name nvarchar(128) COLLATE Latin1_General_BIN2, position int, base_type nvarchar(128), type_text nvarchar(128),
                           max_length smallint, has_default bit, is_supported bit);
    INSERT @params (name, position, base_type, type_text, max_length, has_default, is_supported)
    SELECT name, position, base_type, type_text, max_length, has_default, is_supported
    FROM asyncexec.AsyncExecParameters
    WHERE [procedure] = @registered;

    DECLARE @found TABLE (ord int, problem nvarchar(2000));
    INSERT @found (ord, problem)
    SELECT 1, CONCAT(N'unknown argument "', a.[key], N'"')
    FROM @args AS a WHERE NOT EXISTS (SELECT 1 FROM @params AS p WHERE p.name = a.[key]);
    INSERT @found (ord, problem)
    SELECT 1, CONCAT(N'duplicate argument "', a.[key], N'"')
    FROM @args AS a GROUP BY a.[key] HAVING COUNT(*) > 1;
    INSERT @found (ord, problem)
    SELECT 2, CONCAT(N'missing argument "', p.name, N'" (', p.type_text, N')')
    FROM @params AS p WHERE p.has_default = 0 AND NOT EXISTS (SELECT 1 FROM @args AS a WHERE a.[key] = p.name);
    INSERT @found (ord, problem)
    SELECT 2, CONCAT(N'parameter "', p.name, N'" has an unsupported type (', p.type_text, N')')
    FROM @params AS p WHERE p.is_supported = 0;

    -- Each supplied value must convert to its parameter's type exactly as the
    -- activated procedure will convert it: CONVERT(type, OPENJSON value), base64 for
    -- binary. TRY_CONVERT never raises, so the caller's transaction is never doomed.
    DECLARE @name nvarchar(128), @base nvarchar(128), @typeText nvarchar(128), @maxLength smallint,
            @value nvarchar(max), @jsonType tinyint, @ok bit, @check nvarchar(max);
    DECLARE checks CURSOR LOCAL FAST_FORWARD FOR
        SELECT p.name, p.base_type, p.type_text, p.max_length, a.[value], a.[type]
        FROM @params AS p JOIN @args AS a ON a.[key] = p.name
        WHERE p.is_supported = 1 AND a.[type] <> 0;   -- 0: JSON null, passed as NULL
    OPEN checks;
    FETCH NEXT FROM checks INTO @name, @base, @typeText, @maxLength, @value, @jsonType;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        IF @base IN (N'nvarchar', N'nchar')
            -- objects and arrays (4, 5) travel as their JSON text into character parameters
            SET @ok = CASE WHEN @maxLength = -1 OR DATALENGTH(@value) <= @maxLength THEN 1 ELSE 0 END;
        ELSE IF @base IN (N'varchar', N'char')
            SET @ok = CASE WHEN @maxLength = -1 OR DATALENGTH(CONVERT(varchar(max), @value)) <= @maxLength THEN 1 ELSE 0 END;
        ELSE IF @jsonType IN (4, 5)
            SET @ok = 0;
        ELSE IF @base IN (N'varbinary', N'binary')
            SET @ok = CASE
                WHEN @jsonType = 1
                 AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'%[^A-Za-z0-9+/=]%'
                 AND LEN(@value) % 4 = 0
                 AND (@maxLength = -1 OR LEN(@value) / 4 * 3 - (LEN(@value) - LEN(REPLACE(@value, N'=', N''))) <= @maxLength)
                THEN 1 ELSE 0 END;
        ELSE
        BEGIN
            -- @typeText comes from the catalog (asyncexec.TypeText), never from the caller
            SET @check = N'SET @ok = CASE WHEN TRY_CONVERT(' + @typeText + N', @value) IS NULL THEN 0 ELSE 1 END;';
            EXEC sys.sp_executesql @check, N'@value nvarchar(max), @ok bit OUTPUT', @value = @value, @ok = @ok OUTPUT;
        END;
        IF @ok = 0
            INSERT @found (ord, problem)
            VALUES (3, CONCAT(N'argument "', @name, N'": ', LEFT(@value, 100), CASE WHEN LEN(@value) > 100 THEN N'…' END,
                              N' is not a valid ', @typeText));
        FETCH NEXT FROM checks INTO @name, @base, @typeText, @maxLength, @value, @jsonType;
    END;
    CLOSE checks;
    DEALLOCATE checks;

    SELECT @problems = STRING_AGG(CAST(problem AS nvarchar(max)), N'; ') WITHIN GROUP (ORDER BY ord, problem) FROM @found;
    IF @problems IS NOT NULL
    BEGIN
        SET @message = LEFT(CONCAT(N'invalid arguments for ', @registered, N': ', @problems), 2048);
        THROW 50002, @message, 1;
    END;

    SET @queue = COALESCE(@queue, @registeredQueue);
    SELECT @service = service_name FROM asyncexec.AsyncExecQueues WHERE name = @queue;
    IF @service IS NULL
    BEGIN
        SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
        THROW 50003, @message, 1;
    END;

    IF @batchId IS NOT NULL OR @stage IS NOT NULL
    BEGIN
        -- The batch lock must last until the call is written and committed: outside a
        -- transaction it would end with this statement, and a settle could release the
        -- stage before a call held for it is inserted (it would stay held for ever).
        IF @@TRANCOUNT = 0
        BEGIN
            SET @message = N'invoke the calls of a batch inside a transaction (the one that creates the batch)';
            THROW 50005, @message, 1;
        END;
        SELECT @batchStatus = status, @currentStage = current_stage, @stageCount = stage_count
        FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE id = @batchId;
        IF @batchStatus IS NULL OR @batchStatus <> 'RUNNING' OR @stage IS NULL OR @stage < @currentStage OR @stage > @stageCount
        BEGIN
            SET @message = CONCAT(N'cannot add a call to stage ', COALESCE(CAST(@stage AS nvarchar(11)), N'(none)'), N' of batch ',
                                  COALESCE(LOWER(CONVERT(nvarchar(36), @batchId)), N'(none)'), N': ',
                                  CASE WHEN @batchStatus IS NULL THEN N'no such batch'
                                       WHEN @batchStatus <> 'RUNNING' THEN N'the batch has ended'
                                       ELSE CONCAT(N'its stages ', @currentStage, N' to ', @stageCount, N' are open') END);
            THROW 50005, @message, 1;
        END;
        SET @held = CASE WHEN @stage > @currentStage THEN 1 ELSE 0 END;
    END;

    SET @status = CASE WHEN @held = 1 OR @runAt > SYSUTCDATETIME() THEN 'WAITING' ELSE 'PENDING' END;

    -- Writes: under a savepoint inside the caller's transaction, or in our own.
    DECLARE @trancount int = @@TRANCOUNT, @h uniqueidentifier, @body xml;
    IF @trancount = 0
        BEGIN TRANSACTION;
    ELSE
        SAVE TRANSACTION usp_AsyncExecInvoke;
    BEGIN TRY
        SET @token = NEWID();
        IF @held = 0
        BEGIN
            BEGIN DIALOG CONVERSATION @h
                FROM SERVICE [asyncexec/NotifyService]
                TO SERVICE @service, 'CURRENT DATABASE'
                ON CONTRACT [asyncexec/Contract]
                WITH ENCRYPTION = OFF;
        END;
        INSERT asyncexec.AsyncExecResults
            (token, [procedure], arguments, queue, status, run_at, max_attempts, submitted_by, submitted_login, initiator_handle,
             batch_id, stage, held)
        VALUES
            (@token, @registered, @arguments, @queue, @status, @runAt, COALESCE(@maxAttempts, @registeredAttempts),
             @submittedBy, ORIGINAL_LOGIN(), @h, @batchId, @stage, @held);
        SET @id = SCOPE_IDENTITY();
        IF @held = 0
        BEGIN
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            -- Sent now even when WAITING: the reader arms the dialog's timer for run_at.
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);
        END;
        IF @trancount = 0
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() = -1
            ROLLBACK TRANSACTION;                         -- doomed: only a full rollback is possible
        ELSE IF XACT_STATE() = 1 AND @trancount = 0
            ROLLBACK TRANSACTION;                         -- our own transaction
        ELSE IF XACT_STATE() = 1 AND @trancount > 0
            ROLLBACK TRANSACTION usp_AsyncExecInvoke;     -- the savepoint saved above, by the same name
        THROW;
    END CATCH;
END;
GO

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
GO

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecAbandon
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
            @now datetime2(3), @batchId uniqueidentifier, @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8));

    SELECT @receive = N'RECEIVE TOP (1) @x = conversation_handle FROM asyncexec.' + QUOTENAME(queue_object)
                    + N' WHERE conversation_handle = @h;'
    FROM asyncexec.AsyncExecQueues
    WHERE name = @queue;
    IF @id IS NULL
        SELECT @id = id FROM asyncexec.AsyncExecResults WHERE target_handle = @h;
    SELECT @batchId = batch_id FROM asyncexec.AsyncExecResults WHERE id = @id;

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
            -- a batch member locks its batch before its own row (see the header)
            IF @batchId IS NOT NULL
                SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
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
            IF @batchId IS NOT NULL
                EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
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
            @batchStatus varchar(10), @rows int;
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
               @locked = 0, @resource = NULL, @errNumber = NULL, @errMessage = NULL, @newStatus = NULL, @cancel = NULL,
               @batchId = NULL;
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
                        -- a batch member locks its batch before its own row (see the header)
                        IF @batchId IS NOT NULL
                            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                            WHERE id = @batchId;
                        SET @now = SYSUTCDATETIME();
                        UPDATE asyncexec.AsyncExecResults
                           SET status = 'FAILED', finished_at = @now, error_number = 50011, error_severity = 16, error_state = 1,
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

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecCancel
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
            @lock int, @wait int, @initiator uniqueidentifier, @state char(2), @body xml, @now datetime2(3),
            @batchId uniqueidentifier, @batchStatus varchar(10);
    SELECT @id = NULL, @status = NULL;

    SELECT @id = id, @status = status, @batchId = batch_id FROM asyncexec.AsyncExecResults WHERE token = @token;
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
        -- a batch member that may end here locks its batch before its own row (lock order above)
        IF @batchId IS NOT NULL AND @lock >= 0
            SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
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
        -- held = 0: a held batch member that ends is no longer waiting for its stage (as on PostgreSQL)
        UPDATE asyncexec.AsyncExecResults
           SET status = 'CANCELLED', finished_at = @now, cancel_requested = 1, held = 0
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
        -- a cancelled batch member may complete its stage, or (onFailure CANCEL) cancel its batch
        IF @batchId IS NOT NULL
            EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecSettleCancel
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
            @now datetime2(3), @cursor varchar(18), @reply xml, @batchId uniqueidentifier, @batchStatus varchar(10);
    DECLARE @changed TABLE (v binary(8));
    SET @status = NULL;

    SELECT @status = e.status, @cancel = e.cancel_requested, @h = e.target_handle, @batchId = e.batch_id,
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
            -- a batch member locks its batch before its own row (lock order above)
            IF @batchId IS NOT NULL
                SELECT @batchStatus = status FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE id = @batchId;
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
                IF @batchId IS NOT NULL
                    EXEC asyncexec.usp_AsyncExecBatchSettle @batchId = @batchId;
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

CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPurge
    @olderThanSeconds int,
    @batchSize int = 5000
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @cutoff datetime2(3) = DATEADD(second, -@olderThanSeconds, SYSUTCDATETIME()), @deleted int = 0, @n int = 1;
    WHILE @n > 0
    BEGIN
        DELETE TOP (@batchSize) e
        FROM asyncexec.AsyncExecResults AS e
        WHERE e.finished_at < @cutoff AND e.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND (e.batch_id IS NULL
               -- finished_at is set exactly when the batch is no longer RUNNING (CK_AsyncExecBatches_finished)
               OR EXISTS (SELECT 1 FROM asyncexec.AsyncExecBatches AS b WHERE b.id = e.batch_id AND b.finished_at < @cutoff));
        SET @n = @@ROWCOUNT;
        SET @deleted += @n;
    END;
    SET @n = 1;
    WHILE @n > 0
    BEGIN
        -- a batch finishes after its members, so the loop above has taken them all
        DELETE TOP (@batchSize) b
        FROM asyncexec.AsyncExecBatches AS b
        WHERE b.finished_at < @cutoff AND b.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults AS e WHERE e.batch_id = b.id);
        SET @n = @@ROWCOUNT;
    END;
    DELETE FROM asyncexec.AsyncExecErrors WHERE logged_at < @cutoff;
    SELECT @deleted AS deleted;
END;
GO
