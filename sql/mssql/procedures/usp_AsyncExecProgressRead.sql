-- Store the progress that running calls report (usp_AsyncExecProgress) in AsyncExecProgress,
-- from outside their transactions; returns the ids of the executions whose stored report changed.
--
-- @id NULL (the service's progress reader, src/engines/mssql/progress.ts, a few times a second):
-- every RUNNING call, its report read from the session that runs it. The request's
-- context_info ("CONTEXT_INFO value of the session", sys.dm_exec_requests) is read with the
-- session's (sys.dm_exec_sessions): the function CONTEXT_INFO "does not return the new value"
-- to another batch of a session until "the batch that ran the SET statement" completes (MARS),
-- and an activated reader runs all its calls in one batch, so a session-level copy may lag;
-- the higher report number wins. Seeing other sessions there needs VIEW SERVER STATE (VIEW
-- SERVER PERFORMANCE STATE on 2022): "everyone can see their own session information" only,
-- so without it this finds nothing. No EXECUTE AS: an impersonated context is confined to the
-- database and would lose that server permission; the caller's own login must hold it.
--
-- @id given (usp_AsyncExecRun, in the transaction that records the call's outcome, before it
-- touches the call's row): this session's own CONTEXT_INFO(), so a report made just before
-- the call ended is kept even if no reader saw it. Returns nothing then.
--
-- The guard, since session ids are reused: a report is taken only when the id it carries is
-- the call RUNNING on the session it was read from (a value read a moment after that session
-- moved on to another call names the other call, and is not taken for this one). A report
-- replaces the stored one only if it is newer: a later run, or a higher number in the same run
-- (several service processes store what each reads; none goes back). Lock order: the
-- progress row, then (foreign key check) the call's row, as usp_AsyncExecRun takes them.
CREATE OR ALTER PROCEDURE asyncexec.usp_AsyncExecProgressRead
    @id bigint = NULL
AS
BEGIN
    SET NOCOUNT ON;
    -- "When SET XACT_ABORT is OFF, in some cases only the Transact-SQL statement that raised the
    -- error is rolled back and the transaction continues": a lock timeout here must not doom
    -- usp_AsyncExecRun's transaction (a SET in a procedure is restored when it returns)
    SET XACT_ABORT OFF;
    DECLARE @seen TABLE (id bigint PRIMARY KEY, started_at datetime2(3) NULL, sequence int NULL, [percent] decimal(5, 2) NULL, message nvarchar(54) NULL);
    DECLARE @changed TABLE (execution_id bigint NULL);

    -- Two statements, so that the DMVs are referenced only where they are read: the run's own
    -- path (an activation context, impersonated) never touches them.
    IF @id IS NULL
        INSERT @seen (id, started_at, sequence, [percent], message)
        SELECT id, started_at, sequence, [percent], message
        FROM (SELECT e.id, e.started_at, d.sequence, d.[percent], d.message,
                     ROW_NUMBER() OVER (PARTITION BY e.id ORDER BY d.sequence DESC) AS newest
              FROM asyncexec.AsyncExecResults AS e
              CROSS APPLY (SELECT r.context_info FROM sys.dm_exec_requests AS r WHERE r.session_id = e.session_id
                           UNION ALL
                           SELECT s.context_info FROM sys.dm_exec_sessions AS s WHERE s.session_id = e.session_id) AS c (info)
              CROSS APPLY asyncexec.AsyncExecProgressReport(c.info) AS d
              WHERE e.status = 'RUNNING' AND e.started_at IS NOT NULL AND d.execution_id = e.id) AS reports
        WHERE newest = 1;
    ELSE
        INSERT @seen (id, started_at, sequence, [percent], message)
        SELECT e.id, e.started_at, d.sequence, d.[percent], d.message
        FROM asyncexec.AsyncExecResults AS e
        -- "the preferred way to retrieve the context information for the current session"
        CROSS APPLY asyncexec.AsyncExecProgressReport(CONTEXT_INFO()) AS d
        WHERE e.id = @id AND e.session_id = @@SPID
          AND e.status = 'RUNNING' AND e.started_at IS NOT NULL AND d.execution_id = e.id;

    -- HOLDLOCK: "equivalent to SERIALIZABLE" (table hints), under which "other transactions
    -- can't insert new rows with key values that would fall in the range of keys read by any
    -- statements in the current transaction until the current transaction completes" (SET
    -- TRANSACTION ISOLATION LEVEL): the key range stays locked from the match to the insert,
    -- so two readers (or a reader and usp_AsyncExecRun) storing the first report of one call
    -- cannot both insert it (no 2627). Held to the end of the transaction: in the service's
    -- call that is this statement; in usp_AsyncExecRun, its outcome's commit (calls that
    -- reported and have no row yet may queue there on the same range a moment). MERGE
    -- "requires a semicolon (;) as a statement terminator" (error 10713 otherwise).
    MERGE asyncexec.AsyncExecProgress WITH (HOLDLOCK) AS p
    USING @seen AS n
       ON p.execution_id = n.id
    WHEN MATCHED AND (p.run_started_at < n.started_at OR (p.run_started_at = n.started_at AND p.sequence < n.sequence)) THEN
        UPDATE SET run_started_at = n.started_at, sequence = n.sequence, [percent] = n.[percent], message = n.message,
                   at = SYSUTCDATETIME()
    WHEN NOT MATCHED THEN
        INSERT (execution_id, run_started_at, sequence, [percent], message, at)
        VALUES (n.id, n.started_at, n.sequence, n.[percent], n.message, SYSUTCDATETIME())
    OUTPUT inserted.execution_id INTO @changed (execution_id);

    IF @id IS NULL
        SELECT execution_id FROM @changed;
END;
