-- Demo procedures: installed and registered by installDemo() (ASYNCPROC_DEMO=1).
-- Re-runnable: every batch creates, alters or skips. Same names and behaviour as on PostgreSQL.
IF SCHEMA_ID(N'demo') IS NULL
    EXEC (N'CREATE SCHEMA demo AUTHORIZATION dbo');
GO

IF OBJECT_ID(N'demo.ledger', N'U') IS NULL
BEGIN
    CREATE TABLE demo.ledger (
        id          bigint IDENTITY(1, 1) NOT NULL CONSTRAINT PK_ledger PRIMARY KEY,
        tag         nvarchar(200) NOT NULL,
        recorded_at datetime2(3)  NOT NULL CONSTRAINT DF_ledger_recorded DEFAULT (SYSUTCDATETIME())
    );
    CREATE INDEX IX_ledger_tag ON demo.ledger (tag);
END;
GO

CREATE OR ALTER PROCEDURE demo.sleep
    @seconds float
AS
BEGIN
    SET NOCOUNT ON;
    -- WAITFOR DELAY takes a time of day up to 24 hours, given here as a datetime variable
    DECLARE @delay datetime = DATEADD(millisecond, CAST(@seconds * 1000 AS int), CAST(0 AS datetime));
    -- reports its progress (usp_AsyncExecProgress) as it starts and as it wakes
    EXEC asyncexec.usp_AsyncExecProgress @percent = 0, @message = N'sleeping';
    WAITFOR DELAY @delay;
    EXEC asyncexec.usp_AsyncExecProgress @percent = 100, @message = N'awake';
END;
GO

-- Live progress seen while a call runs: records @tag (visible only when the call commits),
-- reports half way, then holds until a row tagged @tag + '/go' is committed (by another call of
-- demo.record), at most two minutes, and reports done.
CREATE OR ALTER PROCEDURE demo.halfway
    @tag nvarchar(190)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @deadline datetime2(3) = DATEADD(second, 120, SYSUTCDATETIME()), @go nvarchar(200) = @tag + N'/go';
    INSERT demo.ledger (tag) VALUES (@tag);
    EXEC asyncexec.usp_AsyncExecProgress @percent = 50, @message = N'half way';
    -- each statement reads the latest committed rows (READ_COMMITTED_SNAPSHOT: a statement-level snapshot)
    WHILE NOT EXISTS (SELECT 1 FROM demo.ledger WHERE tag = @go) AND SYSUTCDATETIME() < @deadline
        WAITFOR DELAY '00:00:00.050';
    EXEC asyncexec.usp_AsyncExecProgress @percent = 100, @message = N'done';
END;
GO

CREATE OR ALTER PROCEDURE demo.fail
    @message nvarchar(2048)
AS
BEGIN
    SET NOCOUNT ON;
    THROW 50000, @message, 1;
END;
GO

CREATE OR ALTER PROCEDURE demo.[add]   -- ADD is a reserved word
    @a int,
    @b int,
    @total int OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @total = @a + @b;
END;
GO

CREATE OR ALTER PROCEDURE demo.record
    @tag nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    INSERT demo.ledger (tag) VALUES (@tag);
END;
GO

CREATE OR ALTER PROCEDURE demo.noop
AS
BEGIN
    SET NOCOUNT ON;
END;
GO

-- The run path (docs/mssql.md, "How a call runs"): money keeps four decimals, a datetime given
-- as yyyy-mm-dd is that day whatever the session's language, a procedure that commits the
-- transaction it was called in fails (50014) and is not run again.
CREATE OR ALTER PROCEDURE demo.echo_money
    @amount money,
    @same   money OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SET @same = @amount;
END;
GO

CREATE OR ALTER PROCEDURE demo.date_parts
    @at    datetime,
    @month int OUTPUT,
    @day   int OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    SELECT @month = MONTH(@at), @day = DAY(@at);
END;
GO

CREATE OR ALTER PROCEDURE demo.commit_outer
    @tag nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    INSERT demo.ledger (tag) VALUES (@tag);
    COMMIT;   -- breaks the rule for called procedures: it commits the caller's transaction
END;
GO

EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.sleep';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.fail';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.add';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.record';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.noop';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.echo_money';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.date_parts';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.commit_outer';
EXEC asyncexec.usp_AsyncExecRegister @procedure = N'demo.halfway';
GO
