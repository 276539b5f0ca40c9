-- Register (or re-register, replacing its options) a T-SQL stored procedure as invocable;
-- returns its registered name. @optionalParameters: JSON array of the parameter names (no @)
-- that have defaults. @roles: JSON array of role names (1-64 of A-Z a-z 0-9 _ . : -); NULL or
-- [] any caller. Registering a withdrawn procedure brings it back.
-- @transactional: 1 (default) runs each call inside the transaction that records its outcome;
-- 0 runs it with no transaction open and records the outcome after (usp_AsyncExecRun).
-- @timeoutMs: refused (50005) unless NULL. SQL Server has no statement timeout a server-side
-- caller can set; the only way to stop a running call is KILL, which needs the server
-- permission ALTER ANY CONNECTION that the activation's EXECUTE AS OWNER context (scoped to the
-- database) never has (docs/mssql.md, "Timeouts"). A timeout we cannot enforce is not offered.
-- Errors: 50001 no such procedure, 50002 unsupported parameter types or bad optional list,
--         50003 unknown queue, 50005 bad maxAttempts, a timeout, bad roles, or a procedure that
--         is not one to run as a call (the service's own, SQL Server's own, or one named like a
--         system procedure: asyncexec.AsyncExecRefusedProcedure), or one whose schema or name
--         holds a "." (its registered name schema.procedure would not name it alone).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecRegister
    @procedure          nvarchar(261),
    @queue              nvarchar(100) = N'default',
    @maxAttempts        int = 1,
    @timeoutMs          int = NULL,
    @optionalParameters nvarchar(max) = NULL,
    @roles              nvarchar(max) = NULL,
    @transactional      bit = 1
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048), @object int, @schema sysname, @name sysname, @registered nvarchar(261), @problems nvarchar(max),
            @queueName nvarchar(100), @refused nvarchar(400);

    IF PARSENAME(@procedure, 3) IS NULL AND PARSENAME(@procedure, 1) IS NOT NULL
        SET @object = OBJECT_ID(QUOTENAME(COALESCE(PARSENAME(@procedure, 2), N'dbo')) + N'.' + QUOTENAME(PARSENAME(@procedure, 1)), N'P');
    IF @object IS NULL
    BEGIN
        -- a name without a schema means dbo.<name> here, whoever calls (not the caller's default
        -- schema), so that a registration does not depend on who made it; T-SQL procedures have
        -- no overloads, so a signature is never needed
        SET @message = CONCAT(N'"', @procedure, N'" is not a T-SQL stored procedure in this database',
                              CASE WHEN CHARINDEX(N'(', @procedure) > 0
                                   THEN N': give its name only (schema.procedure): T-SQL procedures have no overloads, so no parameter list is needed'
                                   WHEN PARSENAME(@procedure, 2) IS NULL
                                   THEN N' (a name without a schema is looked up in dbo: write schema.procedure)'
                                   ELSE N' (write schema.procedure)' END);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50001, @message, 1;
    END;
    SELECT @schema = OBJECT_SCHEMA_NAME(@object), @name = OBJECT_NAME(@object);
    SET @registered = @schema + N'.' + @name;
    -- calls name a procedure schema.procedure: [a.b].[c] and [a].[b.c] would both be a.b.c
    IF CHARINDEX(N'.', @schema) > 0 OR CHARINDEX(N'.', @name) > 0
    BEGIN
        SET @message = CONCAT(N'"', @registered, N'" cannot be registered: its schema or name holds a ".", so "', @registered,
                              N'" would not name it alone (rename it, or register a procedure that calls it)');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    -- the service's own procedures, SQL Server's, and a procedure named like one of SQL Server's
    -- are not procedures to run as calls (asyncexec.AsyncExecRefusedProcedure says why)
    SELECT @refused = asyncexec.AsyncExecRefusedProcedure(@object);
    IF @refused IS NOT NULL
    BEGIN
        SET @message = CONCAT(N'"', @registered, N'" is ', @refused, N', not a procedure to run as a call');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    IF @maxAttempts IS NULL OR @maxAttempts NOT BETWEEN 1 AND 100
    BEGIN
        SET @message = N'maxAttempts must be between 1 and 100';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @timeoutMs IS NOT NULL
    BEGIN
        SET @message = N'timeoutMs is not supported on SQL Server: a running call can only be stopped by KILL (see docs/mssql.md, "Timeouts")';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    SET @transactional = COALESCE(@transactional, 1);
    -- found under the column's collation (a case-insensitive database finds 'Default', and = ignores
    -- trailing blanks), recorded as the queue is named: the calls take their queue from here
    -- (usp_AsyncExecInvoke, whose filters and change feed compare exactly)
    SELECT @queueName = name FROM asyncexec.AsyncExecQueues WHERE name = @queue;
    IF @queueName IS NULL
    BEGIN
        SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50003, @message, 1;
    END;
    SET @queue = @queueName;
    IF @optionalParameters IS NOT NULL AND (ISJSON(@optionalParameters) = 0 OR LEFT(LTRIM(@optionalParameters), 1) <> N'[')
    BEGIN
        SET @message = N'optionalParameters must be a JSON array of parameter names';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;

    -- Role names: a JSON array of strings (type 1) that are names. Blanks become '#' before the
    -- LIKE, so a trailing blank, which comparisons may ignore, is caught as a bad character;
    -- the binary collation keeps the ranges to ASCII letters and digits.
    SET @roles = COALESCE(@roles, N'[]');
    IF ISJSON(@roles) = 0 OR LEFT(@roles, 1) <> N'['   -- as CK_AsyncExecProcedures_roles has it
       OR EXISTS (SELECT 1 FROM OPENJSON(@roles) AS o
                   WHERE o.[type] <> 1 OR DATALENGTH(o.[value]) NOT BETWEEN 2 AND 128
                      OR REPLACE(o.[value] COLLATE Latin1_General_BIN2, N' ', N'#') LIKE N'%[^A-Za-z0-9_.:-]%')
    BEGIN
        SET @message = N'roles must be a JSON array of role names: 1 to 64 characters of A-Z a-z 0-9 _ . : -';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
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
        -- doubled past nvarchar(2048) (the text holds what the caller sent), the doubling would be cut,
        -- maybe inside a %%: cut the message first, to a length whose doubling always fits
        IF DATALENGTH(REPLACE(@message, N'%', N'%%')) > 4096
            SET @message = LEFT(@message, 1024);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;

    UPDATE asyncexec.AsyncExecProcedures
       SET queue = @queue, max_attempts = @maxAttempts, timeout_ms = @timeoutMs, optional_parameters = @optionalParameters,
           roles = @roles, unregistered_at = NULL, transactional = @transactional
     WHERE schema_name = @schema AND procedure_name = @name;
    IF @@ROWCOUNT = 0
        INSERT asyncexec.AsyncExecProcedures (name, schema_name, procedure_name, queue, max_attempts, timeout_ms, optional_parameters, roles, transactional)
        VALUES (@registered, @schema, @name, @queue, @maxAttempts, @timeoutMs, @optionalParameters, @roles, @transactional);

    SELECT @registered AS name;
END;
