-- The revision of the procedure files installed (sql/mssql/procedures/REVISION, raised with every
-- change of them; test/migrations.test.ts pins it), and a guard, as
-- sql/postgres/0016_routines_revision.sql: only a migrator of that revision or a newer one may
-- write asyncexec.AsyncExecRoutines. A service of an older release started after a newer one had
-- upgraded the database (a restart in the middle of a rolling upgrade, a rollback) applied its
-- own older procedure files over the newer ones (every file whose digest differs from the one
-- recorded). Its migrator's write of AsyncExecRoutines now fails, inside the transaction that
-- ALTERed the procedures, which rolls back with it: it refuses to start. A migrator says its
-- revision in SESSION_CONTEXT(N'asyncexec.routines_revision') (sp_set_session_context, SQL
-- Server 2016 and later, as the service requires).
CREATE TABLE asyncexec.AsyncExecRoutinesRevision (
    only_row  bit  NOT NULL CONSTRAINT PK_AsyncExecRoutinesRevision PRIMARY KEY
                            CONSTRAINT CK_AsyncExecRoutinesRevision_only CHECK (only_row = 1),
    revision  int  NOT NULL
);
GO
-- An AFTER trigger fires once per statement, whatever the rows ("CREATE TRIGGER", DML
-- triggers): `inserted` holds the rows written. Inside a trigger XACT_ABORT is ON unless the
-- trigger sets it OFF, so its THROW rolls back the whole transaction, the migrator's ALTERs too.
CREATE TRIGGER asyncexec.TR_AsyncExecRoutines_guard ON asyncexec.AsyncExecRoutines
AFTER INSERT, UPDATE
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @installed int = (SELECT revision FROM asyncexec.AsyncExecRoutinesRevision WHERE only_row = 1),
            @mine int = COALESCE(TRY_CONVERT(int, SESSION_CONTEXT(N'asyncexec.routines_revision')), 0),
            @message nvarchar(2048);
    IF @installed IS NOT NULL AND @mine < @installed AND EXISTS (SELECT 1 FROM inserted)
    BEGIN
        SET @message = CONCAT(N'the procedures of this database are revision ', @installed,
                              N', installed by a newer asyncproc; this one (revision ', @mine,
                              N') may not replace them: run the newer release (a downgrade is not supported)');
        THROW 50046, @message, 1;
    END;
END;
GO
