-- Create a queue, or change its concurrency. Each queue is its own Service Broker
-- queue + target service + parameterless reader procedure (activation calls its
-- procedure without arguments, so the reader passes its queue name on).
-- Errors: 50005 bad queue name or concurrency.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecCreateQueue
    @name        nvarchar(100),
    @concurrency int = 10
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048);
    IF @name IS NULL OR LEN(@name) NOT BETWEEN 1 AND 100 OR @name LIKE N'%[^A-Za-z0-9_.:-]%'
    BEGIN
        SET @message = CONCAT(N'queue name "', @name, N'" must be 1 to 100 characters of A-Z a-z 0-9 _ . : -');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @concurrency IS NULL OR @concurrency NOT BETWEEN 1 AND 1000
    BEGIN
        SET @message = CONCAT(N'queue concurrency must be between 1 and 1000, not ', @concurrency);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    DECLARE @queueObject sysname = N'AsyncExecQueue_' + @name,
            @service nvarchar(256) = N'asyncexec/Service/' + @name,
            @reader sysname = N'usp_AsyncExecActivated_' + @name,
            @sql nvarchar(max), @lock int;

    BEGIN TRANSACTION;
    -- Two callers creating the same queue at once would both find it missing and the
    -- second CREATE would fail: take turns (one resource for all queues; this is rare).
    -- Wait at most 10 s, less than the caller's own request timeout: the service's driver
    -- (mssql/tedious) cancels a request after config.requestTimeout, 15000 ms by default
    -- (DATABASE_URL requestTimeout, src/engines/mssql/url.ts). A lock wait that outlasted it
    -- would end in the client's attention instead of our error 50020: an attention is not
    -- caught by TRY...CATCH and ends the batch where it is, and only XACT_ABORT ON (set above)
    -- makes it roll back the open transaction rather than leave it on a pooled connection.
    -- sp_getapplock: @LockTimeout in milliseconds; a negative return (-1 timed out) means the
    -- lock was not granted.
    EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/configure-queue', @LockMode = 'Exclusive',
                                   @LockOwner = 'Transaction', @LockTimeout = 10000;
    IF @lock < 0
    BEGIN
        SET @message = N'could not take the queue configuration lock within 10 seconds (another configureQueue is running): try again';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50020, @message, 1;
    END;

    -- A queue registered already keeps the names it was made with. On a case-insensitive
    -- database N'Default' is the queue N'default' (the registry's key, OBJECT_ID and the
    -- reader's name compare under the database's collation), but a service's name is compared
    -- case-sensitively ("Case-sensitive name of service", sys.services), so names built from
    -- the spelling asked for would create a second service on the same queue, recorded nowhere.
    -- A SELECT that assigns and finds no row leaves the variables as they were (a new queue).
    SELECT @name = q.name, @queueObject = q.queue_object, @service = q.service_name, @reader = q.activation_procedure
    FROM asyncexec.AsyncExecQueues AS q
    WHERE q.name = @name;

    IF OBJECT_ID(N'asyncexec.' + QUOTENAME(@reader), N'P') IS NULL
    BEGIN
        SET @sql = N'CREATE PROCEDURE asyncexec.' + QUOTENAME(@reader) + N' AS EXEC asyncexec.usp_AsyncExecActivated @queue = N'
                 + QUOTENAME(@name, N'''') + N';';
        EXEC sys.sp_executesql @sql;
    END;

    IF OBJECT_ID(N'asyncexec.' + QUOTENAME(@queueObject), N'SQ') IS NULL
        SET @sql = N'CREATE QUEUE asyncexec.' + QUOTENAME(@queueObject) + N' WITH STATUS = ON, RETENTION = OFF, ';
    ELSE
        SET @sql = N'ALTER QUEUE asyncexec.' + QUOTENAME(@queueObject) + N' WITH ';
    -- EXECUTE AS OWNER: the reader runs as the owner of the queue (dbo), whoever invoked.
    -- On an existing queue, ALTER QUEUE changes MAX_QUEUE_READERS at once: a higher limit
    -- lets activation start more readers immediately; readers above a lower limit return
    -- after their current call (usp_AsyncExecActivated compares with the registry row
    -- updated below, in this same transaction).
    SET @sql += N'ACTIVATION (STATUS = ON, PROCEDURE_NAME = asyncexec.' + QUOTENAME(@reader)
              + N', MAX_QUEUE_READERS = ' + CAST(@concurrency AS nvarchar(10))
              + N', EXECUTE AS OWNER), POISON_MESSAGE_HANDLING (STATUS = OFF);';
    EXEC sys.sp_executesql @sql;

    IF NOT EXISTS (SELECT 1 FROM sys.services WHERE name = @service)
    BEGIN
        SET @sql = N'CREATE SERVICE ' + QUOTENAME(@service) + N' ON QUEUE asyncexec.' + QUOTENAME(@queueObject)
                 + N' ([asyncexec/Contract]);';
        EXEC sys.sp_executesql @sql;
    END;

    UPDATE asyncexec.AsyncExecQueues SET concurrency = @concurrency WHERE name = @name;
    IF @@ROWCOUNT = 0
        INSERT asyncexec.AsyncExecQueues (name, concurrency, queue_object, service_name, activation_procedure)
        VALUES (@name, @concurrency, @queueObject, @service, @reader);

    COMMIT TRANSACTION;
END;
