-- Delete finished history older than the retention, in small batches; returns how many calls
-- went (deleted) and whether some are left for the next run (more = 1: @maxSeconds ran out).
--
-- What goes: a call that has ended (SUCCEEDED, FAILED, CANCELLED; its dialogs are ended on
-- our side) before the cutoff, and not part of a batch, or part of a batch that itself ended
-- before the cutoff (a batch ends only after every member has: usp_AsyncExecBatchSettle); then
-- the batches so emptied; then the machinery's error log. Never an unfinished call (PENDING,
-- WAITING, RUNNING) nor any call of a batch still RUNNING (as asyncproc.purge on PostgreSQL).
-- Each call's attempts (asyncexec.AsyncExecAttempts) go in the same statement, through the
-- ON DELETE CASCADE of FK_AsyncExecAttempts_execution: the log never outlives its call.
--
-- Why batches, each its own transaction:
--   * one DELETE of a week of history holds its locks, and its log records, to its end: the
--     log cannot be truncated meanwhile and, past 5,000 locks on one table or index taken by
--     one statement, the Database Engine tries to escalate them to a table lock (Lock
--     Escalation), which would block every claim and invoke until the purge commits. So at
--     most @batchSize calls (default 1,000, with their attempts) per transaction, chosen
--     first and then deleted by primary key;
--   * @maxSeconds bounds the whole run (no new batch starts after it; default 10 s) below the
--     service's request timeout (mssql's requestTimeout, 15 s by default): the next run goes on
--     where this one stopped, since everything it committed stays committed;
--   * XACT_ABORT ON: if the client gives up anyway (an attention, which TRY...CATCH never
--     sees), the open batch's transaction is rolled back instead of left open on a pooled
--     connection, and the batches before it stay deleted.
-- Each batch raises the purge horizon (asyncexec.AsyncExecPurgeHorizon, 0015_purge_horizon.sql)
-- to the newest rowversion it deleted, in its own transaction: a subscriber resuming from a
-- cursor that may not have read a deleted call's last change is refused (CURSOR_EXPIRED).
-- Terminal rows never change again (statuses only move forward), so a call chosen in one
-- statement is still deletable in the next; the DELETE checks its status again all the same.
-- Errors: 50041 called inside an open transaction (its batches would not be transactions of
-- their own), 50005 a bad argument.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPurge
    @olderThanSeconds int,
    @batchSize int = 1000,   -- calls per transaction
    @maxSeconds int = 10     -- start no new batch after this long
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @cutoff datetime2(3), @deadline datetime2(3), @deleted int = 0, @n int, @more bit = 0;
    DECLARE @ids TABLE (id bigint PRIMARY KEY);
    -- the rowversions a batch deleted; emptied before each batch (the rows of the batches
    -- before it, committed, would stay)
    DECLARE @gone TABLE (row_version binary(8) NOT NULL);
    DECLARE @batches TABLE (id uniqueidentifier PRIMARY KEY);

    IF @@TRANCOUNT > 0
    BEGIN
        SET @message = N'usp_AsyncExecPurge runs its batches as transactions of their own: call it outside a transaction';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50041, @message, 1;
    END;
    IF @olderThanSeconds IS NULL OR @olderThanSeconds < 0 OR @batchSize IS NULL OR @batchSize NOT BETWEEN 1 AND 4000
       OR @maxSeconds IS NULL OR @maxSeconds < 1
    BEGIN
        SET @message = N'usp_AsyncExecPurge: @olderThanSeconds >= 0, @batchSize 1 to 4000, @maxSeconds >= 1';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    SELECT @cutoff = DATEADD(second, -@olderThanSeconds, SYSUTCDATETIME()),
           @deadline = DATEADD(second, @maxSeconds, SYSUTCDATETIME());

    -- 1. calls, @batchSize at a time
    WHILE 1 = 1
    BEGIN
        IF SYSUTCDATETIME() >= @deadline
        BEGIN
            SET @more = 1;
            BREAK;
        END;
        DELETE @ids;
        INSERT @ids (id)
        SELECT TOP (@batchSize) e.id
        FROM asyncexec.AsyncExecResults AS e
        WHERE e.finished_at < @cutoff AND e.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND (e.batch_id IS NULL
               -- finished_at is set exactly when the batch is no longer RUNNING (CK_AsyncExecBatches_finished)
               OR EXISTS (SELECT 1 FROM asyncexec.AsyncExecBatches AS b WHERE b.id = e.batch_id AND b.finished_at < @cutoff));
        IF @@ROWCOUNT = 0
            BREAK;
        DELETE @gone;
        BEGIN TRANSACTION;
        -- OUTPUT ... INTO a table variable: the deleted rows' rowversions (deleted.*), which
        -- the horizon takes before this transaction commits
        DELETE e
        OUTPUT deleted.row_version INTO @gone (row_version)
        FROM asyncexec.AsyncExecResults AS e
        JOIN @ids AS i ON i.id = e.id
        WHERE e.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED');
        SET @n = @@ROWCOUNT;
        -- the newest of them (TOP (1) ... ORDER BY: no row when none went, and nothing is
        -- updated). binary(8) compares byte by byte from the left, and a rowversion is stored
        -- most significant byte first (as readChanges' `row_version >= @from` relies on too): the
        -- byte order is the numeric order, and the horizon only rises
        UPDATE h SET row_version = g.newest
        FROM asyncexec.AsyncExecPurgeHorizon AS h
        CROSS JOIN (SELECT TOP (1) x.row_version AS newest FROM @gone AS x ORDER BY x.row_version DESC) AS g
        WHERE h.only_row = 1 AND h.row_version < g.newest;
        COMMIT TRANSACTION;
        SET @deleted += @n;
    END;

    -- 2. batches left without calls (a batch finishes after its members, so step 1 took them)
    WHILE @more = 0
    BEGIN
        IF SYSUTCDATETIME() >= @deadline
        BEGIN
            SET @more = 1;
            BREAK;
        END;
        DELETE @batches;
        INSERT @batches (id)
        SELECT TOP (@batchSize) b.id
        FROM asyncexec.AsyncExecBatches AS b
        WHERE b.finished_at < @cutoff AND b.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults AS e WHERE e.batch_id = b.id);
        IF @@ROWCOUNT = 0
            BREAK;
        BEGIN TRANSACTION;
        DELETE b
        FROM asyncexec.AsyncExecBatches AS b
        JOIN @batches AS x ON x.id = b.id
        WHERE b.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults AS e WHERE e.batch_id = b.id);
        COMMIT TRANSACTION;
    END;

    -- 3. the machinery's error log (autocommitted, @batchSize rows per statement)
    WHILE @more = 0
    BEGIN
        IF SYSUTCDATETIME() >= @deadline
        BEGIN
            SET @more = 1;
            BREAK;
        END;
        DELETE TOP (@batchSize) FROM asyncexec.AsyncExecErrors WHERE logged_at < @cutoff;
        IF @@ROWCOUNT = 0
            BREAK;
    END;

    SELECT @deleted AS deleted, @more AS more;
END;
