-- A progress report as usp_AsyncExecProgress encodes it in CONTEXT_INFO (the layout is in that
-- file): one row (execution_id, sequence, percent, message), or none for a value that is not a
-- well-formed report of ours (another use of CONTEXT_INFO, zeros, NULL). Views may pad the
-- value with zeros to 128 bytes; every length used here is the encoded one.
-- binary to integer: "the data is padded or truncated on the left" (CAST and CONVERT), the
-- inverse of the encoding's CAST; binary to nvarchar reads UTF-16LE, nvarchar's own bytes.
CREATE OR ALTER FUNCTION asyncexec.AsyncExecProgressReport (@info varbinary(128))
RETURNS TABLE
AS
RETURN
    SELECT CAST(SUBSTRING(@info, 5, 8) AS bigint) AS execution_id,
           CAST(SUBSTRING(@info, 13, 4) AS int) AS sequence,
           CAST(CAST(SUBSTRING(@info, 17, 2) AS smallint) / 100.0 AS decimal(5, 2)) AS [percent],
           CASE WHEN CAST(SUBSTRING(@info, 19, 1) AS tinyint) = 255 THEN NULL
                ELSE CAST(SUBSTRING(@info, 20, 2 * CAST(SUBSTRING(@info, 19, 1) AS tinyint)) AS nvarchar(54)) END AS message
    WHERE SUBSTRING(@info, 1, 4) = 0x41455031
      AND DATALENGTH(@info) >= 19
      AND CAST(SUBSTRING(@info, 17, 2) AS smallint) BETWEEN 0 AND 10000
      AND (CAST(SUBSTRING(@info, 19, 1) AS tinyint) <= 54 OR CAST(SUBSTRING(@info, 19, 1) AS tinyint) = 255)
      AND DATALENGTH(@info) >= 19 + 2 * IIF(CAST(SUBSTRING(@info, 19, 1) AS tinyint) = 255, 0, CAST(SUBSTRING(@info, 19, 1) AS tinyint));
