-- A progress report as usp_AsyncExecProgress encodes it in CONTEXT_INFO (the layout is in that
-- file): one row (execution_id, sequence, percent, message), or none for a value that is not a
-- well-formed report of ours (another use of CONTEXT_INFO, zeros, NULL). Views may pad the
-- value with zeros to 128 bytes; every length used here is the encoded one.
-- binary to integer: the inverse of the encoding's CAST to binary (binary and varbinary: an
-- integer is stored big-endian, "0x0001e240" for 123456, and the round trip "always results in
-- the same value if both conversions are taking place on the same version of SQL Server":
-- encoder and decoder run on the same server); binary to nvarchar reads the bytes back as
-- UTF-16LE, nvarchar's own. A value read back (CONTEXT_INFO(), the views) may be padded with
-- zeros to 128 bytes: every length used here is the encoded one,
-- so padding is ignored, and a value that is not ours (no 'AEP1', bad lengths) gives no row.
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
