-- The whole current schema of jobd, as the migrations leave it, in one file for reading.
--
-- The migrations (migrations/NNNN_*.sql) are deltas: each changes what the ones before it
-- built, and an applied one is never edited (`jobd migrate` refuses a changed checksum). So
-- the current body of a function or the current set of a table's constraints can be spread
-- over several files. This file states the result once: the tables with every column and
-- constraint, the indexes, the view, the sequences, the triggers, the current body of every
-- function, and the rows a migration writes. `jobd migrate` builds databases from the
-- migrations, never from this file; tests/test_schema_file.py applies both to fresh schemas
-- and requires them identical, so a migration that changes the schema changes this file too.
--
-- Names are unqualified, as in the migrations: whoever applies the file sets search_path to
-- the target schema (jobd unless overridden), and functions capture that schema with
-- SET search_path FROM CURRENT. Statements are in dependency order, grouped by subject.


-- ===========================================================================================
-- Live jobs
-- ===========================================================================================

-- Job ids. A job keeps its id when it moves on to jobs_archive or dead_letter, and an
-- idempotency key (job_keys), an outbox entry or a schedule's fire reserves the id before the
-- job's row exists: so a sequence of its own rather than an identity column.
CREATE SEQUENCE job_id_seq AS bigint;

-- The lease tokens of the previous release's claims, kept for its daemons during a rolling
-- upgrade (migration 0032): this release's claims draw new_lease_token().
CREATE SEQUENCE lease_token_seq AS bigint;

-- Every claim draws one token; a worker must present it for every later write to the job
-- (heartbeat, complete, fail), so a worker whose lease was lost cannot touch the job again.
-- Random (63 bits of the server's strong random source, four of them the uuid's fixed
-- version bits), not a sequence: claims commit without waiting for their flush, and a crash
-- of the server could undo a claim together with a sequence's last steps, so that the job's
-- next claim drew the same token and the undone claim's worker passed the fence
-- (migration 0032).
CREATE FUNCTION new_lease_token() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT ('x' || substr(replace(gen_random_uuid()::text, '-', ''), 1, 16))::bit(64)::bigint
           & 9223372036854775807
$$;

-- Live jobs only: pending, claimed, or failed and waiting for a retry. Finished jobs leave this
-- table in the statement that finishes them, so it stays as small as the backlog.
CREATE TABLE jobs (
    id              bigint      PRIMARY KEY DEFAULT nextval('job_id_seq'),
    lane            text        NOT NULL DEFAULT 'default',
    handler         text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}',
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'claimed', 'failed')),
    priority        integer     NOT NULL DEFAULT 0,
    -- A real moment every reader can load (Python's datetime ends at year 9999); see
    -- jobs_run_at_range below.
    run_at          timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- NULL: the lane's configured max_attempts applies.
    max_attempts    integer     CHECK (max_attempts > 0),
    lease_until     timestamptz,
    claimed_by      text,
    lease_token     bigint,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    -- One object per failed attempt: {"attempt", "at", "error", "worker"}.
    errors          jsonb       NOT NULL DEFAULT '[]',
    -- Poison isolation. When a worker process dies while it runs several jobs, nothing says
    -- which one killed it. Its jobs become suspects: their attempt is given back, and each
    -- runs alone on a worker that holds nothing else. A worker that dies holding a single job
    -- has found the poison: that job alone spends an attempt (and stays a suspect, so its
    -- retries run alone). This and the columns below come last because they were added
    -- last: column order is part of the schema (SELECT * and RETURNING * depend on it).
    suspect         boolean     NOT NULL DEFAULT false,
    -- When the latest attempt was claimed (set by the claim, carried into jobs_archive):
    -- with run_at and finished_at it gives pickup delay and claim-to-finish time (jobd top).
    -- NULL for jobs claimed before migration 0010.
    claimed_at      timestamptz,
    -- Set on a claimed job asked to stop (cancel()): the heartbeat tells its worker, and the
    -- statements that finish it archive it as 'cancelled' however its run ends.
    cancel_requested_at timestamptz,
    -- Set at enqueue (a tenant, a customer): the job's share key in a fair lane (fair_by),
    -- in place of its handler. NULL: it shares by its handler. Never '' (the constraint
    -- jobs_fairness_key_not_empty below).
    fairness_key    text,
    -- A claimed job has a lease and a token; no other state has either.
    CHECK ((state = 'claimed') = (lease_until IS NOT NULL AND lease_token IS NOT NULL)),
    -- 'infinity' and '-infinity' are valid timestamptz values that no client can load into a
    -- date-time type, so such a job would be claimed and then never reach a handler; a year
    -- past 9999 broke every listing. jobd.enqueue refuses these with a message (check_job);
    -- this keeps hand-written SQL from storing them.
    CONSTRAINT jobs_run_at_range
        CHECK (run_at >= '1970-01-01 00:00:00+00' AND run_at < '9999-01-01 00:00:00+00')
);
ALTER SEQUENCE job_id_seq OWNED BY jobs.id;

-- A job's fairness key is not the empty string: a fair claim lists the share keys after ''
-- (claim_level), so a job of the key '' was never claimed in a fair lane. jobd.enqueue
-- refuses it with a message (check_job); this keeps a caller's own INSERT or COPY from
-- storing it. The entry points' 256-byte bound on the key is theirs alone (migration 0049).
-- NOT VALID because migration 0049 added it without reading every live job under its lock
-- (it gave the rows stored with '' before a NULL key instead); every row written since is
-- checked, and `ALTER TABLE jobs VALIDATE CONSTRAINT jobs_fairness_key_not_empty` validates
-- the others without blocking the queue.
ALTER TABLE jobs ADD CONSTRAINT jobs_fairness_key_not_empty
    CHECK (fairness_key <> '') NOT VALID;

-- The hottest query: due jobs of one lane by priority, then run_at (then id, so a claim's
-- floor can sit between jobs that share a run_at). Only claimable rows are indexed, so the
-- index is as small as the backlog however much history exists.
CREATE INDEX jobs_claimable_idx ON jobs (lane, priority DESC, run_at, id)
    WHERE state IN ('pending', 'failed');

-- The fair claim's index: a lane's claimable jobs by priority, then share key, then age, so
-- the claim steps from one key to the next (a skip scan written as a loop, claim_order) and
-- takes each key's oldest jobs without walking past another key's herd.
-- The key compares in code point order (COLLATE "C"): cheaper than a language's rules, and
-- the order the workers' cursors (jobd/claimer.py) assume.
-- The key's IS NOT NULL holds for every row (handler is NOT NULL); it keeps every query but
-- the fair ones, whose comparisons on the key imply it, off this index: from here a claim's
-- floor would bound nothing (migration 0025).
CREATE INDEX jobs_fair_idx ON jobs (lane, priority DESC,
                                    (coalesce(fairness_key, handler) COLLATE "C"), run_at, id)
    WHERE state IN ('pending', 'failed')
      AND (coalesce(fairness_key, handler) COLLATE "C") IS NOT NULL;

-- Every (lane, priority) that has had claimable jobs: the claim reads a lane's priorities
-- here instead of discovering them by walking the index (where a held xmin horizon keeps
-- the dead entries of every claimed job). Added by enqueue and the insert trigger, removed
-- by the retention duty (forget_unused_priorities).
CREATE TABLE lane_priorities (
    lane     text    NOT NULL,
    priority integer NOT NULL,
    PRIMARY KEY (lane, priority)
);

-- Pairs an enqueue needed while another transaction was inserting them into lane_priorities
-- (it held the pair's lock: enqueue, notify_new_jobs). The enqueue does not wait for that
-- one, which may still roll back; the lane poll merges these rows into lane_priorities
-- (merge_wanted_priorities), and the retention duty keeps a pair still wanted (migration
-- 0046). No unique constraint: a unique row would make a second writer wait for the first.
-- Logged: the job whose pair it keeps is durable.
CREATE TABLE lane_priorities_wanted (
    lane     text    NOT NULL,
    priority integer NOT NULL
);
CREATE INDEX lane_priorities_wanted_idx ON lane_priorities_wanted (lane, priority);

-- The lease-expiry sweep and crash attribution read only claimed rows.
CREATE INDEX jobs_lease_idx ON jobs (lease_until) WHERE state = 'claimed';

-- Suspects are rare; a lane's suspects, due or claimed, are found without touching the claim
-- index.
CREATE INDEX jobs_suspect_idx ON jobs (lane, run_at) WHERE suspect;

-- Failed jobs waiting for their retry, per lane, for the queue-depth metrics: the claim index
-- holds pending and failed rows alike and has no state column.
CREATE INDEX jobs_retrying_idx ON jobs (lane, run_at) WHERE state = 'failed';

-- A queue table churns: every job is inserted, updated and deleted within seconds. Vacuum it
-- early and without throttling so dead index entries don't slow the claim scan.
ALTER TABLE jobs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);


-- ===========================================================================================
-- Finished jobs: the archive, the dead-letter queue, idempotency keys
-- ===========================================================================================

-- Finished jobs, partitioned by day of finished_at: retention drops a partition.
-- ensure_archive_partitions() creates the daily partitions; `jobd migrate` calls it on every
-- run, so they are not part of the schema itself.
CREATE TABLE jobs_archive (
    id              bigint      NOT NULL,
    lane            text        NOT NULL,
    handler         text        NOT NULL,
    payload         jsonb       NOT NULL,
    state           text        NOT NULL,
    priority        integer     NOT NULL,
    run_at          timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    max_attempts    integer,
    claimed_by      text,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    last_error      text,
    errors          jsonb       NOT NULL,
    finished_at     timestamptz NOT NULL,
    claimed_at      timestamptz,
    fairness_key    text
) PARTITION BY RANGE (finished_at);

CREATE INDEX jobs_archive_id_idx ON jobs_archive (id);

-- A lane's recently finished jobs, newest first (jobd top's latency figures): a short range
-- scan in the partitions a recent window touches. Jobs completed in one batch share
-- finished_at, so B-tree deduplication keeps the entries small.
CREATE INDEX jobs_archive_lane_finished_idx ON jobs_archive (lane, finished_at);

-- Catches rows whose day has no partition yet, so finishing a job can never fail for lack of
-- one. ensure_archive_partitions() moves such rows into the real partition when it creates it.
CREATE TABLE jobs_archive_default PARTITION OF jobs_archive DEFAULT;

-- Finished jobs are done or cancelled. NOT VALID because migration 0011 widened the check
-- without scanning the archive (every row was 'done' then) while completions waited for its
-- lock; new rows and new partitions are checked. `ALTER TABLE jobs_archive VALIDATE
-- CONSTRAINT jobs_archive_state_check` validates the old rows without blocking completions.
ALTER TABLE jobs_archive ADD CONSTRAINT jobs_archive_state_check
    CHECK (state IN ('done', 'cancelled')) NOT VALID;

