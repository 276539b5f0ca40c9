-- asyncproc on SQL Server 2019+ / Azure SQL Managed Instance: tables.
-- Everything of ours lives in schema asyncexec (the migrator creates the schema and
-- asyncexec.AsyncExecSchemaVersions before it runs this script). Times are UTC.

-- One row per named queue; each is its own Service Broker queue whose
-- MAX_QUEUE_READERS is the concurrency (see usp_AsyncExecCreateQueue).
CREATE TABLE asyncexec.AsyncExecQueues (
    name                  nvarchar(100) NOT NULL CONSTRAINT PK_AsyncExecQueues PRIMARY KEY,
    concurrency           int           NOT NULL CONSTRAINT DF_AsyncExecQueues_concurrency DEFAULT (10),
    queue_object          sysname       NOT NULL,   -- asyncexec.<queue_object> is the Service Broker queue
    service_name          nvarchar(256) NOT NULL,   -- the target service the invoke procedure routes to
    activation_procedure  sysname       NOT NULL,   -- asyncexec.<activation_procedure>, the queue's reader
    created_at            datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecQueues_created DEFAULT (SYSUTCDATETIME()),
    CONSTRAINT CK_AsyncExecQueues_name CHECK (LEN(name) BETWEEN 1 AND 100 AND name NOT LIKE N'%[^A-Za-z0-9_.:-]%'),
    CONSTRAINT CK_AsyncExecQueues_concurrency CHECK (concurrency BETWEEN 1 AND 1000)
);
GO

-- The procedure registry: nothing unregistered can be invoked.
-- optional_parameters: JSON array of parameter names (no @) that may be left out.
-- sys.parameters.has_default_value is only reliable for CLR procedures, and parsing
-- the module text is not a safe way to find T-SQL defaults, so whoever registers a
-- procedure says which parameters have defaults; every other input is required.
CREATE TABLE asyncexec.AsyncExecProcedures (
    name                 nvarchar(261) NOT NULL CONSTRAINT PK_AsyncExecProcedures PRIMARY KEY,   -- schema.procedure
    schema_name          sysname       NOT NULL,
    procedure_name       sysname       NOT NULL,
    queue                nvarchar(100) NOT NULL CONSTRAINT DF_AsyncExecProcedures_queue DEFAULT (N'default')
                         CONSTRAINT FK_AsyncExecProcedures_queue REFERENCES asyncexec.AsyncExecQueues (name),
    max_attempts         int           NOT NULL CONSTRAINT DF_AsyncExecProcedures_attempts DEFAULT (1),
    timeout_ms           int           NULL,
    optional_parameters  nvarchar(max) NULL,
    registered_at        datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecProcedures_registered DEFAULT (SYSUTCDATETIME()),
    CONSTRAINT UQ_AsyncExecProcedures_object UNIQUE (schema_name, procedure_name),
    CONSTRAINT CK_AsyncExecProcedures_attempts CHECK (max_attempts BETWEEN 1 AND 100),
    CONSTRAINT CK_AsyncExecProcedures_timeout CHECK (timeout_ms > 0),
    CONSTRAINT CK_AsyncExecProcedures_optional CHECK (optional_parameters IS NULL OR ISJSON(optional_parameters) = 1)
);
GO

