import { useEffect, useState } from 'preact/hooks';

/** One value that views watch: set it and every view using it renders again. */
export class Store<T> {
  private readonly watchers = new Set<(value: T) => void>();
  constructor(private value: T) {}
  get(): T {
    return this.value;
  }
  set(value: T) {
    if (Object.is(value, this.value)) return;
    this.value = value;
    for (const watcher of [...this.watchers]) watcher(value);
  }
  watch(watcher: (value: T) => void): () => void {
    this.watchers.add(watcher);
    return () => this.watchers.delete(watcher);
  }
}

export function useStore<T>(store: Store<T>): T {
  const [value, setValue] = useState(store.get());
  useEffect(() => {
    setValue(store.get());
    return store.watch(setValue);
  }, [store]);
  return value;
}