-- The dead-letter queue: one row per job whose attempt budget is spent, with its full history.
CREATE TABLE dead_letter (
    id              bigint      PRIMARY KEY,
    lane            text        NOT NULL,
    handler         text        NOT NULL,
    payload         jsonb       NOT NULL,
    priority        integer     NOT NULL,
    run_at          timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    max_attempts    integer,
    claimed_by      text,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    last_error      text,
    errors          jsonb       NOT NULL,
    died_at         timestamptz NOT NULL DEFAULT now(),
    fairness_key    text
);
CREATE INDEX dead_letter_died_at_idx ON dead_letter (died_at);
CREATE INDEX dead_letter_lane_idx ON dead_letter (lane);

-- Idempotency keys outlive the job's row in jobs: a key maps to its job wherever the job is
-- now (live, archived or dead), so enqueueing the same key again returns the first job.
CREATE TABLE job_keys (
    idempotency_key text        PRIMARY KEY,
    job_id          bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- The retention pass's sweep of expired keys walks them in this order (prune_job_keys).
CREATE INDEX job_keys_created_at_idx ON job_keys (created_at, idempotency_key);

-- Where the retention pass's sweep of expired keys stands: the last key it examined, NULL at
-- the head. Kept here so that a sweep goes on where the previous batch, pass, node or
-- process stopped instead of walking again past the keys it must keep (migration 0045).
CREATE TABLE key_sweep (
    only_row        boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    created_at      timestamptz,
    idempotency_key text
);
INSERT INTO key_sweep DEFAULT VALUES;

-- Every job, live or finished, with its state.
CREATE VIEW all_jobs AS
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           lease_until, claimed_by, idempotency_key, created_at, last_error, errors,
           NULL::timestamptz AS finished_at, cancel_requested_at, fairness_key
      FROM jobs
    UNION ALL
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           finished_at, NULL::timestamptz, fairness_key
      FROM jobs_archive
    UNION ALL
    SELECT id, lane, handler, payload, 'dead', priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           died_at, NULL::timestamptz, fairness_key
      FROM dead_letter;


-- ===========================================================================================
-- Lane controls: pauses, cancelling jobs, quarantine, limits across nodes
-- ===========================================================================================

-- One row per paused lane (handler NULL) or paused handler of a lane. State in the database,
-- so a pause holds on every node and across restarts. The claim reads it on every call: it
-- stays a handful of rows.
CREATE TABLE lane_pauses (
    lane      text        NOT NULL,
    handler   text,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text        NOT NULL DEFAULT session_user
);
-- At most one pause per lane and handler, the lane's own (handler NULL) included.
CREATE UNIQUE INDEX lane_pauses_lane_handler_idx ON lane_pauses (lane, coalesce(handler, ''));

-- The name rule of check_job for the controls' arguments: raises invalid_parameter_value
-- (22023) naming the function and the argument. NULL passes (an optional handler).
CREATE FUNCTION check_name(caller text, what text, value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    name_chars constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]*$';
BEGIN
    IF check_name.value IS NOT NULL AND (check_name.value !~ name_chars
                                         OR octet_length(check_name.value) > 128) THEN
        RAISE EXCEPTION '%: invalid % name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            check_name.caller, check_name.what, quote_literal(check_name.value)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Whether a job of this handler may be claimed, given the lane's paused handlers. A plpgsql
-- function, opaque to the planner, on purpose: written inline in the claim, `handler <> ALL
-- (paused)` with the array unknown at planning made the planner estimate from the handler
-- column's statistics that no row of a one-handler lane passes, and it replaced the ordered
-- index scan that stops after `limit` rows by a bitmap scan and sort of every due job of the
-- lane (0.8 ms became 6 ms at 15,000 due jobs). Opaque, it gets a default estimate.
CREATE FUNCTION runnable(handler text, paused_handlers text[]) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN cardinality(paused_handlers) = 0 OR handler <> ALL (paused_handlers);
END
$$;

-- Pauses a lane (handler NULL) or one handler of it: from the commit on, no claim on any node
-- takes its jobs; running jobs finish. The notification 'lane!pause' tells every
-- supervisor's workers of the lane to look at the lane's pauses again (to stop claiming, or
-- give back the jobs they claimed ahead). Returns false if it was paused already.
CREATE FUNCTION pause(lane text, handler text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    IF pause.lane IS NULL THEN
        RAISE EXCEPTION 'jobd.pause: lane must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM check_name('jobd.pause', 'lane', pause.lane);
    PERFORM check_name('jobd.pause', 'handler', pause.handler);
    INSERT INTO lane_pauses AS p (lane, handler) VALUES (pause.lane, pause.handler)
        ON CONFLICT (lane, (coalesce(handler, ''))) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify(current_schema() || '_wakeup', pause.lane || '!pause');
    RETURN true;
END
$$;

-- Ends a pause made by pause() with the same arguments: resume(lane) ends the lane's own
-- pause, resume(lane, handler) that handler's; the other pauses of the lane stay. The lane's
-- workers are told to look again and claim. Returns false if there was no such pause.
CREATE FUNCTION resume(lane text, handler text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF resume.lane IS NULL THEN
        RAISE EXCEPTION 'jobd.resume: lane must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM check_name('jobd.resume', 'lane', resume.lane);
    PERFORM check_name('jobd.resume', 'handler', resume.handler);
    DELETE FROM lane_pauses AS p
     WHERE p.lane = resume.lane AND p.handler IS NOT DISTINCT FROM resume.handler;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_notify(current_schema() || '_wakeup', resume.lane || '!pause');
    RETURN true;
END
$$;

-- Cancels jobs by id. For each distinct id, what happened ('cancelled': it was pending or
-- failed and is archived as cancelled now; 'requested': it is running and was asked to stop;
-- 'finished': it had finished already and nothing changed; 'unknown': no such job) and its
-- state afterwards. The lanes of running jobs are notified ('lane!cancel'), so their workers
-- renew their leases at once and learn it.
CREATE FUNCTION cancel(ids bigint[])
RETURNS TABLE (id bigint, outcome text, state text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    stopped bigint[];
    asked bigint[];
    lanes text[];
BEGIN
    -- Lock the live rows first, in id order, so two cancels never deadlock: a claim passes
    -- them meanwhile (SKIP LOCKED), a worker's write of an outcome waits for this commit.
    PERFORM 1 FROM jobs AS j WHERE j.id = ANY(cancel.ids) ORDER BY j.id FOR UPDATE;
    WITH gone AS (
        DELETE FROM jobs AS j
         WHERE j.id = ANY(cancel.ids) AND j.state IN ('pending', 'failed')
        RETURNING j.*
    ),
    archived AS (
        INSERT INTO jobs_archive AS a (id, lane, handler, payload, state, priority, run_at,
                                       attempts, max_attempts, claimed_by, idempotency_key,
                                       created_at, last_error, errors, finished_at,
                                       claimed_at, fairness_key)
        SELECT g.id, g.lane, g.handler, g.payload, 'cancelled', g.priority, g.run_at,
               g.attempts, g.max_attempts, g.claimed_by, g.idempotency_key, g.created_at,
               g.last_error, g.errors || jsonb_build_object('cancelled_at', now()), now(),
               g.claimed_at, g.fairness_key
          FROM gone AS g
        RETURNING a.id
    )
    SELECT coalesce(array_agg(archived.id), '{}') INTO stopped FROM archived;
    -- A delivery job cancelled before it delivered: its entry will not be delivered.
    UPDATE outbox AS o SET state = 'dead', last_error = 'cancelled before delivery'
     WHERE o.delivery_job_id = ANY(stopped) AND o.state = 'pending';
    WITH requested AS (
        UPDATE jobs AS j SET cancel_requested_at = coalesce(j.cancel_requested_at, now())
         WHERE j.id = ANY(cancel.ids) AND j.state = 'claimed'
        RETURNING j.id, j.lane
    )
    SELECT coalesce(array_agg(r.id), '{}'), coalesce(array_agg(DISTINCT r.lane), '{}')
      INTO asked, lanes FROM requested AS r;
    PERFORM pg_notify(current_schema() || '_wakeup', l.lane || '!cancel')
       FROM unnest(lanes) AS l(lane);
    RETURN QUERY
    SELECT i.id,
           CASE WHEN i.id = ANY(stopped) THEN 'cancelled'
                WHEN i.id = ANY(asked) THEN 'requested'
                WHEN now_state.state IS NULL THEN 'unknown'
                ELSE 'finished' END,
           CASE WHEN i.id = ANY(stopped) THEN 'cancelled'
                WHEN i.id = ANY(asked) THEN 'claimed'
                ELSE now_state.state END
      FROM (SELECT DISTINCT u.id FROM unnest(cancel.ids) AS u(id) WHERE u.id IS NOT NULL) AS i
      LEFT JOIN LATERAL (
            SELECT a.state FROM jobs_archive AS a WHERE a.id = i.id
            UNION ALL
            SELECT 'dead' FROM dead_letter AS d WHERE d.id = i.id
            LIMIT 1) AS now_state ON true
     ORDER BY i.id;
END
$$;

-- Moves every pending or failed job of a handler (of one lane, or whose payload contains
-- payload_match, when given) to the dead-letter queue in one statement, with an error that
-- says so: for a poison payload that keeps arriving. Running jobs are left to finish (cancel
-- them by id). Returns the number moved per lane (lane_name, moved). Replay brings them back
-- (by id, or all of a handler's dead jobs), each due again at its own run_at.
CREATE FUNCTION quarantine(handler text, lane text DEFAULT NULL,
                                      payload_match jsonb DEFAULT NULL)
RETURNS TABLE (lane_name text, moved bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    reason text;
BEGIN
    IF quarantine.handler IS NULL THEN
        RAISE EXCEPTION 'jobd.quarantine: handler must not be NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM check_name('jobd.quarantine', 'handler', quarantine.handler);
    PERFORM check_name('jobd.quarantine', 'lane', quarantine.lane);
    reason := 'quarantined: the pending jobs of handler ' || quarantine.handler
              || coalesce(' in lane ' || quarantine.lane, '')
              || coalesce(' whose payload contains ' || quarantine.payload_match::text, '')
              || ' were moved to the dead-letter queue';
    RETURN QUERY
    WITH moved AS (
        DELETE FROM jobs AS j
         WHERE j.handler = quarantine.handler AND j.state IN ('pending', 'failed')
           AND (quarantine.lane IS NULL OR j.lane = quarantine.lane)
           AND (quarantine.payload_match IS NULL OR j.payload @> quarantine.payload_match)
        RETURNING j.*
    ),
    buried AS (
        INSERT INTO dead_letter AS d (id, lane, handler, payload, priority, run_at, attempts,
                                      max_attempts, claimed_by, idempotency_key, created_at,
                                      last_error, errors, died_at, fairness_key)
        SELECT m.id, m.lane, m.handler, m.payload, m.priority, m.run_at, m.attempts,
               m.max_attempts, m.claimed_by, m.idempotency_key, m.created_at, reason,
               m.errors || jsonb_build_object('quarantined_at', now(), 'reason', reason),
               now(), m.fairness_key
          FROM moved AS m
        RETURNING d.lane
    )
    SELECT b.lane, count(*) FROM buried AS b GROUP BY b.lane ORDER BY b.lane;
END
$$;

-- The token bucket of each lane with a rate (claim_jobs_limited), updated by every claim of
-- the lane in turn. UNLOGGED: the row changes on every claim and writes no WAL; after a
-- crash of the server the table is empty and each lane starts with a full bucket.
CREATE UNLOGGED TABLE lane_tokens (
    lane        text             PRIMARY KEY,
    tokens      double precision NOT NULL,
    refilled_at timestamptz      NOT NULL
);


-- ===========================================================================================
-- Enqueueing: the entry rules, the enqueue function, the wake-up notification
-- ===========================================================================================

-- Database-wide settings. max_payload_bytes: the largest payload, measured as JSON text.
-- `jobd migrate -c FILE` writes the config's limits.max_payload_bytes here; the row below is
-- the default (1 MiB) until it does.
CREATE TABLE settings (
    name  text  PRIMARY KEY,
    value jsonb NOT NULL
);
INSERT INTO settings (name, value) VALUES ('max_payload_bytes', '1048576');

-- The rules every job meets, whichever way it is enqueued (jobd/validation.py states the same
-- set for the Python API), so that a job one entry point accepts is never refused by another,
-- nor accepted and then undeliverable. Raises invalid_parameter_value (22023) naming the first
-- rule a job breaks. The payload size, which needs the settings table, is checked apart:
-- enqueue reads the limit in the statement that reads the lane's state, and
-- check_payload_size (below, the bulk path's check too) raises. name_chars and the 128-byte
-- bound are validation.NAME_CHARS and MAX_NAME_BYTES, the 'jobd:' prefix is
-- RESERVED_KEY_PREFIX in Python; a test checks that the two agree. (A bounded repetition,
-- {0,127}, states the same rule in one pattern, but its automaton made every match cost
-- microseconds: migration 0021.)
CREATE FUNCTION check_job(
    handler text, lane text, payload jsonb, run_at timestamptz, idempotency_key text,
    max_attempts integer, fairness_key text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql STABLE
-- No search_path of its own: enqueue, its one caller, pins one, and a function that sets
-- search_path costs each call a switch and a switch back (migration 0019).
AS $$
DECLARE
    name_chars constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]*$';
BEGIN
    IF check_job.handler IS NULL OR check_job.handler !~ name_chars
       OR octet_length(check_job.handler) > 128 THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid handler name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.handler), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The outbox's deliveries (validation.OUTBOX_HANDLER, and since migration 0043
    -- 'jobd.outbox:<sender>') come from outbox_add alone: a producer that could enqueue one
    -- would re-send an effect that died, or send one early.
    IF check_job.handler = 'jobd.outbox' OR starts_with(check_job.handler, 'jobd.outbox:') THEN
        RAISE EXCEPTION 'jobd.enqueue: handler % is reserved for jobd''s outbox deliveries (a transactional handler''s outbox_add creates them)',
            quote_literal(check_job.handler)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.lane IS NULL OR check_job.lane !~ name_chars
       OR octet_length(check_job.lane) > 128 THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid lane name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.lane), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.idempotency_key IS NOT NULL THEN
        IF check_job.idempotency_key = '' THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency_key must be a non-empty string'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(check_job.idempotency_key) > 512 THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency_key is % bytes; at most 512 are allowed',
                octet_length(check_job.idempotency_key)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- Keys starting with 'jobd:' name jobd's own jobs (schedule occurrences, outbox
        -- deliveries, keys derived from job ids); a caller's key must not collide with them.
        IF starts_with(check_job.idempotency_key, 'jobd:') THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency keys starting with ''jobd:'' are reserved for jobd''s own jobs'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    -- The key is part of an index entry: bounded well below B-tree's entry size limit.
    IF check_job.fairness_key IS NOT NULL THEN
        IF check_job.fairness_key = '' THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key must be a non-empty string'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(check_job.fairness_key) > 256 THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key is % bytes; at most 256 are allowed',
                octet_length(check_job.fairness_key)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    IF check_job.max_attempts IS NOT NULL AND check_job.max_attempts < 1 THEN
        RAISE EXCEPTION 'jobd.enqueue: max_attempts must be a positive integer, not %',
            check_job.max_attempts USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.run_at IS NOT NULL AND NOT (check_job.run_at >= '1970-01-01 00:00:00+00'
                                             AND check_job.run_at < '9999-01-01 00:00:00+00') THEN
        RAISE EXCEPTION 'jobd.enqueue: run_at % is out of range: it must be from 1970-01-01 to before 9999-01-01 (UTC)',
            check_job.run_at USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.payload IS NULL THEN
        RAISE EXCEPTION 'jobd.enqueue: payload must not be SQL NULL (a JSON null is ''null''::jsonb; leave it out for {})'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The limits are what the workers' decoder (Python's json) can read back as written:
    -- nesting below its recursion limit, integers below its 4300-digit limit, and a number
    -- with a fraction within a float's range (from 2**1024 - 2**970 on, Python reads it as
    -- infinity: migration 0041). One walk finds the numbers out of that range, which are
    -- rare; only then is each rule asked apart.
    IF jsonb_path_exists(check_job.payload, 'strict $.**{257}') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload is nested more than 256 levels deep'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_path_exists(check_job.payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 || @ <= -179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792))') THEN
        IF jsonb_path_exists(check_job.payload,
                             'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
            RAISE EXCEPTION 'jobd.enqueue: payload holds a number of 4300 digits or more'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_path_exists(check_job.payload,
                             'strict $.** ? (@.type() == "number" && (@ >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 || @ <= -179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792) && @.floor() != @)') THEN
            RAISE EXCEPTION 'jobd.enqueue: payload holds a number beyond a float''s range that is not a whole number (it would be read as infinity)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
END
$$;

-- The payload size limit alone, for the bulk path: the client measures its largest payload and
-- asks in the statement that reserves the batch's ids. enqueue calls it to raise the error
-- once its own read of the limit found the payload too large.
CREATE FUNCTION check_payload_size(size bigint) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    limit_bytes bigint := (SELECT value::bigint FROM settings WHERE name = 'max_payload_bytes');
BEGIN
    IF check_payload_size.size > limit_bytes THEN
        RAISE EXCEPTION 'jobd.enqueue: payload is % bytes, over the limit of % (max_payload_bytes)',
            check_payload_size.size, limit_bytes USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- One committed INSERT enqueues a job. With an idempotency key, the key ledger decides: the
-- first caller inserts the job, every later caller gets the first job's id back, even after
-- that job finished and was archived. It announces its job itself (the notifications of
-- notify_new_jobs, below), for a fraction of what the trigger cost a one-row statement.
CREATE FUNCTION enqueue(
    handler         text,
    payload         jsonb       DEFAULT '{}',
    lane            text        DEFAULT 'default',
    run_at          timestamptz DEFAULT now(),
    priority        integer     DEFAULT 0,
    idempotency_key text        DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL,
    fairness_key    text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    new_id      bigint;
    due_at      timestamptz := coalesce(enqueue.run_at, now());
    level       integer     := coalesce(enqueue.priority, 0);
    lane_state  record;
BEGIN
    PERFORM check_job(enqueue.handler, enqueue.lane, enqueue.payload, enqueue.run_at,
                      enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    -- The lane's shared wake-up lock, held until commit, before the one read below: as in
    -- notify_new_jobs, a worker arming meanwhile sees this enqueue as 'contended', and the
    -- read's snapshot sees every arming committed before the lock was granted; the retention
    -- duty cannot forget the job's priority under it. The key is wake_lock_key(lane), written
    -- out as in notify_new_jobs: calling a function that sets search_path costs (0019).
    PERFORM pg_advisory_xact_lock_shared(
        hashtextextended(current_schema() || '.' || enqueue.lane, 0));
    SELECT (SELECT s.value::bigint FROM settings AS s
             WHERE s.name = 'max_payload_bytes') AS max_payload_bytes,
           EXISTS (SELECT 1 FROM lane_priorities AS p
                    WHERE p.lane = enqueue.lane AND p.priority = level) AS priority_known,
           EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = enqueue.lane) AS waited
      INTO lane_state;
    IF octet_length(enqueue.payload::text) > lane_state.max_payload_bytes THEN
        PERFORM check_payload_size(octet_length(enqueue.payload::text));  -- raises
    END IF;
    IF enqueue.idempotency_key IS NOT NULL THEN
        INSERT INTO job_keys AS k (idempotency_key, job_id)
             VALUES (enqueue.idempotency_key, nextval('job_id_seq'))
        ON CONFLICT DO NOTHING
        RETURNING k.job_id INTO new_id;
        IF new_id IS NULL THEN
            -- A new statement takes a new snapshot, so a key committed by a concurrent
            -- enqueue (which ON CONFLICT waited for) is visible here.
            SELECT k.job_id INTO new_id FROM job_keys AS k
             WHERE k.idempotency_key = enqueue.idempotency_key;
            RETURN new_id;
        END IF;
    ELSE
        new_id := nextval('job_id_seq');
    END IF;
    -- The insert trigger steps aside for this one statement (jobs_notify_insert's WHEN); the
    -- setting is cleared again before anything else can insert.
    PERFORM set_config('jobd.enqueue_announces', 'on', true);
    INSERT INTO jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts,
                      fairness_key)
         VALUES (new_id, enqueue.lane, enqueue.handler, enqueue.payload, level, due_at,
                 enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    PERFORM set_config('jobd.enqueue_announces', '', true);
    -- Outside READ COMMITTED the transaction's snapshot may predate the retention duty's
    -- forgetting of the priority (forget_unused_priorities): seen in the snapshot, gone from
    -- the table, and every claim, arming and poll, which read the lane's priorities there,
    -- would never see the job. Recorded whatever the snapshot says, as the insert trigger does.
    -- Every writer of a pair holds the pair's lock until it ends, so with the lock the insert
    -- cannot wait for another's uncommitted row. Without it another transaction is inserting
    -- the pair: waiting for it stalled this producer as long as that one stayed open, and it
    -- may still roll back, so the pair is recorded as wanted for the lane poll to merge
    -- (merge_wanted_priorities). The key is the pair's, written out as the lane's above.
    IF NOT lane_state.priority_known
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        IF pg_try_advisory_xact_lock(
               hashtextextended(current_schema() || '.' || enqueue.lane || '#' || level, 0)) THEN
            INSERT INTO lane_priorities (lane, priority) VALUES (enqueue.lane, level)
                ON CONFLICT DO NOTHING;
        ELSE
            -- A wanted row already committed covers this job too (while a long transaction
            -- lists the pair, one row, not one per enqueue): the merge deletes it only in the
            -- transaction that lists the pair, and the retention duty cannot forget the pair
            -- under the lane's shared lock. Not outside READ COMMITTED, where the snapshot
            -- may show a row merged, and its pair forgotten, since.
            INSERT INTO lane_priorities_wanted (lane, priority)
            SELECT enqueue.lane, level
             WHERE current_setting('transaction_isolation') <> 'read committed'
                OR NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                                WHERE w.lane = enqueue.lane AND w.priority = level);
        END IF;
    END IF;
    -- The notifications notify_new_jobs sends for a statement of one job.
    IF due_at > now() THEN
        PERFORM pg_notify(current_schema() || '_wakeup',
                          enqueue.lane || '@' || extract(epoch FROM due_at)::text);
    ELSIF lane_state.waited
          OR current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pg_notify(current_schema() || '_wakeup', enqueue.lane || '#1');
        IF due_at < clock_timestamp() - interval '0.5 seconds' THEN
            PERFORM pg_notify(current_schema() || '_wakeup', enqueue.lane || '!behind');
        END IF;
    END IF;
    RETURN new_id;
END
$$;

-- Workers that wait for a wake-up. UNLOGGED: arming and disarming write no WAL, so they cost
-- no flush; after a crash of the server the table is empty and the workers, reconnecting,
-- claim before they arm again. A row of a worker that died stays until crash attribution
-- or the lease sweep removes it: until then it only costs a notification per enqueue.
CREATE UNLOGGED TABLE lane_waiters (
    worker_id text        PRIMARY KEY,
    lane      text        NOT NULL,
    armed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lane_waiters_lane_idx ON lane_waiters (lane);

-- The advisory lock key of a lane's wake-ups: the schema is part of it, so two jobd schemas
-- in one database do not share locks.
CREATE FUNCTION wake_lock_key(lane text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path FROM CURRENT
AS $$ SELECT hashtextextended(current_schema() || '.' || lane, 0) $$;

-- Wake the lanes that received work, once per lane and statement (a bulk insert of 20,000
-- rows sends one notification per lane, not 20,000), and only while a worker of the lane is
-- armed (lane_waiters): a NOTIFY takes a lock that serializes the commits of every notifying
-- transaction. The payload is 'lane#<n>' when n of the new jobs are due now (so the listener
-- wakes as many workers as that needs), and 'lane@<epoch seconds>' of the earliest job for
-- later, if any (always sent, beside due jobs too since 0047), so it can wake the lane at
-- that instant instead of polling for it. The
-- channel carries the schema name so several jobd schemas can share a database. jobd.enqueue
-- sends the same for its one job itself (the trigger's WHEN lets its insert by).
CREATE FUNCTION notify_new_jobs() RETURNS trigger LANGUAGE plpgsql
-- It reads jobd's tables: whatever search_path the enqueuing session has (a caller's COPY).
SET search_path FROM CURRENT
AS $$
DECLARE
    entry record;
    level integer;
    -- Outside READ COMMITTED the transaction's snapshot may predate a worker's arming, so
    -- reading lane_waiters proves nothing: notify as before.
    always boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    FOR entry IN SELECT lane, count(*) FILTER (WHERE run_at <= now()) AS due,
                        min(run_at) FILTER (WHERE run_at <= now()) AS first_due,
                        min(run_at) FILTER (WHERE run_at > now()) AS first_later
                   FROM new_jobs GROUP BY lane
    LOOP
        -- Held until commit. A worker arming meanwhile sees this enqueue as 'contended' and
        -- claims again instead of sleeping (arm_waiter); the retention duty's clean-up of
        -- lane_priorities skips the lane. The next statements' snapshots see every arming
        -- committed before the lock was granted.
        -- wake_lock_key(entry.lane), computed here: a call of a function that sets
        -- search_path cost every single-job enqueue about a tenth of its rate.
        PERFORM pg_advisory_xact_lock_shared(
            hashtextextended(TG_TABLE_SCHEMA || '.' || entry.lane, 0));
        -- Each of the statement's priorities not listed yet (any, outside READ COMMITTED:
        -- the snapshot may predate the retention duty's forgetting of one), as in enqueue:
        -- with the pair's lock inserted, without it (another transaction is inserting the
        -- pair and has not ended) recorded as wanted, never waited for.
        FOR level IN SELECT DISTINCT n.priority FROM new_jobs AS n
                      WHERE n.lane = entry.lane
                        AND (always OR NOT EXISTS (
                                 SELECT 1 FROM lane_priorities AS p
                                  WHERE p.lane = entry.lane AND p.priority = n.priority))
        LOOP
            IF pg_try_advisory_xact_lock(
                   hashtextextended(TG_TABLE_SCHEMA || '.' || entry.lane || '#' || level, 0)) THEN
                INSERT INTO lane_priorities (lane, priority) VALUES (entry.lane, level)
                    ON CONFLICT DO NOTHING;
            ELSE
                -- Unless a committed wanted row covers it already, as in enqueue.
                INSERT INTO lane_priorities_wanted (lane, priority)
                SELECT entry.lane, level
                 WHERE always
                    OR NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                                    WHERE w.lane = entry.lane AND w.priority = level);
            END IF;
        END LOOP;
        IF entry.due > 0
           AND (always OR EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = entry.lane)) THEN
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup', entry.lane || '#' || entry.due);
            -- Due since before the claim floors' margin (jobd.claim_floors.CAUGHT_UP_MARGIN):
            -- the jobs may sit below the waiting workers' floors, where a claim from the
            -- floors would not see them for up to a second (a herd enqueued due in the
            -- past, a transaction that began long before it enqueued). 'behind' tells the
            -- lane's workers to claim from the head.
            IF entry.first_due < clock_timestamp() - interval '0.5 seconds' THEN
                PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup', entry.lane || '!behind');
            END IF;
        END IF;
        IF entry.first_later IS NOT NULL THEN
            -- Work for later, beside due work or not: the supervisors set a timer for it.
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup',
                              entry.lane || '@' || extract(epoch FROM entry.first_later)::text);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- Every insert but jobd.enqueue's own, which announces itself. A trigger inside that insert
