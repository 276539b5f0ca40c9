-- Identity and access (issue 10): which roles may invoke a procedure, registrations that
-- can be withdrawn, API keys (hashes only), and the index a caller's own view of its work
-- reads (docs/mssql.md, "Errors raised by usp_AsyncExecInvoke").
--
-- Thrown: 50009 (FORBIDDEN) by usp_AsyncExecInvoke when @callerRoles holds none of the
-- procedure's roles and not admin; 50006 (NOT_FOUND) by usp_AsyncExecUnregister; 50005
-- (BAD_USER_INPUT) for bad role lists. New versions (CREATE OR ALTER) of usp_AsyncExecRegister
-- and usp_AsyncExecInvoke; neither is one of the signed procedures (docs/mssql.md).

-- roles: JSON array of the roles that may invoke it (any one of them, or admin); [] any caller.
-- unregistered_at: withdrawn. The row stays, so the calls submitted before still find their
-- procedure, parameters and timeout when they run (usp_AsyncExecRun and the reader join it by
-- name), and usp_AsyncExecRegister brings it back with new options.
-- A NOT NULL column with a default is filled with the default in every existing row (as
-- 0007's held column).
ALTER TABLE asyncexec.AsyncExecProcedures
    ADD roles           nvarchar(max) NOT NULL CONSTRAINT DF_AsyncExecProcedures_roles DEFAULT (N'[]'),
        unregistered_at datetime2(3)  NULL;
GO
-- its own batch: a column added by ALTER TABLE is not known to later statements of the same batch
ALTER TABLE asyncexec.AsyncExecProcedures
    ADD CONSTRAINT CK_AsyncExecProcedures_roles CHECK (ISJSON(roles) = 1 AND LEFT(roles, 1) = N'[');
GO

-- A plain caller reads its own executions newest first (listExecutions, countExecutions).
-- Not filtered: a filtered index would hold every writer of AsyncExecResults, activated
-- readers included, to the SET options such indexes require.
CREATE INDEX IX_AsyncExecResults_submitted_by ON asyncexec.AsyncExecResults (submitted_by, id);
GO

-- API keys for backend services. Only the SHA-256 of the secret is kept, as its 32 bytes:
-- binary compares exactly, whatever the database's collation. No permission is granted on
-- it: only the service's own user (the owner's) reads it.
-- name: binary collation, so keys differing in case are two keys as on PostgreSQL (blanks at
-- either end, which = would ignore, are refused by the service before the insert).
CREATE TABLE asyncexec.AsyncExecApiKeys (
    id           uniqueidentifier NOT NULL CONSTRAINT DF_AsyncExecApiKeys_id DEFAULT (NEWID())
                                  CONSTRAINT PK_AsyncExecApiKeys PRIMARY KEY NONCLUSTERED,
    name         nvarchar(128) COLLATE Latin1_General_BIN2 NOT NULL,
    roles        nvarchar(max)    NOT NULL CONSTRAINT DF_AsyncExecApiKeys_roles DEFAULT (N'[]'),
    prefix       nvarchar(32)     NOT NULL,
    secret_hash  binary(32)       NOT NULL CONSTRAINT UQ_AsyncExecApiKeys_secret UNIQUE,
    created_at   datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecApiKeys_created DEFAULT (SYSUTCDATETIME()),
    created_by   nvarchar(256)    NULL,
    last_used_at datetime2(3)     NULL,
    revoked_at   datetime2(3)     NULL,
    CONSTRAINT CK_AsyncExecApiKeys_name CHECK (LEN(name) > 0),
    CONSTRAINT CK_AsyncExecApiKeys_roles CHECK (ISJSON(roles) = 1 AND LEFT(roles, 1) = N'['),
    CONSTRAINT CK_AsyncExecApiKeys_prefix CHECK (LEN(prefix) > 0)
);
GO
-- A name is unique among the keys still in use. A filtered index: every statement that writes
-- this table needs ANSI_NULLS, ANSI_PADDING, ANSI_WARNINGS, ARITHABORT, CONCAT_NULL_YIELDS_NULL
-- and QUOTED_IDENTIFIER ON and NUMERIC_ROUNDABORT OFF ("SET ANSI_DEFAULTS", filtered indexes),
-- which is how the driver (tedious) opens every connection; only the service writes it.
CREATE UNIQUE INDEX UX_AsyncExecApiKeys_live_name ON asyncexec.AsyncExecApiKeys (name) WHERE revoked_at IS NULL;
GO

