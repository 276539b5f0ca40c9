-- Signatures, queues and registration.

-- The declared type of a parameter as T-SQL text (`nvarchar(50)`, `decimal(10,2)`),
-- from the system base type so that alias types (sysname, user alias types) work in
-- DECLARE and TRY_CONVERT, which do not accept every alias.
CREATE FUNCTION asyncexec.TypeText (@system_type_id tinyint, @max_length smallint, @precision tinyint, @scale tinyint)
RETURNS nvarchar(128)
AS
BEGIN
    DECLARE @name sysname = TYPE_NAME(@system_type_id);
    RETURN CASE
        WHEN @name IN (N'varchar', N'char', N'varbinary', N'binary')
            THEN CONCAT(@name, N'(', CASE WHEN @max_length = -1 THEN N'max' ELSE CAST(@max_length AS nvarchar(10)) END, N')')
        WHEN @name IN (N'nvarchar', N'nchar')
            THEN CONCAT(@name, N'(', CASE WHEN @max_length = -1 THEN N'max' ELSE CAST(@max_length / 2 AS nvarchar(10)) END, N')')
        WHEN @name IN (N'decimal', N'numeric')
            THEN CONCAT(@name, N'(', @precision, N',', @scale, N')')
        WHEN @name IN (N'datetime2', N'time', N'datetimeoffset')
            THEN CONCAT(@name, N'(', @scale, N')')
        ELSE @name
    END;
END;
GO

-- The parameters of every registered procedure, as invoke and the activated procedure see them.
-- has_default: OUTPUT parameters (the call always passes them) and those registered as optional.
CREATE VIEW asyncexec.AsyncExecParameters
AS
SELECT r.name AS [procedure],
       p.parameter_id AS position,
       CAST(SUBSTRING(p.name, 2, 128) AS nvarchar(128)) AS name,
       CAST(TYPE_NAME(p.system_type_id) AS nvarchar(128)) AS base_type,
       asyncexec.TypeText(p.system_type_id, p.max_length, p.precision, p.scale) AS type_text,
       p.max_length,
       p.is_output,
       CAST(CASE
                WHEN p.is_output = 1 THEN 1
                WHEN EXISTS (SELECT 1 FROM OPENJSON(r.optional_parameters) AS o
                              WHERE o.[value] COLLATE Latin1_General_BIN2 = SUBSTRING(p.name, 2, 128) COLLATE Latin1_General_BIN2) THEN 1
                ELSE 0
            END AS bit) AS has_default,
       CAST(CASE
                WHEN p.is_readonly = 0 AND t.is_table_type = 0 AND t.is_assembly_type = 0
                 AND TYPE_NAME(p.system_type_id) IN (N'bigint', N'int', N'smallint', N'tinyint', N'bit',
                                                     N'decimal', N'numeric', N'money', N'smallmoney', N'float', N'real',
                                                     N'date', N'time', N'datetime', N'datetime2', N'datetimeoffset', N'smalldatetime',
                                                     N'char', N'varchar', N'nchar', N'nvarchar', N'binary', N'varbinary',
                                                     N'uniqueidentifier')
                THEN 1 ELSE 0
            END AS bit) AS is_supported
FROM asyncexec.AsyncExecProcedures AS r
JOIN sys.parameters AS p ON p.object_id = OBJECT_ID(QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name), N'P')
JOIN sys.types AS t ON t.user_type_id = p.user_type_id
WHERE p.parameter_id > 0;   -- parameter_id 0 is a function's return value, never a procedure's
GO

-- Create a queue, or change its concurrency. Each queue is its own Service Broker
-- queue + target service + parameterless reader procedure (activation calls its
-- procedure without arguments, so the reader passes its queue name on).
-- Errors: 50005 bad queue name or concurrency.
CREATE PROCEDURE asyncexec.usp_AsyncExecCreateQueue
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
        THROW 50005, @message, 1;
    END;
    IF @concurrency IS NULL OR @concurrency NOT BETWEEN 1 AND 1000
    BEGIN
        SET @message = CONCAT(N'queue concurrency must be between 1 and 1000, not ', @concurrency);
        THROW 50005, @message, 1;
    END;

    DECLARE @queueObject sysname = N'AsyncExecQueue_' + @name,
            @service nvarchar(256) = N'asyncexec/Service/' + @name,
            @reader sysname = N'usp_AsyncExecActivated_' + @name,
            @sql nvarchar(max), @lock int;

    BEGIN TRANSACTION;
    -- Two callers creating the same queue at once would both find it missing and the
    -- second CREATE would fail: take turns (one resource for all queues; this is rare).
    EXEC @lock = sys.sp_getapplock @Resource = N'asyncexec/configure-queue', @LockMode = 'Exclusive',
                                   @LockOwner = 'Transaction', @LockTimeout = 60000;
    IF @lock < 0
    BEGIN
        SET @message = N'could not take the queue configuration lock within a minute';
        THROW 50020, @message, 1;
    END;

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
GO