-- (pg_trigger_depth() > 0: a caller's trigger on jobs that inserts more jobs) is announced
-- here as before.
CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT
    WHEN (pg_trigger_depth() > 0
          OR current_setting('jobd.enqueue_announces', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION notify_new_jobs();

-- The retention duty forgets the priorities a lane no longer uses, one lane at a time and
-- only while no enqueue into it is in flight (the exclusive try-lock): an enqueue that
-- found its pair present cannot have the pair deleted under its uncommitted job. A pair
-- still wanted (lane_priorities_wanted) is kept until the lane poll's merge.
CREATE FUNCTION forget_unused_priorities(lane text) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    forgotten integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(forget_unused_priorities.lane)) THEN
        RETURN 0;
    END IF;
    DELETE FROM lane_priorities AS p
     WHERE p.lane = forget_unused_priorities.lane
       -- Claimable jobs through the claim index, claimed ones (which a release or an expired
       -- lease makes claimable again) through the lease index.
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.lane = p.lane AND j.priority = p.priority
                          AND j.state IN ('pending', 'failed'))
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.state = 'claimed' AND j.lease_until IS NOT NULL
                          AND j.lane = p.lane AND j.priority = p.priority)
       -- Wanted by an enqueue that met the pair being inserted: kept until the merge has
       -- seen to it (merge_wanted_priorities).
       AND NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                        WHERE w.lane = p.lane AND w.priority = p.priority);
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$$;

