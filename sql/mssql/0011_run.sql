-- The run path (issue 11, items 1 and 8; docs/mssql.md, "Calls that run outside a transaction"
-- and "When a call's messages cannot be handled").
--
-- transactional (AsyncExecProcedures): 1 runs the call inside the transaction that records its
-- outcome (as before); 0 runs it with no transaction open and records the outcome after, in a
-- transaction of its own. Copied onto the call (AsyncExecResults.transactional) when a run
-- starts, so the reader that finds a run lost knows how that run was made even if the
-- registration changed since: a lost non-transactional run is failed, never run again.
-- A NOT NULL column with a default is filled with the default in every existing row (as
-- 0007's held column); NULL on AsyncExecResults means no run has started, or one made before
-- this migration (transactional: the only mode there was).
ALTER TABLE asyncexec.AsyncExecProcedures
    ADD transactional bit NOT NULL CONSTRAINT DF_AsyncExecProcedures_transactional DEFAULT (1);
GO
ALTER TABLE asyncexec.AsyncExecResults
    ADD transactional bit NULL;
GO

-- strike: whether a failure of a reader's claim counts towards giving the call up (our
-- poison-message handling). Transient failures (deadlock victim, lock timeout, log full, …)
-- are logged with 0; a claim that commits for the dialog sets its earlier strikes to 0, so
-- only consecutive failures that are not transient count. NULL: logged by something else.
ALTER TABLE asyncexec.AsyncExecErrors
    ADD strike bit NULL;
GO

-- Dead letters: a message that could not be handled five times and whose call could not be
-- recorded FAILED either (usp_AsyncExecAbandon). The dialog is NOT ended (that would drop its
-- messages and timer while the call stays unfinished): the message is moved here, in one
-- transaction with its RECEIVE, so the queue behind it moves on and nothing is lost. An
-- operator replays it by arming the dialog's timer (docs/mssql.md).
CREATE TABLE asyncexec.AsyncExecDeadLetters (
    id                   bigint IDENTITY(1, 1) NOT NULL CONSTRAINT PK_AsyncExecDeadLetters PRIMARY KEY,
    dead_at              datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecDeadLetters_dead DEFAULT (SYSUTCDATETIME()),
    queue                nvarchar(100)    NULL,
    execution_id         bigint           NULL,
    conversation_handle  uniqueidentifier NOT NULL,   -- the activated (target) side of the call's dialog
    message_type_name    sysname          NULL,
    message_body         varbinary(max)   NULL,
    error_number         int              NULL,
    error_message        nvarchar(4000)   NULL,
    replayed_at          datetime2(3)     NULL
);
CREATE INDEX IX_AsyncExecDeadLetters_execution ON asyncexec.AsyncExecDeadLetters (execution_id);
GO

-- timeoutMs is not offered on SQL Server (usp_AsyncExecRegister refuses it; docs/mssql.md,
-- "Timeouts"): a registration that carries one never had it enforced. Clear it, so the
-- registry says what happens.
UPDATE asyncexec.AsyncExecProcedures SET timeout_ms = NULL WHERE timeout_ms IS NOT NULL;
GO
