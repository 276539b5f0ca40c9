-- The parameters of every registered procedure, as invoke and the activated procedure see them.
-- has_default: OUTPUT parameters (the call always passes them) and those registered as optional.
CREATE OR ALTER VIEW asyncexec.AsyncExecParameters
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
