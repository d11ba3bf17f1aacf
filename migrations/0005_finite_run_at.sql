-- A job's run_at must be a real moment. 'infinity' and '-infinity' are valid timestamptz
-- values that no client can load into a date-time type, so such a job would be claimed and
-- then never reach a handler (and 'infinity' would never be due at all). jobd's own enqueue
-- paths cannot produce them; this keeps hand-written SQL and jobd.enqueue(run_at => ...)
-- from doing so either. The hot table holds live jobs only, so validating is quick.
ALTER TABLE jobs ADD CONSTRAINT jobs_run_at_finite CHECK (isfinite(run_at)) NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_run_at_finite;
