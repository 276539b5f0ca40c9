import DataLoader from 'dataloader';
import type { Attempt, Batch, Engine, ExecutionProgress } from '../engine.js';

/**
 * Reads a query would make once per row, made once per request instead:
 * `Execution.history` for every execution of a page in one query, and each
 * batch read once however many of its executions ask for it.
 */
export interface Loaders {
  history: DataLoader<string, Attempt[]>;
  batch: DataLoader<string, Batch | null>;
  /** `Execution.progress` of every execution of a page in one query. */
  progress: DataLoader<string, ExecutionProgress | null>;
}

/**
 * The loaders, each made on first use: a graphql-ws subscription keeps its context for its whole
 * life, and most never resolve a field that loads (three DataLoaders are ~2.8 KB a subscriber).
 */
class LazyLoaders implements Loaders {
  #history?: Loaders['history'];
  #batch?: Loaders['batch'];
  #progress?: Loaders['progress'];
  constructor(private readonly engine: Engine) {}

  get history(): Loaders['history'] {
    return (this.#history ??= new DataLoader(async (ids) => {
      const found = await this.engine.getHistory(ids);
      return ids.map((id) => found.get(id) ?? []);
    }));
  }

  get batch(): Loaders['batch'] {
    // no engine reads several batches at once; the loader still reads each one once per request
    return (this.#batch ??= new DataLoader((ids) => Promise.all(ids.map((id) => this.engine.getBatch(id)))));
  }

  get progress(): Loaders['progress'] {
    return (this.#progress ??= new DataLoader(async (ids) => {
      const found = (await this.engine.getProgress?.(ids)) ?? new Map<string, ExecutionProgress>();
      return ids.map((id) => found.get(id) ?? null);
    }));
  }
}

export function createLoaders(engine: Engine): Loaders {
  return new LazyLoaders(engine);
}
