-- Delete finished history older than the retention; returns how many calls went.
-- Only terminal rows go: their dialogs are already ended on our side. Each call's
-- attempts (asyncexec.AsyncExecAttempts) go in the same statement, through the
-- ON DELETE CASCADE of FK_AsyncExecAttempts_execution: the log never outlives its call.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecPurge
    @olderThanSeconds int,
    @batchSize int = 5000
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @cutoff datetime2(3) = DATEADD(second, -@olderThanSeconds, SYSUTCDATETIME()), @deleted int = 0, @n int = 1;
    WHILE @n > 0
    BEGIN
        DELETE TOP (@batchSize) e
        FROM asyncexec.AsyncExecResults AS e
        WHERE e.finished_at < @cutoff AND e.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND (e.batch_id IS NULL
               -- finished_at is set exactly when the batch is no longer RUNNING (CK_AsyncExecBatches_finished)
               OR EXISTS (SELECT 1 FROM asyncexec.AsyncExecBatches AS b WHERE b.id = e.batch_id AND b.finished_at < @cutoff));
        SET @n = @@ROWCOUNT;
        SET @deleted += @n;
    END;
    SET @n = 1;
    WHILE @n > 0
    BEGIN
        -- a batch finishes after its members, so the loop above has taken them all
        DELETE TOP (@batchSize) b
        FROM asyncexec.AsyncExecBatches AS b
        WHERE b.finished_at < @cutoff AND b.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
          AND NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecResults AS e WHERE e.batch_id = b.id);
        SET @n = @@ROWCOUNT;
    END;
    DELETE FROM asyncexec.AsyncExecErrors WHERE logged_at < @cutoff;
    SELECT @deleted AS deleted;
END;