-- Register (or re-register, replacing its options) a T-SQL stored procedure as invocable;
-- returns its registered name. @optionalParameters: JSON array of the parameter names (no @)
-- that have defaults. @roles: JSON array of role names (1-64 of A-Z a-z 0-9 _ . : -); NULL or
-- [] any caller. Registering a withdrawn procedure brings it back.
-- Errors: 50001 no such procedure, 50002 unsupported parameter types or bad optional list,
--         50003 unknown queue, 50005 bad maxAttempts, timeout or roles.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecRegister
    @procedure          nvarchar(261),
    @queue              nvarchar(100) = N'default',
    @maxAttempts        int = 1,
    @timeoutMs          int = NULL,
    @optionalParameters nvarchar(max) = NULL,
    @roles              nvarchar(max) = NULL
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
        THROW 50002, @message, 1;
    END;

    UPDATE asyncexec.AsyncExecProcedures
       SET queue = @queue, max_attempts = @maxAttempts, timeout_ms = @timeoutMs, optional_parameters = @optionalParameters,
           roles = @roles, unregistered_at = NULL
     WHERE schema_name = @schema AND procedure_name = @name;
    IF @@ROWCOUNT = 0
        INSERT asyncexec.AsyncExecProcedures (name, schema_name, procedure_name, queue, max_attempts, timeout_ms, optional_parameters, roles)
        VALUES (@registered, @schema, @name, @queue, @maxAttempts, @timeoutMs, @optionalParameters, @roles);

    SELECT @registered AS name;
END;
GO

-- Withdraw a registration by its registered name: nothing new can be invoked for it; the
-- calls submitted before still run (the row stays, marked). Errors: 50006 not registered.
CREATE PROCEDURE asyncexec.usp_AsyncExecUnregister
    @procedure nvarchar(261)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @message nvarchar(2048);
    UPDATE asyncexec.AsyncExecProcedures SET unregistered_at = SYSUTCDATETIME()
     WHERE name = @procedure AND unregistered_at IS NULL;
    IF @@ROWCOUNT = 0
    BEGIN
        SET @message = CONCAT(N'procedure "', @procedure, N'" is not registered');
        THROW 50006, @message, 1;
    END;
END;
GO

