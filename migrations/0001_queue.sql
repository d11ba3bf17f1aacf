-- The queue core: live jobs, the time-partitioned archive, the dead-letter queue, the
-- idempotency-key ledger, enqueue functions and the wake-up notification.
--
-- The migration runner sets search_path to the target schema (jobd unless overridden), so
-- every name here is unqualified; functions capture that schema with SET search_path FROM CURRENT.

CREATE SEQUENCE job_id_seq AS bigint;

-- Every claim draws one value; a worker must present it for every later write to the job
-- (heartbeat, complete, fail), so a worker whose lease was lost cannot touch the job again.
CREATE SEQUENCE lease_token_seq AS bigint;

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
    CHECK ((state = 'claimed') = (lease_until IS NOT NULL AND lease_token IS NOT NULL))
);
ALTER SEQUENCE job_id_seq OWNED BY jobs.id;

-- The hottest query: due jobs of one lane by priority, then run_at. Only claimable rows are
-- indexed, so the index is as small as the backlog however much history exists.
CREATE INDEX jobs_claimable_idx ON jobs (lane, priority DESC, run_at)
    WHERE state IN ('pending', 'failed');

-- The lease-expiry sweep and crash attribution read only claimed rows.
CREATE INDEX jobs_lease_idx ON jobs (lease_until) WHERE state = 'claimed';

-- A queue table churns: every job is inserted, updated and deleted within seconds. Vacuum it
-- early and without throttling so dead index entries don't slow the claim scan.
ALTER TABLE jobs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Finished jobs, partitioned by day of finished_at: retention drops a partition.
CREATE TABLE jobs_archive (
    id              bigint      NOT NULL,
    lane            text        NOT NULL,
    handler         text        NOT NULL,
    payload         jsonb       NOT NULL,
    state           text        NOT NULL CHECK (state = 'done'),
    priority        integer     NOT NULL,
    run_at          timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    max_attempts    integer,
    claimed_by      text,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    last_error      text,
    errors          jsonb       NOT NULL,
    finished_at     timestamptz NOT NULL
) PARTITION BY RANGE (finished_at);

CREATE INDEX jobs_archive_id_idx ON jobs_archive (id);

-- Catches rows whose day has no partition yet, so finishing a job can never fail for lack of
-- one. ensure_archive_partitions() moves such rows into the real partition when it creates it.
CREATE TABLE jobs_archive_default PARTITION OF jobs_archive DEFAULT;

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
    died_at         timestamptz NOT NULL DEFAULT now()
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
CREATE INDEX job_keys_created_at_idx ON job_keys (created_at);

-- Every job, live or finished, with its state.
CREATE VIEW all_jobs AS
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           lease_until, claimed_by, idempotency_key, created_at, last_error, errors,
           NULL::timestamptz AS finished_at
      FROM jobs
    UNION ALL
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           finished_at
      FROM jobs_archive
    UNION ALL
    SELECT id, lane, handler, payload, 'dead', priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           died_at
      FROM dead_letter;

-- Wake the lanes that received work, once per lane and statement (a bulk insert of 20,000
-- rows sends one notification per lane, not 20,000). The payload is 'lane#<n>' when n of the
-- new jobs are due now (so the listener wakes as many workers as that needs), else
-- 'lane@<epoch seconds>' of the earliest one, so it can wake the lane at that instant instead
-- of polling for it. The channel carries the schema name so several jobd schemas can share
-- a database.
CREATE FUNCTION notify_new_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup',
                      CASE WHEN due > 0 THEN lane || '#' || due
                           ELSE lane || '@' || extract(epoch FROM first_run_at)::text END)
       FROM (SELECT lane, min(run_at) AS first_run_at,
                    count(*) FILTER (WHERE run_at <= now()) AS due
               FROM new_jobs GROUP BY lane) AS lanes;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION notify_new_jobs();

-- One committed INSERT enqueues a job. With an idempotency key, the key ledger decides: the
-- first caller inserts the job, every later caller gets the first job's id back, even after
-- that job finished and was archived.
CREATE FUNCTION enqueue(
    handler         text,
    payload         jsonb       DEFAULT '{}',
    lane            text        DEFAULT 'default',
    run_at          timestamptz DEFAULT now(),
    priority        integer     DEFAULT 0,
    idempotency_key text        DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    new_id bigint;
BEGIN
    IF enqueue.handler IS NULL OR enqueue.lane IS NULL THEN
        RAISE EXCEPTION 'jobd.enqueue: handler and lane must not be null'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Keys starting with 'jobd:' name jobd's own jobs (schedule occurrences, outbox
    -- deliveries, keys derived from job ids); a caller's key must not collide with them.
    IF starts_with(enqueue.idempotency_key, 'jobd:') THEN
        RAISE EXCEPTION 'jobd.enqueue: idempotency keys starting with ''jobd:'' are reserved'
            USING ERRCODE = 'invalid_parameter_value';
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
    INSERT INTO jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts)
         VALUES (new_id, enqueue.lane, enqueue.handler, coalesce(enqueue.payload, '{}'),
                 coalesce(enqueue.priority, 0), coalesce(enqueue.run_at, now()),
                 enqueue.idempotency_key, enqueue.max_attempts);
    RETURN new_id;
END
$$;

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

-- Retention: drop whole archive partitions that end at or before the cutoff, and forget the
-- idempotency keys of jobs created before it. Returns the number of partitions dropped.
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
    DELETE FROM job_keys k
     WHERE k.created_at < cutoff
       AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = k.job_id)
       AND NOT EXISTS (SELECT 1 FROM dead_letter d WHERE d.id = k.job_id);
    RETURN dropped;
END
$$;

