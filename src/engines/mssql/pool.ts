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
  close(): void;
  /**
   * tedious's record of the session's transaction: one descriptor while none is open, one more
   * from the server's ENVCHANGE "begin transaction" until its "commit" or "rollback".
   */
  transactionDescriptors?: unknown[];
}

const release = (sql.ConnectionPool.prototype as unknown as { release(this: sql.ConnectionPool, connection: PooledConnection): unknown }).release;

/**
 * The engine's pool of SQL Server connections: a connection is handed out again only when no
 * transaction is open on it.
 *
 * A request the driver cuts (its requestTimeout sends an attention) stops where it is; an
 * attention is no error a CATCH sees (TRY...CATCH: not caught are "attentions, such as
 * client-interrupt requests"). Inside a procedure that runs with XACT_ABORT OFF (those that roll
 * back to a savepoint after a failed SEND: Recover, Cancel, CancelBatch, SettleCancel, the
 * listener's procedures) the transaction it had begun then stays open with its locks and its
 * application lock: "When a transaction is not completed either because a query times out or
 * because the batch is cancelled … the transaction is left open and all the locks … continue to
 * be held. Subsequent transactions executed under the same connection are treated as nested
 * transactions" (Microsoft KB 295108); XACT_ABORT ON would have rolled it back. Reused, such a
 * connection would have run the next request inside that transaction, and an invoke's COMMIT
 * there would have committed nothing. It is closed instead, which rolls the transaction back
 * ("any outstanding transactions for the connection are rolled back" when it breaks,
 * Controlling Transactions): at once when the request gives it back and tedious heard the
 * transaction begin and never end (release), and in any case before it is handed out again,
 * when mssql checks it (validateConnection, on by default, asks `SELECT 1`; this check asks
 * `@@TRANCOUNT`, in the same round trip).
 */
export class ConnectionPool extends sql.ConnectionPool {
  constructor(
    config: sql.config,
    /** Told of each connection closed because a transaction was left open on it. */
    private readonly onTransactionLeftOpen?: () => void,
  ) {
    super(config);
  }

  /** mssql's return of a connection a request is done with (base/connection-pool.js; Request calls it on its parent). */
  release(connection: PooledConnection): this {
    if (connection && !connection.closed && (connection.transactionDescriptors?.length ?? 1) > 1) {
      this.onTransactionLeftOpen?.();
      connection.close();
    }
    release.call(this, connection);
    return this;
  }

  /** mssql's check of a connection it is about to hand out (its `validate` for the pool of connections, see base/connection-pool.js). */
  _poolValidate(connection: PooledConnection | undefined): boolean | Promise<boolean> {
    if (!connection || connection.closed || connection.hasError) return false;
    return new Promise((resolve) => {
      let open = NaN;
      const request = new tedious.Request('SELECT @@TRANCOUNT AS open_transactions;', (error) => {
        if (!error && open > 0) this.onTransactionLeftOpen?.();
        resolve(!error && open === 0);
      });
      request.on('row', (columns) => (open = Number(columns[0]?.value)));
      connection.execSql(request);
    });
  }
}
