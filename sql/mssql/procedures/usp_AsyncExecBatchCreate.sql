-- Create a batch of @stageCount stages inside the caller's transaction; its calls are then
-- invoked with usp_AsyncExecInvoke @batchId = @batchId, @stage = 1 … @stageCount, before the
-- caller commits. A later stage left without calls is skipped when the stage before it
-- ends; but stage 1 must have calls: a batch whose first stage has none is settled only
-- when a call of it ends, so it stays RUNNING, its later calls held, until one is added.
-- Errors: 50005 bad stage count or failure policy, or no open transaction.
-- EXECUTE AS OWNER, as usp_AsyncExecInvoke: callers need only EXECUTE on the two procedures.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecBatchCreate
    @stageCount  int,
    @onFailure   varchar(8) = 'CANCEL',
    @submittedBy nvarchar(256) = NULL,
    @batchId     uniqueidentifier = NULL OUTPUT
WITH EXECUTE AS OWNER
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @message nvarchar(2048);
    SET @batchId = NULL;
    -- Stored as the service reads it: T-SQL compares case-insensitively (usual collations) and
    -- ignores trailing blanks, so 'cancel' or 'CANCEL ' would pass the checks below as they are.
    SET @onFailure = UPPER(RTRIM(COALESCE(@onFailure, 'CANCEL')));
    IF @stageCount IS NULL OR @stageCount < 1
    BEGIN
        SET @message = CONCAT(N'a batch has at least one stage, not ', COALESCE(CAST(@stageCount AS nvarchar(11)), N'NULL'));
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    IF @onFailure NOT IN ('CANCEL', 'CONTINUE')
    BEGIN
        SET @message = CONCAT(N'onFailure must be CANCEL or CONTINUE, not ', @onFailure);
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;
    -- Outside a transaction the first stage could finish, and the batch end, before the
    -- calls of the later stages were added.
    IF @@TRANCOUNT = 0
    BEGIN
        SET @message = N'create a batch and invoke its calls in one transaction';
        SET @message = REPLACE(@message, N'%', N'%%');
        THROW 50005, @message, 1;
    END;

    SET @batchId = NEWID();
    INSERT asyncexec.AsyncExecBatches (id, on_failure, stage_count, submitted_by, submitted_login)
    VALUES (@batchId, @onFailure, @stageCount, @submittedBy, ORIGINAL_LOGIN());
END;
