-- Remove every listener that has sent no heartbeat for @staleSeconds (its process died
-- without closing): its queue would otherwise collect a wake-up per notification batch
-- for ever. usp_AsyncExecListenerWake stops waking such a listener at the same age, so a
-- dead listener's queue holds at most @staleSeconds of wake-ups before it goes.
-- Returns one row per listener removed, and one per listener that could not be (with the
-- error), so the caller can log both.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecListenerSweep
    @staleSeconds int = 60
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT OFF;
    DECLARE @i uniqueidentifier;
    DECLARE @stale TABLE (instance_id uniqueidentifier PRIMARY KEY);
    DECLARE @done TABLE (instance_id uniqueidentifier NULL, error_number int NULL, error_message nvarchar(4000) NULL);
    IF @staleSeconds IS NULL OR @staleSeconds < 10 SET @staleSeconds = 10;

    INSERT @stale (instance_id)
    SELECT instance_id FROM asyncexec.AsyncExecListeners
     WHERE heartbeat_at < DATEADD(second, -@staleSeconds, SYSUTCDATETIME());
    WHILE 1 = 1
    BEGIN
        SET @i = (SELECT TOP (1) instance_id FROM @stale);
        IF @i IS NULL BREAK;
        DELETE @stale WHERE instance_id = @i;
        BEGIN TRY
            EXEC asyncexec.usp_AsyncExecListenerStop @instance = @i;
            INSERT @done (instance_id) VALUES (@i);
        END TRY
        BEGIN CATCH
            -- no transaction is open here (Stop rolled its own back): the next one is tried
            IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
            INSERT @done VALUES (@i, ERROR_NUMBER(), ERROR_MESSAGE());
        END CATCH;
    END;
    SELECT LOWER(CONVERT(nvarchar(36), instance_id)) AS instance_id, error_number, error_message FROM @done;
END;
