-- Service Broker objects shared by every queue.
--
-- Conversation strategy: one dialog per call, begun by usp_AsyncExecInvoke FROM the
-- notification service TO the target service of the call's queue.
--  * The request travels initiator -> target; every status change of the call
--    (RUNNING, WAITING for a retry, the final outcome) travels back target -> initiator
--    on the same dialog, so it lands on the notification queue the listener reads.
--  * Messages of one conversation are received exactly once and in order, so the
--    listener can never see a call's outcome before its RUNNING change.
--  * Each new dialog gets its own conversation group, and RECEIVE locks the
--    conversation group of what it returns until the transaction ends: calls of one
--    queue therefore run in parallel (up to MAX_QUEUE_READERS), while a call's own
--    messages (request, timers) are never handled by two readers at once.
--  * A conversation timer on the call's dialog schedules runAt and retry backoff,
--    and is the lease that recovers a call whose reader died.
--  * Both sides end the dialog: the activated procedure after the outcome, the
--    listener when it receives the EndDialog that follows the outcome.

-- Validated on arrival: a malformed body never reaches a reader.
CREATE MESSAGE TYPE [asyncexec/Request] VALIDATION = WELL_FORMED_XML;   -- <request id="…"/>
GO
CREATE MESSAGE TYPE [asyncexec/Status] VALIDATION = WELL_FORMED_XML;    -- <status id="…" status="…" cursor="0x…"/>
GO
CREATE CONTRACT [asyncexec/Contract] (
    [asyncexec/Request] SENT BY INITIATOR,
    [asyncexec/Status] SENT BY TARGET
);
GO

-- The notification queue: read by the service's listener (WAITFOR (RECEIVE …)),
-- so it has no activation. Poison-message handling is off on every queue of ours:
-- a disabled queue would stop everything behind one bad message, and our readers
-- never roll back a RECEIVE because of a call's failure. The request queues' readers
-- handle poison messages themselves (usp_AsyncExecAbandon, after five failures).
CREATE QUEUE asyncexec.AsyncExecNotifyQueue
    WITH STATUS = ON,
         RETENTION = OFF,
         POISON_MESSAGE_HANDLING (STATUS = OFF);
GO

-- Initiator of every call's dialog; an initiator-only service lists no contract.
CREATE SERVICE [asyncexec/NotifyService] ON QUEUE asyncexec.AsyncExecNotifyQueue;
GO
