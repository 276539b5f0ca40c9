-- Live progress (issue 15), as sql/postgres/0010_progress.sql: the latest progress a running
-- call reported. A called procedure reports with asyncexec.usp_AsyncExecProgress, which puts
-- the report in its session's CONTEXT_INFO (not transactional, readable by other sessions in
-- sys.dm_exec_requests / sys.dm_exec_sessions); the service's progress reader
-- (src/engines/mssql/progress.ts) reads the sessions running calls, and stores each new report
-- here from its own connection, outside the call's transaction, so it is visible while the
-- call runs and stays after it ends (also when the call is rolled back).
-- run_started_at: the AsyncExecResults.started_at of the run that reported it (a retry or a
-- recovered run starts again, and hides the reports of the runs before); sequence: the
-- report's number within its run (usp_AsyncExecProgress counts), so several service
-- processes storing what they read keep the latest and never go back.
-- A purged call takes its progress with it (ON DELETE CASCADE, as AsyncExecAttempts).
CREATE TABLE asyncexec.AsyncExecProgress (
    execution_id    bigint        NOT NULL CONSTRAINT PK_AsyncExecProgress PRIMARY KEY,
    run_started_at  datetime2(3)  NOT NULL,
    sequence        int           NOT NULL,
    [percent]       decimal(5, 2) NOT NULL,
    message         nvarchar(54)  NULL,
    at              datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecProgress_at DEFAULT (SYSUTCDATETIME()),
    CONSTRAINT FK_AsyncExecProgress_execution FOREIGN KEY (execution_id)
        REFERENCES asyncexec.AsyncExecResults (id) ON DELETE CASCADE,
    CONSTRAINT CK_AsyncExecProgress_percent CHECK ([percent] BETWEEN 0 AND 100)
);
GO