-- The lane poll's merge (jobd/duties/lane_poll.py): each wanted pair whose lock is free goes
-- into lane_priorities, and its wanted rows go. A pair whose lock is held is left for the next
-- turn: the transaction holding it is inserting the pair, and if it commits the rows only
-- cost a turn; if it rolls back, the merge lists the pair for the jobs that wanted it.
CREATE FUNCTION merge_wanted_priorities() RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    pair   record;
    merged integer := 0;
BEGIN
    FOR pair IN SELECT DISTINCT w.lane, w.priority FROM lane_priorities_wanted AS w LOOP
        -- Held: a transaction is inserting the pair (or another node merges it) and has not
        -- ended. Its end decides; the rows wait for the next turn, and nothing waits here.
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(
            hashtextextended(current_schema() || '.' || pair.lane || '#' || pair.priority, 0));
        INSERT INTO lane_priorities (lane, priority) VALUES (pair.lane, pair.priority)
            ON CONFLICT DO NOTHING;
        -- The rows committed by now: one committed later waits for the next turn.
        DELETE FROM lane_priorities_wanted AS w
         WHERE w.lane = pair.lane AND w.priority = pair.priority;
        merged := merged + 1;
    END LOOP;
    RETURN merged;
END
$$;

-- Where a worker's scan of each priority of a lane starts (jobd/claim_floors.py): the later
-- of a (run_at, id) position and an instant the priority was dry at, given as an age before
-- `at` (default_age for priorities without one of their own); the head ('-infinity', 0)
-- when neither is known. Used by claim_jobs and arm_waiter. No SET search_path, so that the
-- planner can inline it into the claim: its callers run with jobd's schema on the path.
CREATE FUNCTION lane_floors(lane text, priorities integer[], run_ats timestamptz[],
                            ids bigint[], ages float8[], default_age float8, at timestamptz)
RETURNS TABLE (priority integer, floor_at timestamptz, floor_id bigint)
LANGUAGE sql STABLE
AS $$
    SELECT p.priority,
           CASE WHEN f.run_at > dry.floor_at THEN f.run_at ELSE dry.floor_at END,
           CASE WHEN f.run_at > dry.floor_at THEN f.id ELSE 0 END
      FROM lane_priorities AS p
      LEFT JOIN unnest(priorities, run_ats, ids, ages) AS f(priority, run_at, id, age)
             ON f.priority = p.priority
     CROSS JOIN LATERAL (
           SELECT coalesce(at - make_interval(secs => coalesce(f.age, default_age)),
                           '-infinity') AS floor_at) AS dry
     WHERE p.lane = lane_floors.lane
$$;

-- Arming in two transactions (migration 0020), which arm_waiter (below) did in one: it held
-- the lane's exclusive lock through its probe for work, and every enqueue into the lane
-- queued behind the probe (up to hundreds of milliseconds on a table bloated by an
-- overload). Now the lock is held only while the worker's row goes in:
--
-- 1. arm_waiter_register, committed on its own: 'paused' (as arm_waiter), 'contended' (an
--    enqueue holds the shared lock: nothing registered), or 'registered'. Once the exclusive
--    lock is granted no enqueue is between its insert and its commit; an enqueue after it
--    waits for this commit, then sees the row and notifies.
-- 2. arm_waiter_probe, in a new transaction: its snapshot sees every job whose enqueue
--    committed before that lock was granted, and every later one notifies. It answers
--    'work' (a due job above the floors: the worker claims, its row kept since 0024) or
--    'armed'. No lock: producers never wait for it.
CREATE FUNCTION arm_waiter_register(lane text, worker_id text) RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM lane_pauses AS p
                WHERE p.lane = arm_waiter_register.lane AND p.handler IS NULL) THEN
        RETURN 'paused';
    END IF;
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(arm_waiter_register.lane)) THEN
        RETURN 'contended';
    END IF;
    INSERT INTO lane_waiters (worker_id, lane)
         VALUES (arm_waiter_register.worker_id, arm_waiter_register.lane)
        ON CONFLICT ON CONSTRAINT lane_waiters_pkey
        DO UPDATE SET lane = excluded.lane, armed_at = now();
    RETURN 'registered';
