import { createRequire } from 'node:module';
import sql from 'mssql';

/** tedious as mssql loads it: its Request runs a statement on one of mssql's own connections. */
const tedious = createRequire(createRequire(import.meta.url).resolve('mssql'))('tedious') as {
  Request: new (text: string, callback: (error: Error | null | undefined) => void) => { on(event: 'row', listener: (columns: { value: unknown }[]) => void): void };
};

/** What the pool sees of a tedious connection (mssql's own flags, and the one call the check makes). */
interface PooledConnection {
  closed?: boolean;
  hasError?: boolean;
  execSql(request: unknown): void;
}

/**
 * The engine's pool of SQL Server connections: a connection is handed out again only when no
 * transaction is open on it.
 *
 * mssql checks a connection each time it hands it out (validateConnection, on by default, with
 * `SELECT 1`); this check asks `@@TRANCOUNT` instead, in that same round trip. A request the
 * driver cuts (its requestTimeout sends an attention) stops where it is, and an attention is no
 * error a CATCH sees. Inside a procedure that runs with XACT_ABORT OFF (those that roll back to a
 * savepoint after a failed SEND: Recover, Cancel, CancelBatch, SettleCancel, the listener's
 * procedures) the transaction it had begun then stays open with its locks and its application
 * lock (SET XACT_ABORT: with OFF, "in some cases only the Transact-SQL statement that raised the
 * error is rolled back and the transaction continues processing"; only ON rolls it back at the
 * attention). Such a connection is closed instead of reused, and closing it rolls the
 * transaction back; reused, the next request would have run inside that transaction, and an
 * invoke's COMMIT there would have committed nothing.
 */
export class ConnectionPool extends sql.ConnectionPool {
  constructor(
    config: sql.config,
    /** Told of each connection closed because a transaction was left open on it. */
    private readonly onTransactionLeftOpen?: () => void,
  ) {
    super(config);
  }

  /** mssql's check of a connection it is about to hand out (its `validate` for the pool of connections, see base/connection-pool.js). */
  _poolValidate(connection: PooledConnection | undefined): boolean | Promise<boolean> {
    if (!connection || connection.closed || connection.hasError) return false;
    return new Promise((resolve) => {
      let open = 0;
      const request = new tedious.Request('SELECT @@TRANCOUNT;', (error) => {
        if (!error && open > 0) this.onTransactionLeftOpen?.();
        resolve(!error && open === 0);
      });
      request.on('row', (columns) => (open = Number(columns[0]?.value)));
      connection.execSql(request);
    });
  }
}
