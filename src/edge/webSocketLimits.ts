import WebSocket from 'ws';
import type { Logger } from '../logger.js';

/** How long a socket the service closes waits for its peer's answer to the close (see ClientSocket.close). */
export const CLOSE_HANDSHAKE_MS = 2_000;

/**
 * The socket class for the WebSocket server: a client's protocol error (a message over `maxPayload`, bad
 * UTF-8, a bad frame) has already closed its socket with the right code (1009, 1007, 1002) when `ws` emits it;
 * it is logged here as one line, not handed to graphql-ws, which prints it with a stack as an internal error.
 */
export function socketClass(logger: Logger): typeof WebSocket {
  return class ClientSocket extends WebSocket {
    /**
     * A socket the service closes (4408 for one that never sent connection_init, 4403 for lapsed
     * credentials, 4429, 1009) is ended CLOSE_HANDSHAKE_MS later if its peer has not answered the
     * close by then: `ws` waits 30 s for the answer, and a peer that never answers kept the TCP
     * connection, and its memory, that long (3,000 such sockets held about 50 MB).
     */
    override close(code?: number, data?: string | Buffer): void {
      super.close(code, data);
      if (this.readyState === this.CLOSED) return;
      setTimeout(() => {
        if (this.readyState !== this.CLOSED) this.terminate();
      }, CLOSE_HANDSHAKE_MS).unref();
    }

    override emit(event: string | symbol, ...args: unknown[]): boolean {
      const code = event === 'error' ? (args[0] as { code?: unknown } | undefined)?.code : undefined;
      if (typeof code === 'string' && code.startsWith('WS_ERR_')) {
        logger.info({ code, reason: (args[0] as Error).message }, 'WebSocket closed: the client broke the protocol or a limit');
        return true;
      }
      return super.emit(event, ...args);
    }
  };
}