-- usp_AsyncExecInvoke as in 0007_batches.sql, and: a withdrawn registration is not
-- registered (50001); @callerRoles is checked against the procedure's roles (50009).
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecInvoke
    @procedure   nvarchar(261),
    @arguments   nvarchar(max) = N'{}',
    @queue       nvarchar(100) = NULL,
    @runAt       datetime2(3) = NULL,      -- UTC; later than now means WAITING until then
    @maxAttempts int = NULL,
    @submittedBy nvarchar(256) = NULL,
    @token       uniqueidentifier = NULL OUTPUT,
    @id          bigint = NULL OUTPUT,
    @batchId     uniqueidentifier = NULL,  -- the batch it belongs to (usp_AsyncExecBatchCreate)
    @stage       int = NULL,               -- its 1-based stage in that batch
    @callerRoles nvarchar(max) = NULL      -- JSON array of the caller's roles; NULL: not checked
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048), @problems nvarchar(max), @registered nvarchar(261), @registeredQueue nvarchar(100),
            @registeredAttempts int, @object int, @service nvarchar(256), @status varchar(10),
            @batchStatus varchar(10), @currentStage int, @stageCount int, @held bit = 0, @registeredRoles nvarchar(max);
    SET @arguments = COALESCE(@arguments, N'{}');

    SELECT @registered = r.name, @registeredQueue = r.queue, @registeredAttempts = r.max_attempts, @registeredRoles = r.roles,
           @object = OBJECT_ID(QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name), N'P')
    FROM asyncexec.AsyncExecProcedures AS r
    WHERE r.name = @procedure AND r.unregistered_at IS NULL;
    IF @registered IS NULL OR @object IS NULL
    BEGIN
        SET @message = CONCAT(N'procedure "', @procedure, N'" is not registered',
                              CASE WHEN @registered IS NOT NULL THEN N' (it no longer exists)' END);
        THROW 50001, @message, 1;
    END;

    -- The caller's roles (a list the service has verified) against the registered ones:
    -- one in common, or admin. Compared under a binary collation, so case counts, and with
    -- equal DATALENGTH, since = ignores trailing blanks (KB 316626) and 'admin ' is no admin.
    -- ISJSON and the leading '[' first: OPENJSON raises on malformed text, and on an object
    -- it would read the values of any keys as roles.
    IF @callerRoles IS NOT NULL AND (ISJSON(@callerRoles) = 0 OR LEFT(LTRIM(@callerRoles), 1) <> N'[')
    BEGIN
        SET @message = N'callerRoles must be a JSON array of role names';
        THROW 50005, @message, 1;
    END;
    IF @callerRoles IS NOT NULL AND EXISTS (SELECT 1 FROM OPENJSON(@registeredRoles))
       AND NOT EXISTS (SELECT 1 FROM OPENJSON(@callerRoles) AS c
                        WHERE (c.[value] COLLATE Latin1_General_BIN2 = N'admin' AND DATALENGTH(c.[value]) = DATALENGTH(N'admin'))
                           OR EXISTS (SELECT 1 FROM OPENJSON(@registeredRoles) AS r
                                       WHERE c.[value] COLLATE Latin1_General_BIN2 = r.[value]
                                         AND DATALENGTH(c.[value]) = DATALENGTH(r.[value])))
    BEGIN
        SET @message = CONCAT(N'the caller''s roles do not allow invoking "', @registered, N'"');
        THROW 50009, @message, 1;
    END;

    -- ISJSON first: OPENJSON on malformed text raises an error instead of answering.
    IF ISJSON(@arguments) = 0
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        THROW 50002, @message, 1;
    END;
    IF (SELECT TOP (1) [type] FROM OPENJSON(N'[' + @arguments + N']')) <> 5   -- 5: object
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        THROW 50002, @message, 1;
    END;
    IF @maxAttempts IS NOT NULL AND @maxAttempts NOT BETWEEN 1 AND 100
    BEGIN
        SET @message = N'maxAttempts must be between 1 and 100';
        THROW 50002, @message, 1;
    END;

    DECLARE @args TABLE ([key] nvarchar(4000) COLLATE Latin1_General_BIN2, [value] nvarchar(max), [type] tinyint);
    INSERT @args ([key], [value], [type]) SELECT [key], [value], [type] FROM OPENJSON(@arguments);

    DECLARE @params TABLE (name nvarchar(128) COLLATE Latin1_General_BIN2, position int, base_type nvarchar(128), type_text nvarchar(128),
                           max_length smallint, has_default bit, is_supported bit);
    INSERT @params (name, position, base_type, type_text, max_length, has_default, is_supported)
    SELECT name, position, base_type, type_text, max_length, has_default, is_supported
    FROM asyncexec.AsyncExecParameters
    WHERE [procedure] = @registered;

    DECLARE @found TABLE (ord int, problem nvarchar(2000));
    INSERT @found (ord, problem)
    SELECT 1, CONCAT(N'unknown argument "', a.[key], N'"')
    FROM @args AS a WHERE NOT EXISTS (SELECT 1 FROM @params AS p WHERE p.name = a.[key]);
    INSERT @found (ord, problem)
    SELECT 1, CONCAT(N'duplicate argument "', a.[key], N'"')
    FROM @args AS a GROUP BY a.[key] HAVING COUNT(*) > 1;
    INSERT @found (ord, problem)
    SELECT 2, CONCAT(N'missing argument "', p.name, N'" (', p.type_text, N')')
    FROM @params AS p WHERE p.has_default = 0 AND NOT EXISTS (SELECT 1 FROM @args AS a WHERE a.[key] = p.name);
    INSERT @found (ord, problem)
    SELECT 2, CONCAT(N'parameter "', p.name, N'" has an unsupported type (', p.type_text, N')')
    FROM @params AS p WHERE p.is_supported = 0;

    -- Each supplied value must convert to its parameter's type exactly as the
    -- activated procedure will convert it: CONVERT(type, OPENJSON value), base64 for
    -- binary. TRY_CONVERT never raises, so the caller's transaction is never doomed.
    DECLARE @name nvarchar(128), @base nvarchar(128), @typeText nvarchar(128), @maxLength smallint,
            @value nvarchar(max), @jsonType tinyint, @ok bit, @check nvarchar(max);
    DECLARE checks CURSOR LOCAL FAST_FORWARD FOR
        SELECT p.name, p.base_type, p.type_text, p.max_length, a.[value], a.[type]
        FROM @params AS p JOIN @args AS a ON a.[key] = p.name
        WHERE p.is_supported = 1 AND a.[type] <> 0;   -- 0: JSON null, passed as NULL
    OPEN checks;
    FETCH NEXT FROM checks INTO @name, @base, @typeText, @maxLength, @value, @jsonType;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        IF @base IN (N'nvarchar', N'nchar')
            -- objects and arrays (4, 5) travel as their JSON text into character parameters
            SET @ok = CASE WHEN @maxLength = -1 OR DATALENGTH(@value) <= @maxLength THEN 1 ELSE 0 END;
        ELSE IF @base IN (N'varchar', N'char')
            SET @ok = CASE WHEN @maxLength = -1 OR DATALENGTH(CONVERT(varchar(max), @value)) <= @maxLength THEN 1 ELSE 0 END;
        ELSE IF @jsonType IN (4, 5)
            SET @ok = 0;
        ELSE IF @base IN (N'varbinary', N'binary')
            SET @ok = CASE
                WHEN @jsonType = 1
                 AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'%[^A-Za-z0-9+/=]%'
                 AND LEN(@value) % 4 = 0
                 AND (@maxLength = -1 OR LEN(@value) / 4 * 3 - (LEN(@value) - LEN(REPLACE(@value, N'=', N''))) <= @maxLength)
                THEN 1 ELSE 0 END;
        ELSE
        BEGIN
            -- @typeText comes from the catalog (asyncexec.TypeText), never from the caller
            SET @check = N'SET @ok = CASE WHEN TRY_CONVERT(' + @typeText + N', @value) IS NULL THEN 0 ELSE 1 END;';
            EXEC sys.sp_executesql @check, N'@value nvarchar(max), @ok bit OUTPUT', @value = @value, @ok = @ok OUTPUT;
        END;
        IF @ok = 0
            INSERT @found (ord, problem)
            VALUES (3, CONCAT(N'argument "', @name, N'": ', LEFT(@value, 100), CASE WHEN LEN(@value) > 100 THEN N'…' END,
                              N' is not a valid ', @typeText));
        FETCH NEXT FROM checks INTO @name, @base, @typeText, @maxLength, @value, @jsonType;
    END;
    CLOSE checks;
    DEALLOCATE checks;

    SELECT @problems = STRING_AGG(CAST(problem AS nvarchar(max)), N'; ') WITHIN GROUP (ORDER BY ord, problem) FROM @found;
    IF @problems IS NOT NULL
    BEGIN
        SET @message = LEFT(CONCAT(N'invalid arguments for ', @registered, N': ', @problems), 2048);
        THROW 50002, @message, 1;
    END;

    SET @queue = COALESCE(@queue, @registeredQueue);
    SELECT @service = service_name FROM asyncexec.AsyncExecQueues WHERE name = @queue;
    IF @service IS NULL
    BEGIN
        SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
        THROW 50003, @message, 1;
    END;

    IF @batchId IS NOT NULL OR @stage IS NOT NULL
    BEGIN
        -- The batch lock must last until the call is written and committed: outside a
        -- transaction it would end with this statement, and a settle could release the
        -- stage before a call held for it is inserted (it would stay held for ever).
        IF @@TRANCOUNT = 0
        BEGIN
            SET @message = N'invoke the calls of a batch inside a transaction (the one that creates the batch)';
            THROW 50005, @message, 1;
        END;
        SELECT @batchStatus = status, @currentStage = current_stage, @stageCount = stage_count
        FROM asyncexec.AsyncExecBatches WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE id = @batchId;
        IF @batchStatus IS NULL OR @batchStatus <> 'RUNNING' OR @stage IS NULL OR @stage < @currentStage OR @stage > @stageCount
        BEGIN
            SET @message = CONCAT(N'cannot add a call to stage ', COALESCE(CAST(@stage AS nvarchar(11)), N'(none)'), N' of batch ',
                                  COALESCE(LOWER(CONVERT(nvarchar(36), @batchId)), N'(none)'), N': ',
                                  CASE WHEN @batchStatus IS NULL THEN N'no such batch'
                                       WHEN @batchStatus <> 'RUNNING' THEN N'the batch has ended'
                                       ELSE CONCAT(N'its stages ', @currentStage, N' to ', @stageCount, N' are open') END);
            THROW 50005, @message, 1;
        END;
        SET @held = CASE WHEN @stage > @currentStage THEN 1 ELSE 0 END;
    END;

    SET @status = CASE WHEN @held = 1 OR @runAt > SYSUTCDATETIME() THEN 'WAITING' ELSE 'PENDING' END;

    -- Writes: under a savepoint inside the caller's transaction, or in our own.
    DECLARE @trancount int = @@TRANCOUNT, @h uniqueidentifier, @body xml;
    IF @trancount = 0
        BEGIN TRANSACTION;
    ELSE
        SAVE TRANSACTION usp_AsyncExecInvoke;
    BEGIN TRY
        SET @token = NEWID();
        IF @held = 0
        BEGIN
            BEGIN DIALOG CONVERSATION @h
                FROM SERVICE [asyncexec/NotifyService]
                TO SERVICE @service, 'CURRENT DATABASE'
                ON CONTRACT [asyncexec/Contract]
                WITH ENCRYPTION = OFF;
        END;
        INSERT asyncexec.AsyncExecResults
            (token, [procedure], arguments, queue, status, run_at, max_attempts, submitted_by, submitted_login, initiator_handle,
             batch_id, stage, held)
        VALUES
            (@token, @registered, @arguments, @queue, @status, @runAt, COALESCE(@maxAttempts, @registeredAttempts),
             @submittedBy, ORIGINAL_LOGIN(), @h, @batchId, @stage, @held);
        SET @id = SCOPE_IDENTITY();
        IF @held = 0
        BEGIN
            SET @body = (SELECT @id AS [@id] FOR XML PATH('request'), TYPE);
            -- Sent now even when WAITING: the reader arms the dialog's timer for run_at.
            SEND ON CONVERSATION @h MESSAGE TYPE [asyncexec/Request] (@body);
        END;
        IF @trancount = 0
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF XACT_STATE() = -1
            ROLLBACK TRANSACTION;                         -- doomed: only a full rollback is possible
        ELSE IF XACT_STATE() = 1 AND @trancount = 0
            ROLLBACK TRANSACTION;                         -- our own transaction
        ELSE IF XACT_STATE() = 1 AND @trancount > 0
            ROLLBACK TRANSACTION usp_AsyncExecInvoke;     -- the savepoint saved above, by the same name
        THROW;
    END CATCH;
END;
GO
