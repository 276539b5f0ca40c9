-- Withdraw a registration by its registered name: nothing new can be invoked for it; the
-- calls submitted before still run (the row stays, marked). Errors: 50006 not registered.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecUnregister
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
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50006, @message, 1;
    END;
END;