-- Register (or re-register) a T-SQL stored procedure as invocable; returns its registered name.
-- @optionalParameters: JSON array of the parameter names (no @) that have defaults.
-- Errors: 50001 no such procedure, 50002 unsupported parameter types or bad optional list,
--         50003 unknown queue, 50005 bad maxAttempts or timeout.
CREATE PROCEDURE asyncexec.usp_AsyncExecRegister
    @procedure          nvarchar(261),
    @queue              nvarchar(100) = N'default',
    @maxAttempts        int = 1,
    @timeoutMs          int = NULL,
    @optionalParameters nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @object int, @schema sysname, @name sysname, @registered nvarchar(261), @problems nvarchar(max);

    IF PARSENAME(@procedure, 3) IS NULL AND PARSENAME(@procedure, 1) IS NOT NULL
        SET @object = OBJECT_ID(QUOTENAME(COALESCE(PARSENAME(@procedure, 2), N'dbo')) + N'.' + QUOTENAME(PARSENAME(@procedure, 1)), N'P');
    IF @object IS NULL
    BEGIN
        SET @message = CONCAT(N'"', @procedure, N'" is not a T-SQL stored procedure in this database (write schema.procedure)');
        THROW 50001, @message, 1;
    END;
    SELECT @schema = OBJECT_SCHEMA_NAME(@object), @name = OBJECT_NAME(@object);
    SET @registered = @schema + N'.' + @name;

    IF @maxAttempts IS NULL OR @maxAttempts NOT BETWEEN 1 AND 100 OR @timeoutMs <= 0
    BEGIN
        SET @message = N'maxAttempts must be between 1 and 100 and timeoutMs positive';
        THROW 50005, @message, 1;
    END;
    IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecQueues WHERE name = @queue)
    BEGIN
        SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
        THROW 50003, @message, 1;
    END;
    IF @optionalParameters IS NOT NULL AND (ISJSON(@optionalParameters) = 0 OR LEFT(LTRIM(@optionalParameters), 1) <> N'[')
    BEGIN
        SET @message = N'optionalParameters must be a JSON array of parameter names';
        THROW 50002, @message, 1;
    END;

    SELECT @problems = STRING_AGG(CAST(problem AS nvarchar(max)), N'; ')
    FROM (
        SELECT CONCAT(N'parameter ', p.name, N' has an unsupported type (',
                      CASE WHEN t.is_table_type = 1 THEN N'table type' ELSE TYPE_NAME(p.user_type_id) END, N')') AS problem
        FROM sys.parameters AS p
        JOIN sys.types AS t ON t.user_type_id = p.user_type_id
        WHERE p.object_id = @object AND p.parameter_id > 0
          AND (p.is_readonly = 1 OR t.is_table_type = 1 OR t.is_assembly_type = 1
               OR TYPE_NAME(p.system_type_id) NOT IN (N'bigint', N'int', N'smallint', N'tinyint', N'bit',
                                                      N'decimal', N'numeric', N'money', N'smallmoney', N'float', N'real',
                                                      N'date', N'time', N'datetime', N'datetime2', N'datetimeoffset', N'smalldatetime',
                                                      N'char', N'varchar', N'nchar', N'nvarchar', N'binary', N'varbinary',
                                                      N'uniqueidentifier'))
        UNION ALL
        SELECT CONCAT(N'optional parameter "', o.[value], N'" is not an input parameter')
        FROM OPENJSON(@optionalParameters) AS o
        WHERE NOT EXISTS (SELECT 1 FROM sys.parameters AS p
                          WHERE p.object_id = @object AND p.parameter_id > 0
                            AND SUBSTRING(p.name, 2, 128) COLLATE Latin1_General_BIN2 = o.[value] COLLATE Latin1_General_BIN2)
    ) AS found;
    IF @problems IS NOT NULL
    BEGIN
        SET @message = LEFT(CONCAT(N'cannot register ', @registered, N': ', @problems), 2048);
        THROW 50002, @message, 1;
    END;

    UPDATE asyncexec.AsyncExecProcedures
       SET queue = @queue, max_attempts = @maxAttempts, timeout_ms = @timeoutMs, optional_parameters = @optionalParameters
     WHERE schema_name = @schema AND procedure_name = @name;
    IF @@ROWCOUNT = 0
        INSERT asyncexec.AsyncExecProcedures (name, schema_name, procedure_name, queue, max_attempts, timeout_ms, optional_parameters)
        VALUES (@registered, @schema, @name, @queue, @maxAttempts, @timeoutMs, @optionalParameters);

    SELECT @registered AS name;
END;
GO
