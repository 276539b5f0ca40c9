import type { Closeable } from '../engine.js';

/** What an engine has started (listeners, activators), so engine.close() stops whatever is still open. */
export class Closeables {
  private readonly open = new Set<Closeable>();

  /** Remember `closeable` until it is closed; `onClose` runs when it is. */
  track<T extends Closeable>(closeable: T, onClose?: () => void): T {
    this.open.add(closeable);
    const close = closeable.close.bind(closeable);
    closeable.close = async () => {
      this.open.delete(closeable);
      onClose?.();
      await close();
    };
    return closeable;
  }

  closeAll(): Promise<void> {
    return Promise.all([...this.open].map((c) => c.close())).then(() => undefined);
  }
}
