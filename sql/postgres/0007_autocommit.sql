-- Calls that run with no transaction open (asyncproc.register(..., transactional => false)):
-- a procedure that COMMITs inside, commits in chunks, or cannot run in a transaction block.
-- procedures.transactional: the mode chosen at registration (true: the call's effects and its
-- outcome commit together, as before).
-- executions.transactional: the mode the call's latest attempt was claimed with, copied by the
-- claim, so recover() judges a lost run by how it ran, not by a registration changed since.
alter table asyncproc.procedures add column transactional boolean not null default true;
alter table asyncproc.executions add column transactional boolean not null default true;
