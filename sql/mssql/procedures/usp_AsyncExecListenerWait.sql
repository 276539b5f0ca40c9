-- One wait of a listener on its own wake-up queue: record the heartbeat, wait up to
-- @waitMs for wake-ups, end the dialogs whose EndDialog or Error arrived (a listener that
-- stopped, or was swept, ended its side or dropped its service). Returns one row: wakes
-- (Wake messages taken), ended, failed (ends that failed), and registered = 0 when this
-- listener is no longer registered (swept after a pause: the caller registers again).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecListenerWait
    @instance uniqueidentifier,
    @waitMs   int = 5000
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    -- OFF: each END CONVERSATION below is its own autocommit statement in its own TRY...CATCH
    SET XACT_ABORT OFF;
    DECLARE @queue sysname, @sql nvarchar(max);
    IF @waitMs IS NULL OR @waitMs NOT BETWEEN 0 AND 600000 SET @waitMs = 5000;

    UPDATE asyncexec.AsyncExecListeners SET heartbeat_at = SYSUTCDATETIME(), @queue = queue_object
     WHERE instance_id = @instance;
    IF @queue IS NULL OR OBJECT_ID(N'asyncexec.' + QUOTENAME(@queue), N'SQ') IS NULL
    BEGIN
        SELECT 0 AS wakes, 0 AS ended, 0 AS failed, CAST(0 AS bit) AS registered;
        RETURN;
    END;

    -- The queue's name is ours (AsyncExecWake_ and hex digits), quoted; the timeout is an int.
    -- No transaction: a wake-up lost with a crash costs nothing (the table is the truth,
    -- and the hub polls), and a RECEIVE never rolled back cannot trip poison handling.
    SET @sql = N'DECLARE @m TABLE (conversation_handle uniqueidentifier, message_type_name sysname);
DECLARE @h uniqueidentifier, @ended int = 0, @failed int = 0;
WAITFOR (RECEIVE conversation_handle, message_type_name FROM asyncexec.' + QUOTENAME(@queue) + N' INTO @m), TIMEOUT '
             + CAST(@waitMs AS nvarchar(10)) + N';
DECLARE ends CURSOR LOCAL STATIC FOR
    SELECT DISTINCT conversation_handle FROM @m
     WHERE message_type_name IN (N''http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog'', N''http://schemas.microsoft.com/SQL/ServiceBroker/Error'');
OPEN ends;
FETCH NEXT FROM ends INTO @h;
WHILE @@FETCH_STATUS = 0
BEGIN
    BEGIN TRY
        END CONVERSATION @h;
        SET @ended += 1;
    END TRY
    BEGIN CATCH
        SET @failed += 1;
    END CATCH;
    DELETE asyncexec.AsyncExecListenerDialogs WHERE conversation_handle = @h;
    FETCH NEXT FROM ends INTO @h;
END;
CLOSE ends;
DEALLOCATE ends;
SELECT (SELECT COUNT(*) FROM @m WHERE message_type_name = N''asyncexec/Wake'') AS wakes, @ended AS ended, @failed AS failed,
       CAST(1 AS bit) AS registered;';
    EXEC sys.sp_executesql @sql;
END;
