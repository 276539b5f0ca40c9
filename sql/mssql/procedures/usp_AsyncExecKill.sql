-- KILL the session running a call, only if it still holds the call's application lock
-- (the reader running it holds it, session-owned, from its claim until its outcome has
-- committed). The service calls this outside any transaction (KILL cannot run inside one)
-- while another of its connections holds the call's row with UPDLOCK: the reader cannot
-- record an outcome meanwhile, so it cannot have moved on to another call. A session that
-- is gone holds no lock, so a reused session id never matches. Needs ALTER ANY CONNECTION
-- (KILL) and VIEW SERVER STATE (sys.dm_tran_locks, sys.dm_exec_requests).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecKill
    @id        bigint,
    @sessionId int,
    @killed    bit = 0 OUTPUT
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
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
        SET @message = REPLACE(@message, N'%', N'%%');
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
