-- The T-SQL expression that turns one JSON argument (text, @value) into its parameter's type.
-- usp_AsyncExecInvoke checks a value with it (@try = 1: TRY_CONVERT, in the caller's session)
-- and usp_AsyncExecRun converts with it (@try = 0: CONVERT, in the activation's session), so a
-- value is read the same way on both sides, whatever each session's SET LANGUAGE and SET
-- DATEFORMAT (the activation session has the database's defaults; a caller has its login's).
--
-- Dates: usp_AsyncExecInvoke accepts only ISO 8601 forms that begin yyyy-mm-dd (time: hh:mm).
-- "Some character strings formats, for example ISO 8601, are interpreted independently of the
-- DATEFORMAT setting" and "the DATEFORMAT ydm is not supported for date, datetime2 and
-- datetimeoffset" (SET DATEFORMAT): for those types a leading four-digit year is always read
-- y-m-d. datetime and smalldatetime read 'yyyy-mm-dd' and 'yyyy-mm-dd hh:mm:ss' by DATEFORMAT
-- ('2024-03-01' is 3 January under dmy: the "effect of the DATEFORMAT setting ... might be
-- different for datetime and smalldatetime values"), so they are converted through
-- datetime2(7), which reads them y-m-d, and then to their own type (rounded as datetime and
-- smalldatetime round). No month names are accepted, so SET LANGUAGE plays no part.
-- Everything else converts directly (numbers and uniqueidentifier do not depend on the
-- session's language; money from text keeps its four decimals).
CREATE OR ALTER FUNCTION asyncexec.ArgumentConversion (@base_type nvarchar(128), @type_text nvarchar(128), @value nvarchar(200), @try bit)
RETURNS nvarchar(max)
AS
BEGIN
    DECLARE @convert nvarchar(20) = CASE WHEN @try = 1 THEN N'TRY_CONVERT(' ELSE N'CONVERT(' END;
    RETURN CASE
        WHEN @base_type IN (N'datetime', N'smalldatetime')
            THEN CONCAT(@convert, @type_text, N', ', @convert, N'datetime2(7), ', @value, N'))')
        ELSE CONCAT(@convert, @type_text, N', ', @value, N')')
    END;
END;
