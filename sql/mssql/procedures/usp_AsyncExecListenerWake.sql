-- Wake every other live listener: one empty [asyncexec/Wake] message each, on the dialog
-- this listener keeps for that receiver (begun on first use, begun again when it has
-- ended). Called by a listener after it committed a RECEIVE that took messages from the
-- notification queue, so each batch costs one send per other listener and a call costs
-- none. A send that fails is skipped and reported; it never undoes another.
-- Returns one row: sent, failed, and the first error's number and message.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecListenerWake
    @instance     uniqueidentifier,
    @staleSeconds int = 60
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    -- Our BEGIN/COMMIT must be real transactions even for a caller whose session has
    -- IMPLICIT_TRANSACTIONS ON (pyodbc, JDBC autoCommit=false, SET ANSI_DEFAULTS ON): there, a
    -- first SELECT opens a transaction our COMMIT only nests in, and all of it rolls back when the
    -- caller disconnects. A SET in a procedure is restored when it returns (SET statements,
    -- "Considerations when you use the SET statements").
    SET IMPLICIT_TRANSACTIONS OFF;
    -- OFF: no transaction is opened here; each BEGIN DIALOG / SEND is its own autocommit
    -- statement inside its own TRY...CATCH, so a failure affects that receiver only.
    SET XACT_ABORT OFF;
    DECLARE @name nvarchar(32) = REPLACE(LOWER(CONVERT(nvarchar(36), @instance)), N'-', N''),
            @to uniqueidentifier, @toService nvarchar(256), @h uniqueidentifier, @usable bit,
            @sent int = 0, @failed int = 0, @errNumber int, @errMessage nvarchar(4000), @begin nvarchar(max);
    DECLARE @targets TABLE (instance_id uniqueidentifier PRIMARY KEY, service_name nvarchar(256) NULL, h uniqueidentifier NULL, usable bit NULL);

    -- each send is its own transaction and a failed one is rolled back whole ("ROLLBACK
    -- TRANSACTION": without a savepoint name it goes to the outermost BEGIN TRAN): inside a
    -- caller's transaction that would undo the caller's work and end with error 266
    IF @@TRANCOUNT > 0
    BEGIN
        THROW 50044, N'usp_AsyncExecListenerWake sends each wake-up in a transaction of its own: call it outside a transaction', 1;
    END;

    IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecListeners WHERE instance_id = @instance)
    BEGIN
        -- swept, or never registered: nothing to send from (the caller registers again)
        SELECT 0 AS sent, 0 AS failed, 50031 AS error_number, N'this listener is not registered' AS error_message;
        RETURN;
    END;

    -- Live receivers only: a service that does not exist would leave each message in
    -- sys.transmission_queue ("If a condition prevents a local message from being put
    -- directly in the target service queue, it can be stored in the transmission queue", SEND),
    -- and a listener without a heartbeat for @staleSeconds is about to be swept.
    INSERT @targets (instance_id, service_name, h, usable)
    SELECT l.instance_id, l.service_name, d.conversation_handle,
           -- reusable while both sides are open: SO (started outbound, nothing received
           -- yet) or CO (conversing); DI, DO, ER, CD mean it has ended or is ending
           CASE WHEN ce.state IN ('SO', 'CO') THEN 1 ELSE 0 END
      FROM asyncexec.AsyncExecListeners AS l
      -- sys.services.name is the case-sensitive Broker name (sys.services: "Case-sensitive name of
      -- service"), with a collation of its own: two column collations in one comparison are a
      -- conflict (Msg 468) unless one is named; BIN2 compares it as Broker does, exactly
      JOIN sys.services AS s ON s.name = l.service_name COLLATE Latin1_General_BIN2
      LEFT JOIN asyncexec.AsyncExecListenerDialogs AS d ON d.from_instance = @instance AND d.to_instance = l.instance_id
      LEFT JOIN sys.conversation_endpoints AS ce ON ce.conversation_handle = d.conversation_handle AND ce.is_initiator = 1
     WHERE l.instance_id <> @instance
       AND l.heartbeat_at >= DATEADD(second, -@staleSeconds, SYSUTCDATETIME());

    -- FROM SERVICE takes a name, not a variable (BEGIN DIALOG CONVERSATION): our own
    -- service's name, made of the instance's hex digits only, goes in quoted.
    SET @begin = N'BEGIN DIALOG CONVERSATION @h FROM SERVICE ' + QUOTENAME(N'asyncexec/Wake/' + @name)
               + N' TO SERVICE @toService, ''CURRENT DATABASE'' ON CONTRACT [asyncexec/WakeContract] WITH ENCRYPTION = OFF;';

    WHILE 1 = 1
    BEGIN
        SELECT TOP (1) @to = instance_id, @toService = service_name, @h = h, @usable = usable FROM @targets;
        IF @@ROWCOUNT = 0 BREAK;
        DELETE @targets WHERE instance_id = @to;
        BEGIN TRY
            IF @usable = 0
            BEGIN
                IF @h IS NOT NULL
                BEGIN
                    BEGIN TRY
                        -- our side of a dialog the receiver ended or that failed: complete it
                        END CONVERSATION @h;
                    END TRY
                    BEGIN CATCH
                        SET @h = NULL;   -- already gone: nothing to end
                    END CATCH;
                END;
                SET @h = NULL;
                -- To begin a dialog: RECEIVE on the FROM service's queue and REFERENCES on
                -- the contract (BEGIN DIALOG CONVERSATION: Permissions); to send: RECEIVE on
                -- the sending service's queue (SEND: Permissions). dbo has both.
                EXEC sys.sp_executesql @begin, N'@h uniqueidentifier OUTPUT, @toService nvarchar(256)', @h = @h OUTPUT, @toService = @toService;
                DELETE asyncexec.AsyncExecListenerDialogs WHERE from_instance = @instance AND to_instance = @to;
                INSERT asyncexec.AsyncExecListenerDialogs (from_instance, to_instance, conversation_handle) VALUES (@instance, @to, @h);
            END;
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Wake];
            SET @sent += 1;
        END TRY
        BEGIN CATCH
            IF XACT_STATE() <> 0 ROLLBACK TRANSACTION;
            SET @failed += 1;
            IF @errNumber IS NULL SELECT @errNumber = ERROR_NUMBER(), @errMessage = ERROR_MESSAGE();
        END CATCH;
    END;
    SELECT @sent AS sent, @failed AS failed, @errNumber AS error_number, @errMessage AS error_message;
END;