END
$$;

-- skipped_handlers: handlers the probing worker's node does not have (migration 0026); their
-- jobs are work for other nodes, stepped over as a paused handler's are.
CREATE FUNCTION arm_waiter_probe(lane text, worker_id text, floor_priorities integer[],
                                 floor_run_ats timestamptz[], floor_ids bigint[],
                                 floor_ages float8[], default_floor_age float8,
                                 skipped_handlers text[] DEFAULT '{}')
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    level integer;
    floor_at timestamptz;
    floor_id bigint;
    paused_handlers text[] := ARRAY(SELECT p.handler FROM lane_pauses AS p
                                     WHERE p.lane = arm_waiter_probe.lane
                                       AND p.handler IS NOT NULL)
                              || coalesce(skipped_handlers, '{}');
BEGIN
    FOR level, floor_at, floor_id IN
        SELECT l.priority, l.floor_at, l.floor_id
          FROM lane_floors(arm_waiter_probe.lane, floor_priorities, floor_run_ats, floor_ids,
                           floor_ages, default_floor_age, now()) AS l
    LOOP
        -- In claim order, so jobs_claimable_idx serves it from the floor (0023): an
        -- EXISTS drops its ORDER BY, and from jobs_fair_idx the floor bounds nothing.
        PERFORM FROM jobs AS j
          WHERE j.lane = arm_waiter_probe.lane AND j.state IN ('pending', 'failed')
            AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
            AND j.run_at <= now() AND NOT j.suspect
            AND runnable(j.handler, paused_handlers)
          ORDER BY j.run_at, j.id
          LIMIT 1;
        IF FOUND THEN
            -- The worker's row stays (0024): it claims while armed, as after a wake-up.
            RETURN 'work';
        END IF;
    END LOOP;
    RETURN 'armed';
END
$$;

-- Arming in one transaction, for daemons of releases before migration 0020 (this body since
-- 0024): the two steps above under one lock held through the probe, so enqueues into the lane
-- wait for it. The answers are arm_waiter_register's, or arm_waiter_probe's once registered;
-- on 'work' the row is removed, as those daemons expect.
CREATE FUNCTION arm_waiter(lane text, worker_id text, floor_priorities integer[],
                           floor_run_ats timestamptz[], floor_ids bigint[],
                           floor_ages float8[], default_floor_age float8)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    registered text := arm_waiter_register(arm_waiter.lane, arm_waiter.worker_id);
    probed     text;
BEGIN
    IF registered <> 'registered' THEN
        RETURN registered;
    END IF;
    probed := arm_waiter_probe(arm_waiter.lane, arm_waiter.worker_id, floor_priorities,
                               floor_run_ats, floor_ids, floor_ages, default_floor_age);
    IF probed = 'work' THEN
        -- Those daemons take 'work' as "not armed" (0024 keeps the row in the probe).
        DELETE FROM lane_waiters AS w WHERE w.worker_id = arm_waiter.worker_id;
    END IF;
    RETURN probed;
END
$$;

-- The ids a claim in a lane with max_wait or fair_by takes (claim_jobs_ordered), in claim
-- order, and locked (FOR UPDATE SKIP LOCKED) for the claiming statement.
--
-- Two passes over the lane's priorities (their floors from lane_floors, as in claim_jobs):
-- 1. Overdue: with max_wait, jobs due since `at - max_wait` or earlier come first, whatever
--    their priority; the priorities whose oldest overdue job is oldest go first. So a job
--    passed over for max_wait is next once the overdue jobs older than it are claimed. In a
--    fair lane the highest priority with due jobs, which no priority passes over, takes all
--    of its due jobs at its place there, shared across keys (migration 0048): its overdue
--    jobs alone would fill the claim ahead of its other keys' younger ones.
-- 2. The rest, highest priority first, each oldest first.
-- Within a priority and pass, with `fair`, the jobs are shared round-robin across share
-- keys (coalesce(fairness_key, handler)): the keys with due jobs are found one index
-- descent each, starting after key_cursor (the claiming worker's last key) and wrapping,
-- up to as many keys as jobs wanted; each takes an equal share, then the keys that filled
-- their share split what is left. Without `fair`, a priority's jobs are taken oldest first.
CREATE FUNCTION claim_order(lane text, priorities integer[], run_ats timestamptz[],
                            ids bigint[], ages float8[], default_age float8, at timestamptz,
                            max_wait float8, fair boolean, key_cursor text, wanted integer,
                            paused_handlers text[], key_floors_priority integer[],
                            key_floors_key text[], key_floors_run_at timestamptz[],
                            key_floors_id bigint[])
RETURNS bigint[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    picked bigint[] := '{}';
    overdue_before timestamptz := at - make_interval(secs => max_wait);
    level record;
    -- The positions per share key, looked up by key (key_floor) rather than searched; only
    -- a fair claim has any use for them.
    positions jsonb := CASE WHEN fair THEN key_positions(key_floors_priority, key_floors_key,
                                                         key_floors_run_at, key_floors_id)
                            ELSE '{}' END;
    -- A fair lane's highest priority with a due job the claim may take (NULL otherwise):
    -- its overdue level takes all of its due jobs, shared across keys (migration 0048).
    top integer;
    -- Whether the overdue pass visited the top priority: it then took all of its due jobs,
    -- which the second pass must not take again (rows this transaction locked are not
    -- skipped: each would be listed twice).
    top_visited boolean := false;
BEGIN
    IF max_wait IS NOT NULL AND fair THEN
        -- No priority above it passes its overdue jobs over. Taken alone they filled the
        -- claim (a herd older than max_wait, or due since before a clock jump), and the
        -- priority's other keys waited max_wait behind them.
        SELECT max(l.priority) INTO top
          FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
               AS l
         WHERE EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                          AND j.priority = l.priority
                          AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                          AND j.run_at <= at
                          AND NOT j.suspect
                          AND (cardinality(paused_handlers) = 0
                               OR runnable(j.handler, paused_handlers)));
    END IF;
    IF max_wait IS NOT NULL THEN
        FOR level IN
            SELECT l.priority, l.floor_at, l.floor_id
              FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
                   AS l
             CROSS JOIN LATERAL (
                   -- The oldest overdue job the claim may take (claim_level's filters): a
                   -- paused or lacking handler's, or a suspect, put its priority first and
                   -- an older overdue job of another priority waited behind it.
                   SELECT j.run_at FROM jobs AS j
                    WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = l.priority
                      AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                      AND j.run_at <= overdue_before
                      AND NOT j.suspect
                      AND (cardinality(paused_handlers) = 0
                           OR runnable(j.handler, paused_handlers))
                    ORDER BY j.run_at, j.id
                    LIMIT 1) AS head
             ORDER BY head.run_at
        LOOP
            picked := picked || claim_level(claim_order.lane, level.priority, level.floor_at,
                                            level.floor_id, '-infinity',
                                            CASE WHEN level.priority = top THEN at
                                                 ELSE overdue_before END,
                                            fair, key_cursor, wanted - cardinality(picked),
                                            paused_handlers, positions);
            top_visited := top_visited OR level.priority IS NOT DISTINCT FROM top;
            EXIT WHEN cardinality(picked) >= wanted;
        END LOOP;
    END IF;
    IF cardinality(picked) < wanted THEN
        -- Only the priorities with a due job (one probe each of the claim index): a fair
        -- claim would otherwise step through the keys of a priority whose jobs are all
        -- scheduled for later.
        FOR level IN
            SELECT l.priority, l.floor_at, l.floor_id
              FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
                   AS l
             WHERE EXISTS (SELECT 1 FROM jobs AS j
                            WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                              AND j.priority = l.priority
                              AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                              AND j.run_at > coalesce(overdue_before, '-infinity')
                              AND j.run_at <= at
                              AND NOT j.suspect
                              AND (cardinality(paused_handlers) = 0
                                   OR runnable(j.handler, paused_handlers)))
               AND NOT (top_visited AND l.priority IS NOT DISTINCT FROM top)
             ORDER BY l.priority DESC
        LOOP
            picked := picked || claim_level(claim_order.lane, level.priority, level.floor_at,
                                            level.floor_id,
                                            coalesce(overdue_before, '-infinity'), at, fair,
                                            key_cursor, wanted - cardinality(picked),
                                            paused_handlers, positions);
            EXIT WHEN cardinality(picked) >= wanted;
        END LOOP;
    END IF;
    RETURN picked;
END
$$;

-- The worker's positions per share key as one object: "priority:key" -> [run_at, id]. The
-- priority is an integer, so the first ':' ends it whatever the key holds.
CREATE FUNCTION key_positions(priorities integer[], keys text[], run_ats timestamptz[],
                              ids bigint[])
RETURNS jsonb
-- STABLE: a timestamptz's text in the object depends on the session's TimeZone (the instant
-- read back from it does not). PL/pgSQL, as due_keys: planned once per session.
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_object_agg(f.priority || ':' || f.key,
                                             jsonb_build_array(f.run_at, f.id)), '{}')
              FROM unnest(priorities, keys, run_ats, ids) AS f(priority, key, run_at, id));
END
$$;

-- Where a fair claim's scan of one key of a priority starts: the later of the priority's
-- floor and the key's own position (the last job of it the worker took, jobd/claim_floors.py),
-- so that the scan does not walk the dead index entries of the key's jobs claimed before,
-- which vacuum has not removed yet: a herd of one key leaves tens of thousands.
CREATE FUNCTION key_floor(key text, level integer, floor_at timestamptz, floor_id bigint,
                          positions jsonb)
