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

export function createLoaders(engine: Engine): Loaders {
  return {
    history: new DataLoader(async (ids) => {
      const found = await engine.getHistory(ids);
      return ids.map((id) => found.get(id) ?? []);
    }),
    // no engine reads several batches at once; the loader still reads each one once per request
    batch: new DataLoader((ids) => Promise.all(ids.map((id) => engine.getBatch(id)))),
    progress: new DataLoader(async (ids) => {
      const found = (await engine.getProgress?.(ids)) ?? new Map<string, ExecutionProgress>();
      return ids.map((id) => found.get(id) ?? null);
    }),
  };
}