-- One row per requested call (the seed's AsyncExecResults, grown up).
-- row_version changes with every status change: it is the listener's catch-up
-- cursor and the cursor of eventsSince.
CREATE TABLE asyncexec.AsyncExecResults (
    id                bigint IDENTITY(1, 1) NOT NULL CONSTRAINT PK_AsyncExecResults PRIMARY KEY,
    token             uniqueidentifier NOT NULL CONSTRAINT UQ_AsyncExecResults_token UNIQUE,
    [procedure]       nvarchar(261)    NOT NULL,
    arguments         nvarchar(max)    NOT NULL,
    queue             nvarchar(100)    NOT NULL,
    status            varchar(10)      NOT NULL,
    submitted_at      datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecResults_submitted DEFAULT (SYSUTCDATETIME()),
    run_at            datetime2(3)     NULL,
    started_at        datetime2(3)     NULL,
    finished_at       datetime2(3)     NULL,
    attempts          int              NOT NULL CONSTRAINT DF_AsyncExecResults_attempts DEFAULT (0),
    max_attempts      int              NOT NULL CONSTRAINT DF_AsyncExecResults_max_attempts DEFAULT (1),
    recoveries        int              NOT NULL CONSTRAINT DF_AsyncExecResults_recoveries DEFAULT (0),  -- runs lost with their session
    -- set (and committed) by usp_AsyncExecCancel before it kills the session running the
    -- call: whoever next finds the call without a live reader records it CANCELLED
    cancel_requested  bit              NOT NULL CONSTRAINT DF_AsyncExecResults_cancel DEFAULT (0),
    submitted_by      nvarchar(256)    NULL,
    submitted_login   nvarchar(128)    NULL,
    error_number      int              NULL,
    error_severity    int              NULL,
    error_state       int              NULL,
    error_line        int              NULL,
    error_procedure   nvarchar(128)    NULL,
    error_message     nvarchar(4000)   NULL,
    result            nvarchar(max)    NULL,
    session_id        int              NULL,   -- @@SPID of the activated reader that ran it
    worker            nvarchar(128)    NULL,
    initiator_handle  uniqueidentifier NULL,   -- the invoke side of the call's dialog
    target_handle     uniqueidentifier NULL,   -- the activated side, set when the request is received
    batch_id          uniqueidentifier NULL,   -- reserved for batches and stages
    stage             int              NULL,
    row_version       rowversion       NOT NULL,
    CONSTRAINT CK_AsyncExecResults_status CHECK (status IN ('WAITING', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    CONSTRAINT CK_AsyncExecResults_arguments CHECK (ISJSON(arguments) = 1),
    CONSTRAINT CK_AsyncExecResults_result CHECK (result IS NULL OR ISJSON(result) = 1)
);
GO

-- The execution log: one row per attempt of a call, in the spirit of the classic
-- scheduler's execution log (which session ran what, and when). A row is written when
-- an attempt starts (the claim) and closed when it ends, always in the transaction that
-- changes the call's AsyncExecResults row, so the two never disagree:
--   RUNNING    the attempt runs now (the call is RUNNING and this is its last attempt)
--   SUCCEEDED  / FAILED  its outcome (a FAILED attempt with attempts left is followed by a retry)
--   LOST       its session died (or could not record the outcome) and the call was
--              started again or failed; the next attempt takes the next number
-- number counts the runs that started (1, 2, …), so it can exceed AsyncExecResults.attempts
-- (which does not count lost runs; those are AsyncExecResults.recoveries).
-- Deleting a call (usp_AsyncExecPurge) deletes its attempts with it (ON DELETE CASCADE).
CREATE TABLE asyncexec.AsyncExecAttempts (
    execution_id     bigint         NOT NULL,
    number           int            NOT NULL,
    status           varchar(10)    NOT NULL,
    started_at       datetime2(3)   NOT NULL,
    finished_at      datetime2(3)   NULL,
    session_id       int            NULL,   -- @@SPID of the activated reader that ran it
    worker           nvarchar(128)  NULL,
    error_number     int            NULL,
    error_severity   int            NULL,
    error_state      int            NULL,
    error_line       int            NULL,
    error_procedure  nvarchar(128)  NULL,
    error_message    nvarchar(4000) NULL,
    CONSTRAINT PK_AsyncExecAttempts PRIMARY KEY CLUSTERED (execution_id, number),
    CONSTRAINT FK_AsyncExecAttempts_execution FOREIGN KEY (execution_id)
        REFERENCES asyncexec.AsyncExecResults (id) ON DELETE CASCADE,
    CONSTRAINT CK_AsyncExecAttempts_number CHECK (number >= 1),
    CONSTRAINT CK_AsyncExecAttempts_status CHECK (status IN ('RUNNING', 'SUCCEEDED', 'FAILED', 'LOST'))
);
GO

-- No filtered indexes: DML on such a table needs specific SET options that an
-- activated procedure or a caller's session may not have.
CREATE INDEX IX_AsyncExecResults_row_version ON asyncexec.AsyncExecResults (row_version);
CREATE INDEX IX_AsyncExecResults_queue_status ON asyncexec.AsyncExecResults (queue, status);
CREATE INDEX IX_AsyncExecResults_procedure ON asyncexec.AsyncExecResults ([procedure], id);
CREATE INDEX IX_AsyncExecResults_status ON asyncexec.AsyncExecResults (status, id);
CREATE INDEX IX_AsyncExecResults_target_handle ON asyncexec.AsyncExecResults (target_handle);
CREATE INDEX IX_AsyncExecResults_finished ON asyncexec.AsyncExecResults (finished_at);
GO

-- Failures of the machinery itself (never of a call: those go to AsyncExecResults).
-- An activated procedure cannot RAISERROR ... WITH LOG under EXECUTE AS OWNER.
CREATE TABLE asyncexec.AsyncExecErrors (
    id                   bigint IDENTITY(1, 1) NOT NULL CONSTRAINT PK_AsyncExecErrors PRIMARY KEY,
    logged_at            datetime2(3)     NOT NULL CONSTRAINT DF_AsyncExecErrors_logged DEFAULT (SYSUTCDATETIME()),
    queue                nvarchar(100)    NULL,
    execution_id         bigint           NULL,
    conversation_handle  uniqueidentifier NULL,
    message_type_name    sysname          NULL,
    error_number         int              NULL,
    error_message        nvarchar(4000)   NULL
);
-- the readers count a dialog's failures here (our poison-message handling)
CREATE INDEX IX_AsyncExecErrors_conversation ON asyncexec.AsyncExecErrors (conversation_handle);
GO
