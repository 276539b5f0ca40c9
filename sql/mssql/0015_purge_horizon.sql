-- The purge horizon, as sql/postgres/0015_purge_horizon.sql: the newest rowversion of any call
-- retention deleted (usp_AsyncExecPurge raises it in the transaction that deletes). A
-- subscriber resuming from a cursor whose position is not past it may have missed a change of
-- a call that is gone since: it is refused with CURSOR_EXPIRED, never resumed with a silent gap.
-- One row, seeded with the database's last rowversion (@@DBTS): a database upgraded to this
-- may have been purged before, without a horizon kept; a cursor given before the upgrade is
-- refused once, one given after starts at MIN_ACTIVE_ROWVERSION(), above it. binary(8), not
-- rowversion: a rowversion column would take a new value at each update, and this row records
-- another table's values.
CREATE TABLE asyncexec.AsyncExecPurgeHorizon (
    only_row     bit        NOT NULL CONSTRAINT PK_AsyncExecPurgeHorizon PRIMARY KEY
                                     CONSTRAINT CK_AsyncExecPurgeHorizon_only CHECK (only_row = 1),
    row_version  binary(8)  NOT NULL
);
GO
INSERT asyncexec.AsyncExecPurgeHorizon (only_row, row_version) VALUES (1, CONVERT(binary(8), @@DBTS));
GO
