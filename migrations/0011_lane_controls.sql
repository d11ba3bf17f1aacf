-- Lane controls, what operators reach for during an incident (docs/design/queue.md, "Pause
-- and resume", "Cancelling jobs", "Quarantine"):
--
-- 1. Pause and resume a lane, or one handler in a lane, on every node at once: a row in
--    lane_pauses, which the claim reads. A change notifies the lanes' supervisors, which tell
--    their workers to look again; the fallback poll notices a change that was missed.
-- 2. Cancel jobs: a pending or failed job is archived as 'cancelled' at once; a running one is
--    asked to stop (cancel_requested_at, which its worker learns at its next lease renewal)
--    and is archived as 'cancelled' however its run ends.
-- 3. Quarantine: every pending or failed job of a handler (optionally of one lane, or whose
--    payload contains given fields) moves to the dead-letter queue in one statement.
-- 4. Limits across nodes (max_running, rate): a token bucket per lane in lane_tokens, which
--    the claims of a limited lane update in turn (claim_jobs_limited in queries.sql).

-- ===========================================================================================
-- 1. Pauses
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
    name_rule constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$';
BEGIN
    IF check_name.value IS NOT NULL AND check_name.value !~ name_rule THEN
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

-- A worker of a paused lane does not arm: it waits, unarmed, for the resume ('paused'), so
-- enqueues into the lane do not notify meanwhile. Jobs of paused handlers are not work.
CREATE OR REPLACE FUNCTION arm_waiter(lane text, worker_id text, floor_priorities integer[],
                                      floor_run_ats timestamptz[], floor_ids bigint[],
                                      floor_ages float8[], default_floor_age float8)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    level integer;
    floor_at timestamptz;
    floor_id bigint;
    paused_handlers text[];
BEGIN
    IF EXISTS (SELECT 1 FROM lane_pauses AS p
                WHERE p.lane = arm_waiter.lane AND p.handler IS NULL) THEN
        RETURN 'paused';
    END IF;
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(arm_waiter.lane)) THEN
        RETURN 'contended';
    END IF;
    paused_handlers := ARRAY(SELECT p.handler FROM lane_pauses AS p
                              WHERE p.lane = arm_waiter.lane AND p.handler IS NOT NULL);
    -- This statement's snapshot is taken after the lock: it sees every job whose enqueue
    -- held the lock before.
    FOR level, floor_at, floor_id IN
        SELECT l.priority, l.floor_at, l.floor_id
          FROM lane_floors(arm_waiter.lane, floor_priorities, floor_run_ats, floor_ids,
                           floor_ages, default_floor_age, now()) AS l
    LOOP
        IF EXISTS (SELECT 1 FROM jobs AS j
                    WHERE j.lane = arm_waiter.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
                      AND j.run_at <= now() AND NOT j.suspect
                      AND runnable(j.handler, paused_handlers)) THEN
            RETURN 'work';
        END IF;
    END LOOP;
    INSERT INTO lane_waiters (worker_id, lane) VALUES (arm_waiter.worker_id, arm_waiter.lane)
        ON CONFLICT ON CONSTRAINT lane_waiters_pkey
        DO UPDATE SET lane = excluded.lane, armed_at = now();
    RETURN 'armed';
END
$$;

-- ===========================================================================================
-- 2. Cancelling jobs
-- ===========================================================================================

-- Set on a claimed job that was asked to stop (cancel()). The heartbeat returns it to the
-- job's worker, which tells the handler; the statements that finish the job (complete_jobs,
-- fail_jobs) then archive it as 'cancelled', whatever the run's outcome. Adding a column
-- without a default rewrites nothing.
ALTER TABLE jobs ADD COLUMN cancel_requested_at timestamptz;

-- Cancelled jobs are archived like done ones. NOT VALID: every row so far is 'done', and
-- validating would scan the whole archive while completions wait for the lock (validate it
-- later, without blocking them: ALTER TABLE jobd.jobs_archive VALIDATE CONSTRAINT
-- jobs_archive_state_check). New rows and new partitions are checked either way.
ALTER TABLE jobs_archive DROP CONSTRAINT jobs_archive_state_check,
    ADD CONSTRAINT jobs_archive_state_check CHECK (state IN ('done', 'cancelled')) NOT VALID;

CREATE OR REPLACE VIEW all_jobs AS
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           lease_until, claimed_by, idempotency_key, created_at, last_error, errors,
           NULL::timestamptz AS finished_at, cancel_requested_at
      FROM jobs
    UNION ALL
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           finished_at, NULL::timestamptz
      FROM jobs_archive
    UNION ALL
    SELECT id, lane, handler, payload, 'dead', priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           died_at, NULL::timestamptz
      FROM dead_letter;

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
                                       claimed_at)
        SELECT g.id, g.lane, g.handler, g.payload, 'cancelled', g.priority, g.run_at,
               g.attempts, g.max_attempts, g.claimed_by, g.idempotency_key, g.created_at,
               g.last_error, g.errors || jsonb_build_object('cancelled_at', now()), now(),
               g.claimed_at
          FROM gone AS g
        RETURNING a.id
    )
    SELECT coalesce(array_agg(archived.id), '{}') INTO stopped FROM archived;
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

-- ===========================================================================================
-- 3. Quarantine
-- ===========================================================================================

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
                                      last_error, errors, died_at)
        SELECT m.id, m.lane, m.handler, m.payload, m.priority, m.run_at, m.attempts,
               m.max_attempts, m.claimed_by, m.idempotency_key, m.created_at, reason,
               m.errors || jsonb_build_object('quarantined_at', now(), 'reason', reason),
               now()
          FROM moved AS m
        RETURNING d.lane
    )
    SELECT b.lane, count(*) FROM buried AS b GROUP BY b.lane ORDER BY b.lane;
END
$$;

-- ===========================================================================================
-- 4. Limits across nodes: lanes.<l>.max_running and lanes.<l>.rate
-- ===========================================================================================

-- The token bucket of each lane with a rate (claim_jobs_limited), updated by every claim of
-- the lane in turn. UNLOGGED: the row changes on every claim and writes no WAL; after a
-- crash of the server the table is empty and each lane starts with a full bucket.
CREATE UNLOGGED TABLE lane_tokens (
    lane        text             PRIMARY KEY,
    tokens      double precision NOT NULL,
    refilled_at timestamptz      NOT NULL
);
