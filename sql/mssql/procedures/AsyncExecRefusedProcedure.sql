-- Why a procedure may not be run as a call, or NULL when it may: read by usp_AsyncExecRegister
-- (which refuses to register it, 50005) and by usp_AsyncExecInvoke (which refuses a call of a
-- registration an earlier release made before it refused such procedures, 50001).
--   * the service's own procedures (schema asyncexec) are its machinery;
--   * SQL Server's own (schema sys or INFORMATION_SCHEMA, or an object Microsoft ships:
--     OBJECTPROPERTY IsMSShipped): registered, any caller allowed to invoke could run them with
--     the rights of the activation's EXECUTE AS OWNER;
--   * a user procedure named like a system procedure (dbo.sp_who): "If a user-defined procedure
--     has the same name as a system procedure, the user-defined procedure might not ever execute"
--     ("Execute a stored procedure", Limitations), so a call of it may run sys.sp_who instead.
--     System procedure names are matched under the calling database's collation (same page), so
--     the = below names it (COLLATE DATABASE_DEFAULT, whatever the view's column has). Only sp_
--     names are looked up: "EXEC dbo.sp_who" is a documented way of running the system
--     procedure ("Executing Stored Procedures (Database Engine)", SQL Server 2008 R2), and no
--     other schema-qualified name is documented to reach one (usp_AsyncExecRun always qualifies);
--     the lookup is a read of the catalog, made only for those names.
-- EXECUTE AS OWNER: catalog views show a user only the securables it owns or holds a permission
-- on ("Metadata Visibility Configuration"); the owner (dbo) sees every system object, so the
-- answer does not depend on the caller's permissions (usp_AsyncExecRegister runs as its caller).
CREATE OR ALTER FUNCTION asyncexec.AsyncExecRefusedProcedure (@object int)
RETURNS nvarchar(400)
WITH EXECUTE AS OWNER
AS
BEGIN
    DECLARE @schema sysname = OBJECT_SCHEMA_NAME(@object), @name sysname = OBJECT_NAME(@object), @system sysname;
    IF @schema = N'asyncexec'
        RETURN N'one of the service''s own procedures (schema asyncexec)';
    IF @schema IN (N'sys', N'INFORMATION_SCHEMA') OR OBJECTPROPERTY(@object, N'IsMSShipped') = 1
        RETURN N'one of SQL Server''s own procedures';
    -- nested IF, not AND: T-SQL does not promise to skip the lookup when the LIKE is false
    IF @name LIKE N'sp[_]%'
    BEGIN
        -- named as the catalog spells it (a case-insensitive database matches dbo.SP_WHO too)
        SELECT TOP (1) @system = s.name FROM sys.system_objects AS s
        WHERE s.name = @name COLLATE DATABASE_DEFAULT AND s.[type] IN ('P', 'X', 'PC');
        IF @system IS NOT NULL
            RETURN CONCAT(N'named as SQL Server''s own procedure sys.', @system, N', which a call by that name may run instead');
    END;
    RETURN NULL;
END;
