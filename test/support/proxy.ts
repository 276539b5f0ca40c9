import { createServer, connect, type Server, type Socket } from 'node:net';

/**
 * A TCP proxy in front of a database (or the service), for network faults: `blackhole()` keeps
 * every connection open but lets no byte through either way (a half-open link, as after a
 * network cut), until `restore()`; `cut()` resets every connection and refuses new ones until
 * `restore()` (a dropped link that stays down a while).
 */
export interface Proxy {
  port: number;
  blackhole(): void;
  /** Close every connection (as a restarted load balancer does) and refuse new ones, until `restore()`. */
  cut(): void;
  restore(): void;
  close(): Promise<void>;
}

export async function startProxy(targetPort: number, targetHost = '127.0.0.1'): Promise<Proxy> {
  let dark = false;
  let down = false;
  const sockets = new Set<Socket>();
  const server: Server = createServer((client) => {
    if (down) return void client.resetAndDestroy();
    const upstream = connect(targetPort, targetHost);
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on('close', () => sockets.delete(socket));
      socket.on('error', () => undefined);
    }
    client.on('data', (data) => void (dark || upstream.write(data)));
    upstream.on('data', (data) => void (dark || client.write(data)));
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    port: (server.address() as { port: number }).port,
    blackhole: () => void (dark = true),
    cut: () => {
      down = true;
      for (const socket of sockets) socket.resetAndDestroy();
    },
    restore: () => void (dark = down = false),
    close: async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}
