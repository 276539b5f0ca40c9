-- usp_AsyncExecInvoke: enqueue a call inside the caller's transaction.
--
-- Errors (THROW, severity 16), mapped one to one by the service:
--   50001 UNKNOWN_PROCEDURE  the procedure is not registered, or no longer exists
--   50002 INVALID_ARGUMENTS  arguments are not a JSON object, or do not fit the signature
--   50003 UNKNOWN_QUEUE      the queue does not exist
--   50005 BAD_USER_INPUT     (also) a malformed idempotency key, or one given to a batch's call
--   50016 IDEMPOTENCY_KEY_REUSED  the key was sent before by this caller with another call
--   50017 IDEMPOTENCY_KEY_IN_USE  another transaction holds the key (send the call again shortly)
-- Every check runs before the first write, so a refusal leaves the caller's
-- transaction as it was (unless the caller runs with XACT_ABORT ON, where any
-- error dooms its transaction).
--
-- EXECUTE AS OWNER: callers need only EXECUTE on this procedure, not SEND on the
-- services or SELECT on the catalog; ORIGINAL_LOGIN() still names the real caller.
-- usp_AsyncExecInvoke as in 0007_batches.sql, and: a withdrawn registration is not
-- registered (50001), nor is one of a procedure not to run as a call (50001,
-- asyncexec.AsyncExecRefusedProcedure); @callerRoles is checked against the procedure's roles (50009).
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
    @callerRoles nvarchar(max) = NULL,     -- JSON array of the caller's roles; NULL: not checked
    -- The caller's key for this call (0017_idempotency_keys.sql): 1 to 128 characters. Declared one
    -- longer: a longer value passed to a parameter is cut to its length without an error, and a key
    -- cut to 128 would be another key; cut to 129, it is refused.
    @idempotencyKey nvarchar(129) = NULL,
    -- 1 when the key returned the execution an earlier request made (@token, @id): nothing was written
    @replayed    bit = NULL OUTPUT
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048), @problems nvarchar(max), @registered nvarchar(261), @registeredQueue nvarchar(100),
            @registeredAttempts int, @object int, @service nvarchar(256), @status varchar(10),
            @batchStatus varchar(10), @currentStage int, @stageCount int, @held bit = 0, @registeredRoles nvarchar(max),
            @queueName nvarchar(100), @refused nvarchar(400);
    SET @arguments = COALESCE(@arguments, N'{}');
    SET @replayed = 0;

    -- An idempotency key this caller sent before: the same call gets the execution it made (@token,
    -- @id) and nothing is written; another call is refused (50016); a key another transaction is
    -- inserting, refused at once (50017). Checked before everything else, as on PostgreSQL: a
    -- replay is answered as the first call was, whatever changed since (the procedure
    -- unregistered, the caller's roles). Checked again inside the transaction, under the key's
    -- application lock (below).
    DECLARE @scope nvarchar(256) = COALESCE(@submittedBy, N''), @digest varbinary(32), @madeId bigint, @madeToken uniqueidentifier;
    IF @idempotencyKey IS NOT NULL
    BEGIN
        IF @batchId IS NOT NULL
        BEGIN
            SET @message = N'a call of a batch takes no idempotency key';
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50005, @message, 1;
        END;
        -- the call as it was asked for, before any default is applied; NCHAR(31) (unit separator)
        -- between the parts, CONCAT's NULL as ''. HASHBYTES takes input of any length from SQL
        -- Server 2016 on ("HASHBYTES (Transact-SQL)"), as the service requires.
        SET @digest = HASHBYTES('SHA2_256', CONCAT(@procedure, NCHAR(31), @arguments, NCHAR(31), @queue, NCHAR(31),
                                                   CONVERT(nvarchar(30), @runAt, 126), NCHAR(31), @maxAttempts));
        EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @id = @madeId OUTPUT, @token = @madeToken OUTPUT;
        IF @madeId IS NOT NULL
        BEGIN
            SELECT @id = @madeId, @token = @madeToken, @replayed = 1;
            RETURN;
        END;
    END;

    SELECT @registered = r.name, @registeredQueue = r.queue, @registeredAttempts = r.max_attempts, @registeredRoles = r.roles,
           @object = OBJECT_ID(QUOTENAME(r.schema_name) + N'.' + QUOTENAME(r.procedure_name), N'P')
    FROM asyncexec.AsyncExecProcedures AS r
    WHERE r.name = @procedure AND r.unregistered_at IS NULL;
    IF @registered IS NULL OR @object IS NULL
    BEGIN
        SET @message = CONCAT(N'procedure "', @procedure, N'" is not registered',
                              CASE WHEN @registered IS NOT NULL THEN N' (it no longer exists)' END);
        -- registered names are schema-qualified: name the ones an unqualified name may have meant
        -- (STRING_AGG: SQL Server 2017 and later; over nvarchar(max), or a result past 8000 bytes
        -- fails with 9829 instead of 50001 — "STRING_AGG (Transact-SQL)", return types)
        IF @registered IS NULL AND CHARINDEX(N'.', @procedure) = 0
            SELECT @message = CONCAT(@message, N'. Registered names are schema-qualified: did you mean ',
                                     STRING_AGG(CAST(r.name AS nvarchar(max)), N' or ') WITHIN GROUP (ORDER BY r.name), N'?')
            FROM asyncexec.AsyncExecProcedures AS r
            WHERE r.unregistered_at IS NULL AND r.name LIKE N'%.' + REPLACE(REPLACE(REPLACE(@procedure, N'[', N'[[]'), N'%', N'[%]'), N'_', N'[_]')
            HAVING COUNT(*) > 0;
        -- doubled past nvarchar(2048) (the text holds what the caller sent), the doubling would be cut,
        -- maybe inside a %%: cut the message first, to a length whose doubling always fits
        IF DATALENGTH(REPLACE(@message, N'%', N'%%')) > 4096
            SET @message = LEFT(@message, 1024);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50001, @message, 1;
    END;
    -- a registration an earlier release made of a procedure that is not one to run as a call
    -- (SQL Server's own, or one named like it: usp_AsyncExecRegister refuses them now) is not
    -- run: the activation's EXECUTE AS OWNER would run it with the owner's rights
    SELECT @refused = asyncexec.AsyncExecRefusedProcedure(@object);
    IF @refused IS NOT NULL
    BEGIN
        SET @message = CONCAT(N'procedure "', @registered, N'" is ', @refused, N', not a procedure to run as a call',
                              N' (registered before the service refused such procedures: unregister it)');
        SET @message = REPLACE(@message, N'%', N'%%');
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
        SET @message = REPLACE(@message, N'%', N'%%');
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
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50009, @message, 1;
    END;

    -- ISJSON first: OPENJSON on malformed text raises an error instead of answering.
    IF ISJSON(@arguments) = 0
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;
    IF (SELECT TOP (1) [type] FROM OPENJSON(N'[' + @arguments + N']')) <> 5   -- 5: object
    BEGIN
        SET @message = N'arguments must be a JSON object keyed by parameter name';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;
    IF @maxAttempts IS NOT NULL AND @maxAttempts NOT BETWEEN 1 AND 100
    BEGIN
        SET @message = N'maxAttempts must be between 1 and 100';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;

    DECLARE @args TABLE ([key] nvarchar(4000) COLLATE Latin1_General_BIN2 NULL, [value] nvarchar(max) NULL, [type] tinyint NULL);
    INSERT @args ([key], [value], [type]) SELECT [key], [value], [type] FROM OPENJSON(@arguments);

    DECLARE @params TABLE (name nvarchar(128) COLLATE Latin1_General_BIN2 NULL, position int NULL, base_type nvarchar(128) NULL, type_text nvarchar(128) NULL,
                           max_length smallint NULL, has_default bit NULL, is_supported bit NULL);
    INSERT @params (name, position, base_type, type_text, max_length, has_default, is_supported)
    SELECT name, position, base_type, type_text, max_length, has_default, is_supported
    FROM asyncexec.AsyncExecParameters
    WHERE [procedure] = @registered;

    DECLARE @found TABLE (ord int NULL, problem nvarchar(2000) NULL);
    INSERT @found (ord, problem)
    -- a key (up to 4,000 characters: OPENJSON's key is nvarchar(4000); the service refuses
    -- longer ones) is cut to 200 characters in the message: problem is nvarchar(2000), and an
    -- INSERT that overflows a column raises 2628 (ANSI_WARNINGS ON) where INVALID_ARGUMENTS is meant
    SELECT 1, CONCAT(N'unknown argument "', LEFT(a.[key], 200), N'"')
    FROM @args AS a WHERE NOT EXISTS (SELECT 1 FROM @params AS p WHERE p.name = a.[key]);
    INSERT @found (ord, problem)
    SELECT 1, CONCAT(N'duplicate argument "', LEFT(a.[key], 200), N'"')
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
            @value nvarchar(max), @jsonType tinyint, @ok bit, @check nvarchar(max),
            @guid nvarchar(400) = REPLACE(N'########-####-####-####-############', N'#', N'[0-9A-Fa-f]');
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
        ELSE IF @base IN (N'date', N'datetime', N'datetime2', N'datetimeoffset', N'smalldatetime')
                AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]%'
            -- only ISO 8601 forms (yyyy-mm-dd…), which every session reads the same way (asyncexec.ArgumentConversion)
            SET @ok = 0;
        ELSE IF @base = N'time' AND @value COLLATE Latin1_General_BIN2 NOT LIKE N'[0-9][0-9]:[0-9][0-9]%'
            SET @ok = 0;
        ELSE IF @base = N'uniqueidentifier'
                AND NOT (DATALENGTH(@value) = 72 AND @value COLLATE Latin1_General_BIN2 LIKE @guid)
                AND NOT (DATALENGTH(@value) = 76 AND @value COLLATE Latin1_General_BIN2 LIKE N'{' + @guid + N'}')
            -- the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx of hex digits (or in braces), nothing
            -- after it: a conversion to uniqueidentifier reads the first 36 characters of a longer
            -- string and ignores the rest ("uniqueidentifier (Transact-SQL)", Converting
            -- uniqueidentifier data), so '<guid>xyz' would pass and run as <guid>. DATALENGTH too:
            -- whether LIKE counts trailing blanks of the matched expression, "LIKE (Transact-SQL)"
            -- answers by version and data type; the length settles it either way
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
            -- @typeText comes from the catalog (asyncexec.TypeText), never from the caller; the
            -- conversion is the very expression usp_AsyncExecRun converts with (TRY_ here)
            SET @check = N'SET @ok = CASE WHEN ' + asyncexec.ArgumentConversion(@base, @typeText, N'@value', 1) + N' IS NULL THEN 0 ELSE 1 END;';
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
        -- doubled past nvarchar(2048) (the text holds what the caller sent), the doubling would be cut,
        -- maybe inside a %%: cut the message first, to a length whose doubling always fits
        IF DATALENGTH(REPLACE(@message, N'%', N'%%')) > 4096
            SET @message = LEFT(@message, 1024);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50002, @message, 1;
    END;

    SET @queue = COALESCE(@queue, @registeredQueue);
    -- found under the column's collation (a case-insensitive database finds 'Default' too), and
    -- recorded as the queue is named: filters and the service's change feed compare exactly
    -- (as the procedure is recorded by its registered name). A separate variable: a SELECT that
    -- assigns @queue while its WHERE reads it leaves the order to the engine.
    SELECT @service = service_name, @queueName = name FROM asyncexec.AsyncExecQueues WHERE name = @queue;
    IF @service IS NULL
    BEGIN
        SET @message = CONCAT(N'queue "', @queue, N'" does not exist');
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50003, @message, 1;
    END;
    SET @queue = @queueName;

    IF @batchId IS NOT NULL OR @stage IS NOT NULL
    BEGIN
        -- The batch lock must last until the call is written and committed: outside a
        -- transaction it would end with this statement, and a settle could release the
        -- stage before a call held for it is inserted (it would stay held for ever).
        IF @@TRANCOUNT = 0
        BEGIN
            SET @message = N'invoke the calls of a batch inside a transaction (the one that creates the batch)';
            SET @message = REPLACE(@message, N'%', N'%%');
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
            SET @message = REPLACE(@message, N'%', N'%%');
            THROW 50005, @message, 1;
        END;
        SET @held = CASE WHEN @stage > @currentStage THEN 1 ELSE 0 END;
    END;

    SET @status = CASE WHEN @held = 1 OR @runAt > SYSUTCDATETIME() THEN 'WAITING' ELSE 'PENDING' END;

    -- Writes: under a savepoint inside the caller's transaction, or in our own.
    -- No savepoint (@saved = 0) where it cannot help or cannot be taken:
    --  * the caller runs with XACT_ABORT ON (@@OPTIONS bit 16384): "if a Transact-SQL statement
    --    raises a run-time error, the entire transaction is terminated and rolled back" (SET
    --    XACT_ABORT), so there is never a savepoint to return to; and distributed transactions
    --    usually run so ("XACT_ABORT must be set ON for data modification statements in an
    --    implicit or explicit transaction against most OLE DB providers");
    --  * a distributed transaction: "SAVE TRANSACTION is not supported in distributed
    --    transactions" (SAVE TRANSACTION); it fails with 627, which leaves the transaction usable
    --    under XACT_ABORT OFF (severity 16). Detecting one up front needs sys.dm_tran_session_
    --    transactions.is_local, i.e. VIEW SERVER STATE, which this procedure's EXECUTE AS OWNER
    --    context (scoped to the database) does not carry, hence the try.
    -- Without a savepoint a failure below is rethrown with our writes still in the caller's
    -- transaction: the caller must roll back (under XACT_ABORT ON it is rolled back already).
    -- A savepoint also stays in the transaction until it ends, and "cannot promote the transaction
    -- to a distributed transaction because there is an active save point" (3933): a caller that
    -- will go distributed later should invoke with XACT_ABORT ON (docs/mssql.md).
    DECLARE @trancount int = @@TRANCOUNT, @h uniqueidentifier, @body xml, @saved bit = 0;
    IF @trancount = 0
        BEGIN TRANSACTION;
    ELSE IF @@OPTIONS & 16384 = 0
    BEGIN
        BEGIN TRY
            SAVE TRANSACTION usp_AsyncExecInvoke;
            SET @saved = 1;
        END TRY
        BEGIN CATCH
            IF ERROR_NUMBER() <> 627 OR XACT_STATE() <> 1
            BEGIN
                THROW;
            END;
        END CATCH;
    END;
    BEGIN TRY
        IF @idempotencyKey IS NOT NULL
        BEGIN
            -- read again under the key's application lock (@lock = 1: held to the end of this
            -- transaction; 50017 at once when another transaction holds it): committed since the
            -- check above, by a transaction that has ended, it is a replay
            EXEC asyncexec.usp_AsyncExecReplay @scope, @idempotencyKey, @digest, @lock = 1, @id = @madeId OUTPUT, @token = @madeToken OUTPUT;
            IF @madeId IS NOT NULL
            BEGIN
                IF @trancount = 0
                    COMMIT TRANSACTION;
                SELECT @id = @madeId, @token = @madeToken, @replayed = 1;
                RETURN;
            END;
        END;
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
        IF @idempotencyKey IS NOT NULL
            INSERT asyncexec.AsyncExecIdempotencyKeys (scope, idempotency_key, execution_id, execution_token, request_digest)
            VALUES (@scope, @idempotencyKey, @id, @token, @digest);
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
        ELSE IF XACT_STATE() = 1 AND @trancount > 0 AND @saved = 1
            ROLLBACK TRANSACTION usp_AsyncExecInvoke;     -- the savepoint saved above, by the same name
        THROW;
    END CATCH;
END;
