-- The SQL ceiling, part 2 ("bare archive"): move the batch to the archive, the durable
-- work jobd's complete does.
WITH finished AS (
    DELETE FROM jobd.jobs WHERE id = ANY (CAST(:ids AS bigint[])) RETURNING *
)
INSERT INTO jobd.jobs_archive (id, lane, handler, payload, state, priority, run_at, attempts,
                               max_attempts, claimed_by, idempotency_key, created_at,
                               last_error, errors, finished_at)
SELECT id, lane, handler, payload, 'done', priority, run_at, attempts, max_attempts,
       claimed_by, idempotency_key, created_at, last_error, errors, now()
  FROM finished;
