-- Every instance hears every completion (docs/mssql.md, "Every instance hears every completion").
--
-- A completion's Status message lands on the one notification queue, and a RECEIVE hands
-- it to exactly one listener. So each running listener registers here with a wake-up
-- queue and service of its own (created at start by usp_AsyncExecListenerStart, named
-- after the instance); the listener that receives a batch from the notification queue
-- sends ONE empty [asyncexec/Wake] message per batch to every other registered listener
-- (usp_AsyncExecListenerWake, on one long-lived dialog per sender and receiver), and each
-- woken listener reads the change feed by rowversion as after any notification.

-- One row per running listener. No rowversion column here, on purpose: the heartbeat
-- writes every few seconds and must not hold MIN_ACTIVE_ROWVERSION() (the change feed's
-- horizon, which counts every open transaction that wrote a rowversion in the database).
CREATE TABLE asyncexec.AsyncExecListeners (
    instance_id   uniqueidentifier NOT NULL CONSTRAINT PK_AsyncExecListeners PRIMARY KEY,
    queue_object  sysname          NOT NULL,   -- asyncexec.[AsyncExecWake_<instance, 32 hex digits>]
    service_name  nvarchar(256)    NOT NULL,   -- [asyncexec/Wake/<instance, 32 hex digits>]
    host          nvarchar(128)    NULL,
    process_id    int              NULL,
    started_at    datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecListeners_started DEFAULT (SYSUTCDATETIME()),
    heartbeat_at  datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecListeners_heartbeat DEFAULT (SYSUTCDATETIME())
);
GO

-- The dialog a listener reuses to wake another (from_instance initiates, to_instance is
-- the target). Rows go with either listener (usp_AsyncExecListenerStop).
CREATE TABLE asyncexec.AsyncExecListenerDialogs (
    from_instance        uniqueidentifier NOT NULL,
    to_instance          uniqueidentifier NOT NULL,
    conversation_handle  uniqueidentifier NOT NULL,
    CONSTRAINT PK_AsyncExecListenerDialogs PRIMARY KEY (from_instance, to_instance)
);
GO

-- The wake-up carries nothing: the change feed is the truth.
CREATE MESSAGE TYPE [asyncexec/Wake] VALIDATION = EMPTY;
GO
CREATE CONTRACT [asyncexec/WakeContract] ([asyncexec/Wake] SENT BY INITIATOR);
GO
