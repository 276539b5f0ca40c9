-- The calls that wait for a time, in the order they fall due: next_due() and release_due() run
-- on every wake of every process, and read them here rather than every WAITING row (held batch
-- members included) through executions_active.
create index executions_due on asyncproc.executions (run_at) where status = 'WAITING' and not held;
