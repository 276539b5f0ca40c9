-- Recurring schedules (issue 15), as sql/postgres/0009_schedules.sql: a schedule starts its
-- procedure at the instants of a cron expression in a time zone. The service computes each
-- next instant (croner, with the zone's daylight-saving rules) and stores it in next_run_at;
-- a fire is one transaction that moves next_run_at forward and invokes the call
-- (usp_AsyncExecFireSchedule), so each instant fires once however many service processes run.
-- Times are UTC, datetime2(3) as everywhere in asyncexec.
CREATE TABLE asyncexec.AsyncExecSchedules (
    name              nvarchar(128)  NOT NULL CONSTRAINT PK_AsyncExecSchedules PRIMARY KEY,
    [procedure]       nvarchar(261)  NOT NULL,
    arguments         nvarchar(max)  NOT NULL CONSTRAINT DF_AsyncExecSchedules_arguments DEFAULT (N'{}'),
    cron              nvarchar(200)  NOT NULL,
    timezone          nvarchar(100)  NOT NULL CONSTRAINT DF_AsyncExecSchedules_timezone DEFAULT (N'UTC'),
    queue             nvarchar(100)  NULL,   -- NULL: the procedure's registered queue at each fire
    max_attempts      int            NULL,
    overlap           varchar(5)     NOT NULL CONSTRAINT DF_AsyncExecSchedules_overlap DEFAULT ('ALLOW'),
    catch_up          varchar(4)     NOT NULL CONSTRAINT DF_AsyncExecSchedules_catch_up DEFAULT ('ONCE'),
    paused            bit            NOT NULL CONSTRAINT DF_AsyncExecSchedules_paused DEFAULT (0),
    next_run_at       datetime2(3)   NULL,   -- NULL while paused
    last_run_at       datetime2(3)   NULL,   -- when it last fired (the instant fired for is the call's run_at)
    last_execution_id bigint         NULL,   -- the call it started last (overlap SKIP looks at it)
    created_at        datetime2(3)   NOT NULL CONSTRAINT DF_AsyncExecSchedules_created DEFAULT (SYSUTCDATETIME()),
    created_by        nvarchar(256)  NULL,
    updated_at        datetime2(3)   NOT NULL CONSTRAINT DF_AsyncExecSchedules_updated DEFAULT (SYSUTCDATETIME()),
    CONSTRAINT CK_AsyncExecSchedules_arguments CHECK (ISJSON(arguments) = 1),
    CONSTRAINT CK_AsyncExecSchedules_max_attempts CHECK (max_attempts BETWEEN 1 AND 100),
    CONSTRAINT CK_AsyncExecSchedules_overlap CHECK (overlap IN ('ALLOW', 'SKIP')),
    CONSTRAINT CK_AsyncExecSchedules_catch_up CHECK (catch_up IN ('ONCE', 'SKIP'))
);
GO
CREATE INDEX IX_AsyncExecSchedules_next_run ON asyncexec.AsyncExecSchedules (next_run_at);
GO

-- The schedule that started a call (NULL: invoked directly). Adding a NULL column with no
-- default changes metadata only. No filtered index: DML on a table with one needs the
-- session's SET options right (ANSI_NULLS, QUOTED_IDENTIFIER …), and every caller inserts here.
ALTER TABLE asyncexec.AsyncExecResults
    ADD schedule_name nvarchar(128) NULL;
GO
CREATE INDEX IX_AsyncExecResults_schedule ON asyncexec.AsyncExecResults (schedule_name, id);
GO
