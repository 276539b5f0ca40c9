-- usp_AsyncExecFireSchedule: fire one due schedule, as the service planned it (src/schedules.ts):
-- @due is the schedule's next_run_at as the service read it, @next the instant after it that
-- croner computed, @missed whether @due was missed (the service was down past it).
--
-- Exactly once (as asyncproc.fire_due_schedules on PostgreSQL):
--   * the fire is one transaction that moves next_run_at from @due to @next and invokes the
--     call (usp_AsyncExecInvoke inserts the row and SENDs its request in our transaction), so
--     both commit or neither does;
--   * the row is taken WITH (UPDLOCK, READPAST, ROWLOCK) and only while next_run_at still
--     equals @due (a compare-and-set under the lock). UPDLOCK: "update locks are to be taken
--     and held until the transaction completes" (Table Hints), and a locking read sees the
--     latest committed row, not the row version READ_COMMITTED_SNAPSHOT would give; READPAST:
--     a row another process is firing now is skipped, not waited for. A racer therefore finds
--     the row locked, or finds next_run_at moved on, and fires nothing;
--   * nothing is written before that transaction: a crash before its commit leaves next_run_at
--     at @due (the next round fires it), a crash after it leaves the fire done and next_run_at
--     moved on (never again).
-- A call refused now (procedure unregistered or changed since the schedule was made, queue
-- gone: 50001, 50002, 50003, 50005, 50009) fails visibly: a FAILED call of the schedule holding
-- the refusal, written in a second transaction under the same compare-and-set (the refusal
-- dooms the first under XACT_ABORT ON: "the entire transaction is terminated and rolled back").
-- Outputs: @id, the call started or recorded FAILED (NULL: none); @fired, whether it fired
-- (0: taken by another process, not due, paused, or passed over by catch_up SKIP / overlap SKIP).
-- Errors: 50043 called inside an open transaction (a fire is a transaction of its own), 50005
-- a @next not after @due.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecFireSchedule
    @name   nvarchar(128),
    @due    datetime2(3),
    @next   datetime2(3),          -- NULL: the cron expression has no later instant
    @missed bit,
    @now    datetime2(3),          -- the service's clock, which computed @next
    @id     bigint = NULL OUTPUT,
    @fired  bit = 0 OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
    -- a client that gives up mid-fire (an attention, which TRY...CATCH never sees) leaves no
    -- transaction open on a pooled connection: it is rolled back
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @procedure nvarchar(261), @arguments nvarchar(max), @queue nvarchar(100),
            @maxAttempts int, @overlap varchar(5), @catchUp varchar(4), @createdBy nvarchar(256), @lastId bigint,
            @previous varchar(10), @token uniqueidentifier, @refusal int, @refusalMessage nvarchar(4000),
            @refusalState int, @registeredQueue nvarchar(100), @registeredName nvarchar(261), @recordedQueue nvarchar(100);
    SELECT @id = NULL, @fired = 0;
    IF @@TRANCOUNT > 0
    BEGIN
        SET @message = N'usp_AsyncExecFireSchedule runs in a transaction of its own';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50043, @message, 1;
    END;
    IF @next IS NOT NULL AND @next <= @due
    BEGIN
        SET @message = CONCAT(N'schedule "', @name, N'": next run ', CONVERT(nvarchar(30), @next, 126), N' is not after ',
                              CONVERT(nvarchar(30), @due, 126));
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    BEGIN TRANSACTION;
    SELECT @procedure = s.[procedure], @arguments = s.arguments, @queue = s.queue, @maxAttempts = s.max_attempts,
           @overlap = s.overlap, @catchUp = s.catch_up, @createdBy = s.created_by, @lastId = s.last_execution_id
    FROM asyncexec.AsyncExecSchedules AS s WITH (UPDLOCK, READPAST, ROWLOCK)
    WHERE s.name = @name AND s.next_run_at = @due AND s.paused = 0 AND s.next_run_at <= @now;
    IF @procedure IS NULL
    BEGIN
        COMMIT TRANSACTION;
        RETURN;
    END;

    -- missed instants (everything was down) collapse into one fire (catch_up ONCE) or none (SKIP)
    SET @fired = CASE WHEN @missed = 0 OR @catchUp = 'ONCE' THEN 1 ELSE 0 END;
    IF @fired = 1 AND @overlap = 'SKIP' AND @lastId IS NOT NULL
    BEGIN
        SELECT @previous = status FROM asyncexec.AsyncExecResults WHERE id = @lastId;
        IF @previous IN ('WAITING', 'PENDING', 'RUNNING') SET @fired = 0;
    END;

    IF @fired = 1
    BEGIN
        BEGIN TRY
            -- @runAt: the instant this call stands for (in the past or now: PENDING at once)
            EXEC asyncexec.usp_AsyncExecInvoke
                @procedure = @procedure, @arguments = @arguments, @queue = @queue, @runAt = @due,
                @maxAttempts = @maxAttempts, @submittedBy = @createdBy, @token = @token OUTPUT, @id = @id OUTPUT;
        END TRY
        BEGIN CATCH
            IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
            IF ERROR_NUMBER() NOT IN (50001, 50002, 50003, 50005, 50009)
            BEGIN
                THROW;
            END;
            SELECT @refusal = ERROR_NUMBER(), @refusalMessage = ERROR_MESSAGE(), @refusalState = ERROR_STATE(), @id = NULL;
        END CATCH;
    END;

    IF @refusal IS NOT NULL
    BEGIN
        BEGIN TRANSACTION;
        IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecSchedules AS s WITH (UPDLOCK, READPAST, ROWLOCK)
                       WHERE s.name = @name AND s.next_run_at = @due AND s.paused = 0)
        BEGIN
            COMMIT TRANSACTION;
            SET @fired = 0;
            RETURN;
        END;
        -- the names as registered and created where they exist (the schedule keeps them as
        -- typed, and a case-insensitive database found them): filters and the change feed
        -- compare exactly, as for the calls usp_AsyncExecInvoke records
        SELECT @registeredQueue = r.queue, @registeredName = r.name FROM asyncexec.AsyncExecProcedures AS r WHERE r.name = @procedure;
        SELECT @recordedQueue = q.name FROM asyncexec.AsyncExecQueues AS q WHERE q.name = COALESCE(@queue, @registeredQueue, N'default');
        INSERT asyncexec.AsyncExecResults
            (token, [procedure], arguments, queue, status, run_at, finished_at, max_attempts, submitted_by, submitted_login,
             error_number, error_severity, error_state, error_procedure, error_message, schedule_name)
        VALUES
            (NEWID(), COALESCE(@registeredName, @procedure), @arguments, COALESCE(@recordedQueue, @queue, @registeredQueue, N'default'), 'FAILED', @due, SYSUTCDATETIME(),
             COALESCE(@maxAttempts, 1), @createdBy, ORIGINAL_LOGIN(), @refusal, 16, @refusalState, N'usp_AsyncExecFireSchedule',
             LEFT(CONCAT(N'schedule "', @name, N'": ', @refusalMessage), 4000), @name);
        SET @id = SCOPE_IDENTITY();
    END
    ELSE IF @id IS NOT NULL
        UPDATE asyncexec.AsyncExecResults SET schedule_name = @name WHERE id = @id;

    UPDATE asyncexec.AsyncExecSchedules
    SET next_run_at = @next,
        last_run_at = CASE WHEN @fired = 1 THEN @now ELSE last_run_at END,
        last_execution_id = COALESCE(@id, last_execution_id)
    WHERE name = @name;
    COMMIT TRANSACTION;
END;