RETURNS TABLE (floor_at timestamptz, floor_id bigint)
LANGUAGE sql STABLE
AS $$
    SELECT CASE WHEN (p.run_at, p.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN p.run_at ELSE key_floor.floor_at END,
           CASE WHEN (p.run_at, p.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN p.id ELSE key_floor.floor_id END
      FROM (SELECT (found.entry ->> 0)::timestamptz AS run_at, (found.entry ->> 1)::bigint AS id
              FROM (SELECT positions -> (level || ':' || key_floor.key) AS entry) AS found) AS p
$$;

-- The share keys of one priority of a lane that have due jobs with run_at in (after, up_to]
-- that a claim may take (not suspects, not of paused_handlers: migration 0033), in order after
-- from_key and up to to_key (NULL: to the end), at most `wanted`: a skip scan
-- of jobs_fair_idx, one index descent per key (a recursive query stepping from key to key),
-- and one more to see whether the key has a due job. Keys whose jobs are all scheduled for
-- later cost their two descents each time a claim passes them. Sorts are priced out
-- (migration 0027): a step planned on jobs_claimable_idx, sorting what it reads by key, read
-- every due job of the priority; statistics taken while the table was empty make that plan
-- cost the same as the descent of jobs_fair_idx to the planner. PL/pgSQL, not SQL: a SQL
-- function with SET clauses is never inlined, and PostgreSQL plans its body again in every
-- transaction that calls it (every claim), where PL/pgSQL keeps the plan for the session
-- (migration 0028: the planning was more than half of a fair claim over one key).
CREATE FUNCTION due_keys(lane text, level integer, from_key text, to_key text,
                         floor_at timestamptz, floor_id bigint, after timestamptz,
                         up_to timestamptz, wanted integer, positions jsonb,
                         paused_handlers text[])
RETURNS text[]
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_sort = off
AS $$
BEGIN
    RETURN (
        WITH RECURSIVE walk(key) AS (
            SELECT (SELECT coalesce(j.fairness_key, j.handler) COLLATE "C" FROM jobs AS j
                     WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                       AND j.priority = level
                       AND coalesce(j.fairness_key, j.handler) COLLATE "C" > from_key
                     ORDER BY 1
                     LIMIT 1)
            UNION ALL
            SELECT (SELECT coalesce(j.fairness_key, j.handler) COLLATE "C" FROM jobs AS j
                     WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                       AND j.priority = level
                       AND coalesce(j.fairness_key, j.handler) COLLATE "C" > w.key
                     ORDER BY 1
                     LIMIT 1)
              FROM walk AS w
             WHERE w.key IS NOT NULL AND (to_key IS NULL OR w.key < to_key)
        )
        SELECT coalesce(array_agg(d.key), '{}')
          FROM (SELECT w.key FROM walk AS w
                 CROSS JOIN LATERAL key_floor(w.key, level, floor_at, floor_id, positions) AS f
                 -- A probe per key (LIMIT 1 in a lateral: never a hash of a key's every job).
                 CROSS JOIN LATERAL (
                       SELECT 1 FROM jobs AS j
                        WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                          AND j.priority = level
                          AND coalesce(j.fairness_key, j.handler) COLLATE "C" = w.key
                          AND (j.run_at, j.id) >= (f.floor_at, f.floor_id)
                          AND j.run_at > after AND j.run_at <= up_to
                          -- What claim_level may take: a key whose due jobs are all a
                          -- paused or lacking handler's, or suspects, must not count
                          -- towards `wanted`, or it would stand in for a key after it at
                          -- every claim for as long as the pause lasts (migration 0033).
                          AND NOT j.suspect
                          AND (cardinality(paused_handlers) = 0
                               OR runnable(j.handler, paused_handlers))
                        LIMIT 1) AS due
                 WHERE w.key IS NOT NULL AND (to_key IS NULL OR w.key <= to_key)
                 LIMIT wanted) AS d);
END
$$;

-- Up to `wanted` due jobs of one priority of a lane with run_at in (after, up_to] and at or
-- above the floor: oldest first, or shared across keys (see claim_order). In a round, each
-- key takes an equal share (the first keys one more, so the shares add up to what is
-- wanted); the keys that filled theirs split what is left in the next round.
CREATE FUNCTION claim_level(lane text, level integer, floor_at timestamptz, floor_id bigint,
                            after timestamptz, up_to timestamptz, fair boolean,
                            key_cursor text, wanted integer, paused_handlers text[],
                            positions jsonb)
RETURNS bigint[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    picked bigint[] := '{}';
    keys text[];
    taken bigint[];
    -- Where the listing of keys goes on: after list_from, up to list_to (NULL: to the end,
    -- the keys after the cursor; then from the start around to the cursor).
    list_from text := coalesce(key_cursor, '');
    list_to text := NULL;
    listed_all boolean := false;
    page text[];
    want integer;
BEGIN
    IF NOT fair THEN
        RETURN ARRAY(SELECT j.id FROM jobs AS j
                      WHERE j.lane = claim_level.lane AND j.state IN ('pending', 'failed')
                        AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
                        AND j.run_at > after AND j.run_at <= up_to AND NOT j.suspect
                        AND (cardinality(paused_handlers) = 0
                             OR runnable(j.handler, paused_handlers))
                      ORDER BY j.run_at, j.id
                      LIMIT wanted
                        FOR UPDATE SKIP LOCKED);
    END IF;
    -- Up to as many keys as jobs are still wanted, then their shares. due_keys sees a key
    -- whose due jobs another claim holds (not committed yet), and its share takes nothing:
    -- when every listed key has run dry with jobs still wanted, the listing goes on from where
    -- it stopped (migration 0040). Otherwise the claim came back short with jobs left in keys
    -- it never listed, and its worker took the lane for dry.
    WHILE NOT listed_all AND cardinality(picked) < wanted LOOP
        keys := '{}';
        WHILE NOT listed_all AND cardinality(keys) < wanted - cardinality(picked) LOOP
            want := wanted - cardinality(picked) - cardinality(keys);
            page := due_keys(claim_level.lane, level, list_from, list_to, floor_at, floor_id,
                             after, up_to, want, positions, paused_handlers);
            keys := keys || page;
            IF cardinality(page) = want THEN
                list_from := page[cardinality(page)];
            ELSIF list_to IS NULL AND key_cursor <> '' THEN
                list_from := '';
                list_to := key_cursor;
            ELSE
                listed_all := true;
            END IF;
        END LOOP;
        WHILE cardinality(keys) > 0 AND cardinality(picked) < wanted LOOP
            WITH shares AS (
                SELECT k.key, k.position, (wanted - cardinality(picked)) / cardinality(keys)
                              + CASE WHEN k.position <= (wanted - cardinality(picked))
                                                        % cardinality(keys)
                                     THEN 1 ELSE 0 END AS share,
                       f.floor_at, f.floor_id
                  FROM unnest(keys) WITH ORDINALITY AS k(key, position)
                 CROSS JOIN LATERAL key_floor(k.key, level, floor_at, floor_id, positions) AS f
            ),
            got AS (
                SELECT s.key, s.share, t.id
                  FROM shares AS s
                 CROSS JOIN LATERAL (
                       SELECT j.id FROM jobs AS j
                        WHERE j.lane = claim_level.lane AND j.state IN ('pending', 'failed')
                          AND j.priority = level
                          AND coalesce(j.fairness_key, j.handler) COLLATE "C" = s.key
                          AND (j.run_at, j.id) >= (s.floor_at, s.floor_id)
                          AND j.run_at > after AND j.run_at <= up_to AND NOT j.suspect
                          AND (cardinality(paused_handlers) = 0
                               OR runnable(j.handler, paused_handlers))
                          AND NOT (j.id = ANY(picked))
                        ORDER BY j.run_at, j.id
                        LIMIT s.share
                          FOR UPDATE SKIP LOCKED) AS t
                 WHERE s.share > 0
            )
            -- The next round's keys: those that filled their share, and those whose share
            -- was 0 (fewer jobs left than keys); a key that took less than its share has run
            -- dry. Each round takes a job or drops a key, so the loop ends.
            SELECT coalesce((SELECT array_agg(g.id) FROM got AS g), '{}'),
                   coalesce((SELECT array_agg(s.key ORDER BY s.position)
                               FROM shares AS s
                               LEFT JOIN (SELECT g.key, count(*) AS n FROM got AS g
                                           GROUP BY g.key) AS t ON t.key = s.key
                              WHERE s.share = 0 OR t.n = s.share), '{}')
              INTO taken, keys;
            picked := picked || taken;
        END LOOP;
    END LOOP;
    RETURN picked;
END
$$;


-- ===========================================================================================
-- Archive maintenance
-- ===========================================================================================

-- Daily archive partitions from yesterday to days_ahead days from now. Rows that landed in the
-- default partition for such a day move into the new partition in the same transaction.
CREATE FUNCTION ensure_archive_partitions(days_ahead integer DEFAULT 7) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    day        date;
    part       text;
    created    integer := 0;
BEGIN
    -- Every supervisor tops up partitions; take turns so two never create the same one.
    PERFORM pg_advisory_xact_lock(hashtext('jobd.archive_partitions'), hashtext(current_schema()));
    FOR day IN SELECT generate_series((now() AT TIME ZONE 'UTC')::date - 1,
                                      (now() AT TIME ZONE 'UTC')::date + days_ahead,
                                      interval '1 day')::date
    LOOP
        part := 'jobs_archive_' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(quote_ident(part)) IS NOT NULL;
        EXECUTE format('CREATE TABLE %I (LIKE jobs_archive INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
        EXECUTE format(
            'WITH moved AS (DELETE FROM jobs_archive_default
                             WHERE finished_at >= %L AND finished_at < %L RETURNING *)
             INSERT INTO %I SELECT * FROM moved',
            (day::timestamp AT TIME ZONE 'UTC'), ((day + 1)::timestamp AT TIME ZONE 'UTC'), part);
        EXECUTE format('ALTER TABLE jobs_archive ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
            part, (day::timestamp AT TIME ZONE 'UTC'), ((day + 1)::timestamp AT TIME ZONE 'UTC'));
        created := created + 1;
    END LOOP;
    RETURN created;
END
$$;

-- Retention: drop whole archive partitions that end at or before the cutoff. Returns the
-- number of partitions dropped. (The idempotency keys of those jobs are forgotten apart, in
-- batches: prune_job_keys in jobd/sql/queries.sql, migration 0036.)
CREATE FUNCTION drop_archive_partitions(cutoff timestamptz) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    part    record;
    dropped integer := 0;
    saved_lock_timeout text := current_setting('lock_timeout');
BEGIN
    FOR part IN
        SELECT c.relname,
               (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
                   AS upper_bound
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'jobs_archive'::regclass
           AND c.relname <> 'jobs_archive_default'
    LOOP
        CONTINUE WHEN part.upper_bound > cutoff;
        -- Dropping a partition needs ACCESS EXCLUSIVE on jobs_archive. Queued behind a long
        -- reader, that request would block every completion; give up after a second instead
        -- and let the next maintenance run try again.
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            EXECUTE format('DROP TABLE %I', part.relname);
            dropped := dropped + 1;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'jobd: archive partition % is in use; retention will retry', part.relname;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    DELETE FROM jobs_archive_default WHERE finished_at < cutoff;
    RETURN dropped;
END
$$;


-- ===========================================================================================
-- Nodes and the fallback poll
-- ===========================================================================================

-- Live supervisors: each writes its row every duty tick, so `jobd status` can show live
-- workers per node and claim/failure rates without asking the nodes themselves.
CREATE TABLE nodes (
    instance        text        PRIMARY KEY,      -- node name, pid and a random suffix
    node            text        NOT NULL,
    pid             integer     NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    seen_at         timestamptz NOT NULL DEFAULT now(),
    -- {"lane": number of live workers}
    workers         jsonb       NOT NULL DEFAULT '{}',
    -- {"lane": {"claimed": n, "completed": n, "failed": n, "dead": n}}, totals since start;
    -- the previous sample is kept so rates need only this row.
    counters        jsonb       NOT NULL DEFAULT '{}',
    prev_counters   jsonb       NOT NULL DEFAULT '{}',
    prev_seen_at    timestamptz,
    -- seconds between the node's heartbeats (its duty_interval), so `jobd status` can tell a
    -- node that stopped writing (gone) from one whose next beat is not due; NULL from daemons
    -- older than migration 0015, which are judged by a fixed window
    heartbeat_interval float8,
    -- whether its supervisor holds its LISTEN connection (else its workers wake on the
    -- fallback poll only); NULL: a node that does not report it
    listening       boolean,
    -- seconds of archive its config keeps (archive.retention): no node's retention pass
    -- forgets what another node with a row keeps (migration 0042); NULL: not reported
    archive_retention float8,
    -- {"lane": {"max_attempts": 8, "timeout": null, ...}}: the settings of its lanes that
    -- decide a job's fate or the fleet's limits (LaneConfig.fleet_settings), so a lane the
    -- live nodes configure differently is named (migration 0044); NULL: not reported
    lane_settings     jsonb
);

-- The earliest run_at of a lane's claimable jobs: one index probe per listed priority.
CREATE FUNCTION lane_head(lane text) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT min(first.run_at)
      FROM lane_priorities AS p
     CROSS JOIN LATERAL (
           SELECT j.run_at FROM jobs AS j
            WHERE j.lane = p.lane AND j.state IN ('pending', 'failed') AND j.priority = p.priority
            ORDER BY j.run_at LIMIT 1) AS first
     WHERE p.lane = lane_head.lane
$$;

-- When the job at the head of a lane began to wait: its run_at, or its enqueue if it was
-- enqueued due in the past (migration 0030). One index probe per priority and one heap fetch
-- each; it is the head's wait: behind a back-dated head, an older wait shows once the head is
-- claimed. The oldest-wait gauge reads it; wake-ups follow lane_head.
CREATE FUNCTION lane_waiting_since(lane text) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    -- Jobs an operator paused (the lane, or their handler) wait by choice: left out, so that
    -- the pickup SLO shows whether the lane does the rest of its work (migration 0039).
    SELECT min(first.waiting_since)
      FROM lane_priorities AS p
     CROSS JOIN (SELECT coalesce(bool_or(lp.handler IS NULL), false) AS whole_lane,
                        coalesce(array_agg(lp.handler) FILTER (WHERE lp.handler IS NOT NULL),
                                 '{}') AS handlers
                   FROM lane_pauses AS lp
                  WHERE lp.lane = lane_waiting_since.lane) AS paused
     CROSS JOIN LATERAL (
           SELECT greatest(j.run_at, j.created_at) AS waiting_since FROM jobs AS j
            WHERE j.lane = p.lane AND j.state IN ('pending', 'failed') AND j.priority = p.priority
              AND (cardinality(paused.handlers) = 0 OR runnable(j.handler, paused.handlers))
            ORDER BY j.run_at LIMIT 1) AS first
     WHERE p.lane = lane_waiting_since.lane AND NOT paused.whole_lane
$$;


-- ===========================================================================================
-- Recurring schedules
-- ===========================================================================================

-- The stored definition of each schedule and its cursor. Which definition is stored is
-- decided from the live declarations (schedule_declarations, reconcile_schedule); `enabled`
-- is the operator's flag (`jobd schedules disable/enable`) and no sync writes it.
CREATE TABLE schedules (
    id                  text        PRIMARY KEY,
    cron                text        NOT NULL,
    timezone            text        NOT NULL DEFAULT 'UTC',
    handler             text        NOT NULL,
    lane                text        NOT NULL DEFAULT 'default',
    payload             jsonb       NOT NULL DEFAULT '{}',
    priority            integer     NOT NULL DEFAULT 0,
    catchup             text        NOT NULL DEFAULT 'latest'
                                    CHECK (catchup IN ('latest', 'all', 'none')),
    overlap             text        NOT NULL DEFAULT 'allow'
                                    CHECK (overlap IN ('allow', 'skip')),
    enabled             boolean     NOT NULL DEFAULT true,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- Occurrences at or before this instant have been dealt with (fired or skipped).
    materialized_until  timestamptz NOT NULL DEFAULT now(),
    last_fire_at        timestamptz,
    last_job_id         bigint
);

-- The fire ledger: one row per occurrence ever dealt with. The primary key is the
-- deduplication: two nodes computing the same occurrence race on this insert, and the loser
-- inserts no job.
CREATE TABLE schedule_fires (
    schedule_id text        NOT NULL,
    occurrence  text        NOT NULL,
    fire_at     timestamptz NOT NULL,
    outcome     text        NOT NULL CHECK (outcome IN ('enqueued', 'skipped_overlap')),
    job_id      bigint,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schedule_id, occurrence)
);
CREATE INDEX schedule_fires_fire_at_idx ON schedule_fires (fire_at);

-- Schedule ownership. Each supervisor instance declares the schedules of its config, with the
-- definition it would write and an expiry that its duty pass keeps moving forward. A schedule
-- is materialized while it is enabled and at least one unexpired declaration names it, so one
-- node's config can neither switch off nor rewrite what other live nodes still declare.
CREATE TABLE schedule_declarations (
    schedule_id text        NOT NULL,
    instance    text        NOT NULL,  -- the supervisor instance (nodes.instance)
    -- The schedule as this instance's config defines it (see schedule_definition).
    definition  jsonb       NOT NULL,
    -- When this instance first declared this definition: the newest wins when the stored
    -- definition has no live declaration left.
    declared_at timestamptz NOT NULL,
    -- Not live from this instant on, unless refreshed. No foreign key to schedules: the
    -- refresh in the duty transaction must take no lock on a schedule row.
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (schedule_id, instance)
);
-- A leaving instance withdraws its declarations; its duty pass refreshes them.
CREATE INDEX schedule_declarations_instance_idx ON schedule_declarations (instance);

-- Fires one occurrence: the ledger row, the job (with the idempotency key
-- 'jobd:schedule:<id>:<occurrence>') and the schedule's cursor, in one transaction. Returns
-- 'enqueued' with the job id, or why nothing was enqueued: 'not_due' (fire_at is in the
-- future by the database clock), 'disabled', 'duplicate' (already in the ledger) or
-- 'skipped_overlap'. The schedule row is locked, so materializers of one schedule take turns.
CREATE FUNCTION fire_schedule(
    schedule_id text, occurrence text, fire_at timestamptz, at timestamptz DEFAULT NULL
) RETURNS TABLE (outcome text, job_id bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    clock  timestamptz := coalesce(fire_schedule.at, now());
    s      schedules%ROWTYPE;
    new_id bigint;
    key    text := 'jobd:schedule:' || fire_schedule.schedule_id || ':' || fire_schedule.occurrence;
BEGIN
    IF fire_schedule.fire_at > clock THEN
        RETURN QUERY SELECT 'not_due'::text, NULL::bigint;
        RETURN;
    END IF;
    SELECT * INTO s FROM schedules AS sc WHERE sc.id = fire_schedule.schedule_id FOR UPDATE;
    IF NOT FOUND OR NOT s.enabled THEN
        RETURN QUERY SELECT 'disabled'::text, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO schedule_fires AS f (schedule_id, occurrence, fire_at, outcome)
    VALUES (s.id, fire_schedule.occurrence, fire_schedule.fire_at, 'enqueued')
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        UPDATE schedules AS sc SET materialized_until = greatest(sc.materialized_until,
                                                                 fire_schedule.fire_at)
         WHERE sc.id = s.id;
        RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
        RETURN;
    END IF;
    IF s.overlap = 'skip' AND s.last_job_id IS NOT NULL
       AND EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = s.last_job_id) THEN
        UPDATE schedule_fires AS f SET outcome = 'skipped_overlap'
         WHERE f.schedule_id = s.id AND f.occurrence = fire_schedule.occurrence;
        UPDATE schedules AS sc SET materialized_until = greatest(sc.materialized_until,
                                                                 fire_schedule.fire_at)
         WHERE sc.id = s.id;
        RETURN QUERY SELECT 'skipped_overlap'::text, NULL::bigint;
        RETURN;
    END IF;
    new_id := nextval('job_id_seq');
    INSERT INTO job_keys (idempotency_key, job_id) VALUES (key, new_id) ON CONFLICT DO NOTHING;
    INSERT INTO jobs (id, lane, handler, payload, priority, run_at, idempotency_key)
    VALUES (new_id, s.lane, s.handler, s.payload, s.priority, fire_schedule.fire_at, key);
    UPDATE schedule_fires AS f SET job_id = new_id
     WHERE f.schedule_id = s.id AND f.occurrence = fire_schedule.occurrence;
    UPDATE schedules AS sc
       SET materialized_until = greatest(sc.materialized_until, fire_schedule.fire_at),
           last_fire_at = greatest(sc.last_fire_at, fire_schedule.fire_at),
           last_job_id = CASE WHEN sc.last_fire_at IS NULL OR fire_schedule.fire_at >= sc.last_fire_at
                              THEN new_id ELSE sc.last_job_id END
     WHERE sc.id = s.id;
    RETURN QUERY SELECT 'enqueued'::text, new_id;
END
$$;

-- The stored definition of a schedule in the form declarations carry, so the two compare as
-- jsonb values. No SET search_path, so the planner can inline it: it reads no table.
CREATE FUNCTION schedule_definition(s schedules) RETURNS jsonb
LANGUAGE sql IMMUTABLE
AS $$
    SELECT jsonb_build_object('cron', s.cron, 'timezone', s.timezone, 'handler', s.handler,
                              'lane', s.lane, 'payload', s.payload, 'priority', s.priority,
                              'catchup', s.catchup, 'overlap', s.overlap)
$$;

-- Decides a schedule's stored definition from the live declarations, with its row locked so
-- that deciders take turns. The stored definition stays while any live declaration carries
-- it: a conflicting declaration is reported, never written, so definitions do not flap. Only
-- when no live declaration carries it any more is the newest live declaration adopted (the
-- cursor is kept). With wait => false a locked row is left alone ('busy'): the duty pass
-- calls it after its tick holds schedule locks and must not wait out of id order.
-- Returns 'changed', 'unchanged', 'undeclared' (no live declaration) or 'busy' (locked, or
-- no such schedule).
CREATE FUNCTION reconcile_schedule(
    schedule_id text, at timestamptz DEFAULT NULL, wait boolean DEFAULT true
) RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    clock  timestamptz := coalesce(reconcile_schedule.at, now());
    s      schedules%ROWTYPE;
    chosen jsonb;
BEGIN
    IF reconcile_schedule.wait THEN
        SELECT * INTO s FROM schedules AS sc WHERE sc.id = reconcile_schedule.schedule_id
           FOR UPDATE;
    ELSE
        SELECT * INTO s FROM schedules AS sc WHERE sc.id = reconcile_schedule.schedule_id
           FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN 'busy';
    END IF;
    IF EXISTS (SELECT 1 FROM schedule_declarations AS d
                WHERE d.schedule_id = s.id AND d.expires_at > clock
                  AND d.definition = schedule_definition(s)) THEN
        RETURN 'unchanged';
    END IF;
    SELECT d.definition INTO chosen FROM schedule_declarations AS d
     WHERE d.schedule_id = s.id AND d.expires_at > clock
     ORDER BY d.declared_at DESC, d.instance DESC
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 'undeclared';
    END IF;
    -- A new expression or zone starts at the change: its occurrences before it never were
    -- due (the old definition's were, and were fired up to now). Kept, the cursor (the last
    -- fire) made the first tick fire them all as missed.
    UPDATE schedules AS sc
       SET cron = chosen->>'cron', timezone = chosen->>'timezone',
           handler = chosen->>'handler', lane = chosen->>'lane', payload = chosen->'payload',
           priority = (chosen->>'priority')::integer, catchup = chosen->>'catchup',
           overlap = chosen->>'overlap', updated_at = now(),
           materialized_until = CASE
               WHEN (chosen->>'cron', chosen->>'timezone') IS DISTINCT FROM (sc.cron, sc.timezone)
               THEN greatest(sc.materialized_until, clock)
               ELSE sc.materialized_until END
     WHERE sc.id = s.id;
    RETURN 'changed';
END
$$;

-- Declares one schedule for one instance: creates the schedule if it is new (materializing
-- from the clock on, no backfill), writes the declaration with its expiry, then reconciles
-- the stored definition. Never touches `enabled`. Callers declare in id order, the order in
-- which ticks lock schedules. Returns 'created' or what reconcile_schedule returned.
CREATE FUNCTION declare_schedule(
    schedule_id text, instance text, definition jsonb, ttl_seconds double precision,
    at timestamptz DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    clock   timestamptz := coalesce(declare_schedule.at, now());
    d       jsonb := declare_schedule.definition;
    created boolean;
    outcome text;
BEGIN
    INSERT INTO schedules AS sc (id, cron, timezone, handler, lane, payload, priority, catchup,
                                 overlap, materialized_until)
    VALUES (declare_schedule.schedule_id, d->>'cron', d->>'timezone', d->>'handler',
            d->>'lane', d->'payload', (d->>'priority')::integer, d->>'catchup',
            d->>'overlap', clock)
    ON CONFLICT (id) DO NOTHING;
    created := FOUND;
    INSERT INTO schedule_declarations AS sd (schedule_id, instance, definition, declared_at,
                                             expires_at)
    VALUES (declare_schedule.schedule_id, declare_schedule.instance, d, clock,
            clock + make_interval(secs => declare_schedule.ttl_seconds))
    ON CONFLICT ON CONSTRAINT schedule_declarations_pkey DO UPDATE
       SET definition = excluded.definition,
           expires_at = excluded.expires_at,
           declared_at = CASE WHEN sd.definition = excluded.definition THEN sd.declared_at
                              ELSE excluded.declared_at END;
    outcome := reconcile_schedule(declare_schedule.schedule_id, clock, true);
    RETURN CASE WHEN created THEN 'created' ELSE outcome END;
END
$$;


-- ===========================================================================================
-- Exactly-once effect: the dedup store written by transactional handlers, and the outbox
-- ===========================================================================================

-- One row per idempotency key whose effect has committed. A transactional handler's writes,
-- this row and the job's completion commit together, so a replay of the key finds it and
-- does nothing.
CREATE TABLE processed_keys (
    idempotency_key text        PRIMARY KEY,
    job_id          bigint      NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX processed_keys_processed_at_idx ON processed_keys (processed_at);

-- Intent to cause an effect outside PostgreSQL (an email, an API call), recorded in the
-- handler's transaction and delivered afterwards by a delivery job (handler
-- 'jobd.outbox:<sender>', or 'jobd.outbox' from daemons of before migration 0043) that
-- passes the entry's key to the sender, at least once.
CREATE TABLE outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key             text        NOT NULL UNIQUE,
    sender          text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}',
    source_job_id   bigint,
    delivery_job_id bigint      NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'delivered', 'dead')),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz
);
CREATE INDEX outbox_delivery_job_idx ON outbox (delivery_job_id);
CREATE INDEX outbox_created_at_idx ON outbox (created_at);

-- Records an outbox entry and its delivery job (handler 'jobd.outbox') in the caller's
-- transaction. A key already recorded returns the existing entry's id and adds nothing. Kept
-- for daemons of before migration 0043; later ones call outbox_add_for_sender.
CREATE FUNCTION outbox_add(
    key text, sender text, payload jsonb, lane text, source_job_id bigint DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    entry_id bigint;
    job_id   bigint := nextval('job_id_seq');
BEGIN
    INSERT INTO outbox AS o (key, sender, payload, source_job_id, delivery_job_id)
    VALUES (outbox_add.key, outbox_add.sender, coalesce(outbox_add.payload, '{}'),
            outbox_add.source_job_id, job_id)
    ON CONFLICT DO NOTHING
    RETURNING o.id INTO entry_id;
    IF entry_id IS NULL THEN
        SELECT o.id INTO entry_id FROM outbox AS o WHERE o.key = outbox_add.key;
        RETURN entry_id;
    END IF;
    INSERT INTO jobs (id, lane, handler, payload, idempotency_key)
    VALUES (job_id, outbox_add.lane, 'jobd.outbox', jsonb_build_object('outbox_id', entry_id),
            'jobd:outbox:' || outbox_add.key);
    INSERT INTO job_keys (idempotency_key, job_id) VALUES ('jobd:outbox:' || outbox_add.key, job_id)
    ON CONFLICT DO NOTHING;
    RETURN entry_id;
END
$$;

-- Records an outbox entry and its delivery job, of handler 'jobd.outbox:<sender>', in the
-- caller's transaction. A key already recorded returns the existing entry's id and adds
-- nothing.
CREATE FUNCTION outbox_add_for_sender(
    key text, sender text, payload jsonb, lane text, source_job_id bigint DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    entry_id bigint;
    job_id   bigint := nextval('job_id_seq');
BEGIN
    INSERT INTO outbox AS o (key, sender, payload, source_job_id, delivery_job_id)
    VALUES (outbox_add_for_sender.key, outbox_add_for_sender.sender,
            coalesce(outbox_add_for_sender.payload, '{}'),
            outbox_add_for_sender.source_job_id, job_id)
    ON CONFLICT DO NOTHING
    RETURNING o.id INTO entry_id;
    IF entry_id IS NULL THEN
        SELECT o.id INTO entry_id FROM outbox AS o WHERE o.key = outbox_add_for_sender.key;
        RETURN entry_id;
    END IF;
    INSERT INTO jobs (id, lane, handler, payload, idempotency_key)
    VALUES (job_id, outbox_add_for_sender.lane, 'jobd.outbox:' || outbox_add_for_sender.sender,
            jsonb_build_object('outbox_id', entry_id), 'jobd:outbox:' || outbox_add_for_sender.key);
    INSERT INTO job_keys (idempotency_key, job_id)
    VALUES ('jobd:outbox:' || outbox_add_for_sender.key, job_id)
    ON CONFLICT DO NOTHING;
    RETURN entry_id;
END
$$;

-- A delivery job that exhausted its attempts marks its entry dead (the job itself is in the
-- dead-letter queue with its error history; replaying it retries the delivery).
CREATE FUNCTION outbox_mark_dead() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox AS o SET state = 'dead', last_error = d.last_error
      FROM new_dead AS d
     WHERE (d.handler = 'jobd.outbox' OR starts_with(d.handler, 'jobd.outbox:'))
       AND o.delivery_job_id = d.id AND o.state = 'pending';
    RETURN NULL;
END
$$;

CREATE TRIGGER dead_letter_outbox AFTER INSERT ON dead_letter
    REFERENCING NEW TABLE AS new_dead
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_mark_dead();


-- ===========================================================================================
-- Metrics
-- ===========================================================================================

-- The metrics sampler's per-lane counts, shared by the fleet: a node uses the counts another
-- took within the sampling interval instead of counting the backlog again. UNLOGGED: a cache
-- of what can be counted again (empty after a crash of the server).
CREATE UNLOGGED TABLE queue_samples (
    lane                 text        PRIMARY KEY,
    due                  bigint      NOT NULL,
    scheduled            bigint      NOT NULL,
    retrying             bigint      NOT NULL,
    claimed              bigint      NOT NULL,
    dead                 bigint      NOT NULL,
    oldest_unclaimed_age float8      NOT NULL,
    taken_at             timestamptz NOT NULL
);


-- ===========================================================================================
-- Roles
-- ===========================================================================================

-- The owner (whoever runs `jobd migrate`) owns every object. The roles granted with `jobd
-- migrate --grant-runtime ROLE` / `--grant-producer ROLE`, granted again by every later run
-- so that what a later migration adds reaches them.
CREATE TABLE role_grants (
    role       name        NOT NULL,
    kind       text        NOT NULL CHECK (kind IN ('runtime', 'producer')),
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role, kind)
);

-- enqueue and the archive partition maintenance run as the owner: a producer needs no table
-- privilege to enqueue, the daemon no DDL privilege for its hourly maintenance. search_path
-- pinned with pg_temp last, so no caller's temporary table stands in for one of jobd's.
DO $$
DECLARE
    schema_oid oid := (SELECT n.oid FROM pg_namespace AS n WHERE n.nspname = current_schema());
    fn         regprocedure;
BEGIN
    -- Every function that pins a search_path, not the three alone: each one enqueue calls
    -- (check_job reads the payload limit from settings) would otherwise put pg_temp first
    -- again for its own statements.
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc AS p
               WHERE p.pronamespace = schema_oid
                 AND EXISTS (SELECT 1 FROM unnest(p.proconfig) AS c WHERE c LIKE 'search_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', fn, current_schema());
    END LOOP;
    ALTER FUNCTION enqueue(text, jsonb, text, timestamptz, integer, text, integer, text)
        SECURITY DEFINER;
    ALTER FUNCTION ensure_archive_partitions(integer) SECURITY DEFINER;
    ALTER FUNCTION drop_archive_partitions(timestamptz) SECURITY DEFINER;
END
$$;

-- A producer has USAGE on the schema (for enqueue); it must not run the archive's DDL.
REVOKE EXECUTE ON FUNCTION ensure_archive_partitions(integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drop_archive_partitions(timestamptz) FROM PUBLIC;
