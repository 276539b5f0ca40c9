-- Remove one listener's wake-up queue, service, dialogs and registration: run by the
-- listener itself when it closes, and by usp_AsyncExecListenerSweep for a listener that
-- stopped sending heartbeats (its process died). Idempotent.
--
-- EXECUTE AS OWNER (dbo), so the service's login needs only EXECUTE here, and every
-- statement below is allowed: DROP SERVICE / DROP QUEUE default to the owner, db_ddladmin
-- and db_owner; END CONVERSATION to the conversation's owner, db_owner and sysadmin
-- (DROP SERVICE, DROP QUEUE, END CONVERSATION: Permissions).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecListenerStop
    @instance uniqueidentifier
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    -- OFF: an END CONVERSATION that fails below is caught and skipped; under ON any error in
    -- a TRY block makes the transaction uncommittable (XACT_STATE() = -1: only a full
    -- rollback is allowed), so one bad dialog would keep the listener registered for ever.
    SET XACT_ABORT OFF;
    DECLARE @name nvarchar(32) = REPLACE(LOWER(CONVERT(nvarchar(36), @instance)), N'-', N''),
            @h uniqueidentifier, @sql nvarchar(max), @lock int, @message nvarchar(2048);
    DECLARE @queue sysname = N'AsyncExecWake_' + @name,
            @service nvarchar(256) = N'asyncexec/Wake/' + @name;
    DECLARE @dialogs TABLE (h uniqueidentifier PRIMARY KEY);

    BEGIN TRY
        BEGIN TRANSACTION;
        -- Start, Stop and Sweep take turns: nobody creates what another is dropping. The
        -- wait is shorter than the service's 15-second request timeout.
        EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/listeners', @LockMode = 'Exclusive',
                                       @LockOwner = 'Transaction', @LockTimeout = 10000;
        IF @lock < 0
        BEGIN
            SET @message = N'could not take the listener registry lock within 10 seconds';
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50030, @message, 1;
        END;

        -- First out of the registry, so no waker picks this listener any more.
        DELETE asyncexec.AsyncExecListeners WHERE instance_id = @instance;
        DELETE asyncexec.AsyncExecListenerDialogs WHERE from_instance = @instance OR to_instance = @instance;

        -- End both kinds of its dialogs (those it began to wake others, those others began to
        -- wake it): every local endpoint of a dialog belongs to the local service. Each
        -- END sends EndDialog to the other listener, which ends its side when it receives it
        -- (usp_AsyncExecListenerWait). CD (closed) endpoints are only kept for replay
        -- protection and cannot be ended again.
        INSERT @dialogs (h)
        SELECT ce.conversation_handle
          FROM sys.conversation_endpoints AS ce
          JOIN sys.services AS s ON s.service_id = ce.service_id
         WHERE s.name = @service AND ce.state <> 'CD';
        WHILE 1 = 1
        BEGIN
            SET @h = (SELECT TOP (1) h FROM @dialogs);
            IF @h IS NULL BREAK;
            DELETE @dialogs WHERE h = @h;
            SAVE TRANSACTION listener_end;
            BEGIN TRY
                END CONVERSATION @h;
            END TRY
            BEGIN CATCH
                -- a dialog that cannot be ended is left to DROP SERVICE below, which "sends an
                -- error to the remote side of any open conversations that use the service"
                -- doomed (-1), or ended by the error itself (0): no savepoint is left to return to
                IF XACT_STATE() <> 1
                BEGIN
                    THROW;
                END;
                ROLLBACK TRANSACTION listener_end;
            END CATCH;
        END;

        -- "Dropping a service deletes all messages for the service from the queue" (DROP SERVICE);
        -- a queue cannot be dropped while a service uses it.
        IF EXISTS (SELECT 1 FROM sys.services WHERE name = @service)
        BEGIN
            SET @sql = N'DROP SERVICE ' + QUOTENAME(@service) + N';';
            EXEC sys.sp_executesql @sql;
        END;
        IF OBJECT_ID(N'asyncexec.' + QUOTENAME(@queue), N'SQ') IS NOT NULL
        BEGIN
            SET @sql = N'DROP QUEUE asyncexec.' + QUOTENAME(@queue) + N';';
            EXEC sys.sp_executesql @sql;
        END;
        COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
