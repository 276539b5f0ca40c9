-- One row (gone = 1) when the dialog of an unfinished call can no longer bring it forward; no
-- row while it can. Used by usp_AsyncExecRecover (see there for why and for the callers'
-- permissions); a DBA can list the calls it would recover with
--   SELECT e.id, e.status FROM asyncexec.AsyncExecResults AS e
--   CROSS APPLY asyncexec.AsyncExecDialogGone(e.initiator_handle, e.target_handle) AS g
--   WHERE e.status IN ('PENDING', 'WAITING', 'RUNNING') AND e.held = 0;
-- (as db_owner: sys.conversation_endpoints and sys.transmission_queue show only the endpoints
-- and messages the current user owns or has a permission on).
--
-- Only the target (activated) side drives a call: its queue receives the request, the
-- DialogTimer messages (runAt, retry backoff, lease) and the EndDialog/Error. So the dialog is
-- gone when
--   * its target endpoint is missing from sys.conversation_endpoints or CLOSED ('CD'): the one
--     named by @target (recorded by the first RECEIVE of the request), or before that the
--     endpoint with is_initiator = 0 and the conversation_id of the initiator @initiator
--     (conversation_id "is shared by both participants in the conversation"); other states
--     still hold or will get a message for a reader (DI: its EndDialog is queued; ER: its Error);
--   * and no message of the dialog waits in sys.transmission_queue (not yet delivered: its
--     target endpoint may not exist yet).
CREATE OR ALTER FUNCTION asyncexec.AsyncExecDialogGone (@initiator uniqueidentifier, @target uniqueidentifier)
RETURNS TABLE
AS
RETURN
    SELECT CAST(1 AS bit) AS gone
    WHERE NOT EXISTS (SELECT 1
                        FROM sys.conversation_endpoints AS t
                       WHERE t.state <> 'CD'
                         AND (t.conversation_handle = @target
                              OR (@target IS NULL AND t.is_initiator = 0
                                  AND t.conversation_id = (SELECT i.conversation_id FROM sys.conversation_endpoints AS i
                                                            WHERE i.conversation_handle = @initiator))))
      AND NOT EXISTS (SELECT 1 FROM sys.transmission_queue AS q WHERE q.conversation_handle = @initiator);
