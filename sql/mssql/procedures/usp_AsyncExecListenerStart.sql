-- Register a listener: its own wake-up queue asyncexec.[AsyncExecWake_<instance>] and
-- service [asyncexec/Wake/<instance>] (target of [asyncexec/WakeContract]), and its row in
-- asyncexec.AsyncExecListeners. Run by each service instance when its listener starts,
-- and again when the listener finds itself swept (a pause longer than @staleSeconds).
-- Also sweeps listeners that stopped sending heartbeats (their rows are returned).
--
-- EXECUTE AS OWNER (dbo): CREATE QUEUE and CREATE SERVICE are for db_ddladmin, db_owner
-- and sysadmin only, and CREATE SERVICE needs REFERENCES on the queue and the contract
-- (CREATE QUEUE, CREATE SERVICE: Permissions); as the schema's owner dbo has all of it,
-- so the service's login needs nothing but EXECUTE on this procedure. A login without it
-- gets error 229, and the listener then falls back to polling (docs/mssql.md).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecListenerStart
    @instance     uniqueidentifier,
    @host         nvarchar(128) = NULL,
    @processId    int = NULL,
    @staleSeconds int = 60
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @name nvarchar(32) = REPLACE(LOWER(CONVERT(nvarchar(36), @instance)), N'-', N''),
            @sql nvarchar(max), @lock int, @message nvarchar(2048);
    DECLARE @queue sysname = N'AsyncExecWake_' + @name,
            @service nvarchar(256) = N'asyncexec/Wake/' + @name;
    IF @instance IS NULL
    BEGIN
        SET @message = N'@instance is required';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    EXEC asyncexec.usp_AsyncExecListenerSweep @staleSeconds = @staleSeconds;

    BEGIN TRANSACTION;
    EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/listeners', @LockMode = 'Exclusive',
                                   @LockOwner = 'Transaction', @LockTimeout = 10000;
    IF @lock < 0
    BEGIN
        SET @message = N'could not take the listener registry lock within 10 seconds';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50030, @message, 1;
    END;

    -- No activation: the listener itself waits on it (usp_AsyncExecListenerWait). Poison
    -- handling off as on every queue of ours; its RECEIVEs are never rolled back anyway.
    IF OBJECT_ID(N'asyncexec.' + QUOTENAME(@queue), N'SQ') IS NULL
    BEGIN
        SET @sql = N'CREATE QUEUE asyncexec.' + QUOTENAME(@queue)
                 + N' WITH STATUS = ON, RETENTION = OFF, POISON_MESSAGE_HANDLING (STATUS = OFF);';
        EXEC sys.sp_executesql @sql;
    END;
    -- Target of wake-ups (the contract), and initiator of the dialogs this listener uses to
    -- wake the others: their EndDialog and Error messages come back to its own queue.
    IF NOT EXISTS (SELECT 1 FROM sys.services WHERE name = @service)
    BEGIN
        SET @sql = N'CREATE SERVICE ' + QUOTENAME(@service) + N' ON QUEUE asyncexec.' + QUOTENAME(@queue)
                 + N' ([asyncexec/WakeContract]);';
        EXEC sys.sp_executesql @sql;
    END;

    UPDATE asyncexec.AsyncExecListeners SET heartbeat_at = SYSUTCDATETIME(), host = @host, process_id = @processId
     WHERE instance_id = @instance;
    IF @@ROWCOUNT = 0
        INSERT asyncexec.AsyncExecListeners (instance_id, queue_object, service_name, host, process_id)
        VALUES (@instance, @queue, @service, @host, @processId);
    COMMIT TRANSACTION;
END;
