-- Called by a running procedure: report how far it has got (asyncproc.progress() on PostgreSQL).
--
-- The report goes into this session's CONTEXT_INFO, the one channel out of a running call that
-- no transaction holds back: "associates up to 128 bytes of binary information with the current
-- session" (SET CONTEXT_INFO), a session setting and no data modification, so neither the
-- commit nor a rollback of the call's transaction changes it ("ROLLBACK TRANSACTION ... erase[s]
-- all data modifications"), and "unlike other SET statements, the new value ... persists after
-- the stored procedure or trigger is completed". Other sessions read it in the context_info
-- columns of sys.dm_exec_requests and sys.dm_exec_sessions, with VIEW SERVER STATE (VIEW SERVER
-- PERFORMANCE STATE on 2022); the service's progress reader does, a few times a second
-- (src/engines/mssql/progress.ts, docs/mssql.md "Live progress"). A report replaces the one
-- before: the reader keeps the latest it sees, so a chatty procedure costs nothing more.
--
-- The encoding (integers big-endian: "When other data types are converted to binary or
-- varbinary, the data is padded or truncated on the left", and "the integer value 123456 is
-- stored as a binary 0x0001e240", binary and varbinary; the decoder casts back, and "converting
-- ... to a binary value of large enough size and then back to that type always results in the
-- same value if both conversions are taking place on the same version of SQL Server": both run
-- on the one server, never in the service), 1-based byte positions:
--     1–4    0x41455031 ('AEP1'): ours, version 1
--     5–12   the execution's id (bigint), from SESSION_CONTEXT(N'asyncexec.execution'), which
--            usp_AsyncExecRun sets for each call: the reader takes a report only for the call
--            its session runs now (session ids are reused)
--     13–16  the report's number within this run (int, 1, 2, …)
--     17–18  percent × 100 (smallint, 0–10000)
--     19     the message's length in UTF-16 code units (0–54), 255 for no message
--     20–127 the message, UTF-16LE (nvarchar's bytes), at most 54 code units
-- Views may show the value padded with zeros to 128 bytes: every length is explicit.
--
-- Outside a call (no execution in the session context: a direct call, a test) it does nothing.
-- It overwrites CONTEXT_INFO: a called procedure that uses CONTEXT_INFO for its own purposes
-- sets its value again after reporting. Errors: 50045 a percent outside 0–100.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecProgress
    @percent float,
    @message nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    -- SESSION_CONTEXT returns sql_variant, "NULL if no value is set" for the key; TRY_CAST gives
    -- NULL, not an error, for a value that is not a bigint (someone else's use of the key)
    DECLARE @id bigint = TRY_CAST(SESSION_CONTEXT(N'asyncexec.execution') AS bigint),
            -- "the preferred way to retrieve the context information for the current session"
            @previous varbinary(128) = CONTEXT_INFO(),
            @sequence int = 1, @text varbinary(max), @length int, @info varbinary(128), @error nvarchar(2048);

    -- Checked first, so that a bad percent fails also outside a call. THROW: "The statement
    -- before the THROW statement must be followed by the semicolon (;)"; error_number "must be
    -- greater than or equal to 50000"; the severity is always 16. 50045: the next of the numbers
    -- our procedures raise (50041 to 50044 before it), none mapped to a GraphQL code (errors.ts):
    -- it reaches the called procedure, and is recorded on the call if uncaught.
    IF @percent IS NULL OR @percent < 0 OR @percent > 100
    BEGIN
        SET @error = CONCAT(N'usp_AsyncExecProgress: @percent must be between 0 and 100, not ', COALESCE(CONVERT(nvarchar(30), @percent), N'NULL'));
        THROW 50045, @error, 1;
    END;
    IF @id IS NULL
        RETURN;

    IF SUBSTRING(@previous, 1, 4) = 0x41455031 AND SUBSTRING(@previous, 5, 8) = CAST(@id AS binary(8))
       AND CAST(SUBSTRING(@previous, 13, 4) AS int) < 2147483647
        SET @sequence = CAST(SUBSTRING(@previous, 13, 4) AS int) + 1;

    -- nvarchar's bytes, UTF-16 little-endian (nvarchar stores UTF-16 whatever the collation;
    -- a string converted to binary is "padded or truncated on the right", and varbinary(max)
    -- pads nothing); 108 bytes = 54 code units: 19 + 108 = 127 <= 128 ("up to 128 bytes")
    SET @text = CAST(@message AS varbinary(max));
    IF DATALENGTH(@text) > 108
        SET @text = SUBSTRING(@text, 1, 108);
    -- a high surrogate (U+D800–U+DBFF, the first half of a pair) cut from its second half goes
    -- too; little-endian, its second byte is 0xD8–0xDB
    IF DATALENGTH(@text) >= 2 AND SUBSTRING(@text, DATALENGTH(@text), 1) BETWEEN 0xD8 AND 0xDB
        SET @text = SUBSTRING(@text, 1, DATALENGTH(@text) - 2);
    SET @length = CASE WHEN @text IS NULL THEN 255 ELSE DATALENGTH(@text) / 2 END;

    -- ROUND first: "when you convert data types that differ in decimal places, SQL Server
    -- sometimes returns a truncated result value, and at other times it returns a rounded
    -- value" (CAST and CONVERT); a whole number converts exactly, and 0–10000 fits smallint; a + of binary values concatenates them ("+ (String Concatenation)"
    -- takes binary operands)
    SET @info = 0x41455031 + CAST(@id AS binary(8)) + CAST(@sequence AS binary(4))
              + CAST(CAST(ROUND(@percent * 100, 0) AS smallint) AS binary(2))
              + CAST(CAST(@length AS tinyint) AS binary(1)) + COALESCE(@text, 0x);
    -- "SET CONTEXT_INFO does not accept expressions other than constants or variable names"
    SET CONTEXT_INFO @info;
END;
