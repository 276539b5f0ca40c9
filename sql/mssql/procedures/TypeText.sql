-- The declared type of a parameter as T-SQL text (`nvarchar(50)`, `decimal(10,2)`),
-- from the system base type so that alias types (sysname, user alias types) work in
-- DECLARE and TRY_CONVERT, which do not accept every alias.
CREATE OR ALTER FUNCTION asyncexec.TypeText (@system_type_id tinyint, @max_length smallint, @precision tinyint, @scale tinyint)
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
