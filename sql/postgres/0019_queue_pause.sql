-- A paused queue takes calls but starts none (asyncproc.pause_queue, take_ready): calls that
-- run when it is paused end as they would; the rest wait, PENDING, for its resume.
alter table asyncproc.queues add column paused boolean not null default false;
