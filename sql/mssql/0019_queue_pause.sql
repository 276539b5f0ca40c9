-- A paused queue takes calls but starts none (usp_AsyncExecPauseQueue, usp_AsyncExecActivated);
-- sql/postgres/0019_queue_pause.sql is the same for PostgreSQL. A handful of rows: the column's
-- default is written to each at once.
ALTER TABLE asyncexec.AsyncExecQueues ADD paused bit NOT NULL CONSTRAINT DF_AsyncExecQueues_paused DEFAULT (0);
GO
