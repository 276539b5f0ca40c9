import WebSocket from 'ws';
import type { Logger } from '../logger.js';

/**
 * The socket class for the WebSocket server: a client's protocol error (a message over `maxPayload`, bad
 * UTF-8, a bad frame) has already closed its socket with the right code (1009, 1007, 1002) when `ws` emits it;
 * it is logged here as one line, not handed to graphql-ws, which prints it with a stack as an internal error.
 */
export function socketClass(logger: Logger): typeof WebSocket {
  return class ClientSocket extends WebSocket {
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
