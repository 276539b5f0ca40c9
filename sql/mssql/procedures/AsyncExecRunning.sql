-- What runs now, in the spirit of the classic ExecutionStatus view: every activated
-- reader of our queues with the call it runs, plus calls marked RUNNING whose session
-- is no reader any more (lost; their lease timer will bring them back).
-- Reading it needs VIEW SERVER STATE (VIEW SERVER PERFORMANCE STATE on 2022) for the DMVs.
CREATE OR ALTER VIEW asyncexec.AsyncExecRunning
AS
SELECT COALESCE(e.session_id, t.spid) AS session_id,
       q.name AS queue,
       t.spid AS reader_session_id,           -- NULL: the call's session is gone
       e.id AS execution_id,
       e.token,
       e.[procedure],
       e.started_at,
       DATEDIFF_BIG(millisecond, e.started_at, SYSUTCDATETIME()) AS running_ms,
       e.attempts,
       r.status AS request_status,
       r.command,
       r.wait_type,
       r.blocking_session_id
FROM (SELECT at.spid, sq.name AS queue_object
        FROM sys.dm_broker_activated_tasks AS at
        JOIN sys.service_queues AS sq ON sq.object_id = at.queue_id
       WHERE at.database_id = DB_ID()) AS t
FULL OUTER JOIN (SELECT id, token, [procedure], queue, started_at, attempts, session_id
                   FROM asyncexec.AsyncExecResults WHERE status = 'RUNNING') AS e
     ON e.session_id = t.spid
LEFT JOIN asyncexec.AsyncExecQueues AS q
     -- a queue's name in the catalog takes the catalog's collation, which a (partially) contained
     -- database does not share with its tables: named, so the two never conflict (Msg 468)
     ON q.queue_object = t.queue_object COLLATE DATABASE_DEFAULT OR (t.queue_object IS NULL AND q.name = e.queue)
LEFT JOIN sys.dm_exec_requests AS r
     ON r.session_id = COALESCE(e.session_id, t.spid);
