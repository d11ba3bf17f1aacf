-- Recurring schedules: the definitions synced from the config, and the fire ledger that makes
-- every occurrence produce at most one job however many materializers compute it.

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
    -- A schedule removed from the config is disabled, not deleted: its ledger and cursor stay.
    enabled             boolean     NOT NULL DEFAULT true,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- Occurrences at or before this instant have been dealt with (fired or skipped).
    materialized_until  timestamptz NOT NULL DEFAULT now(),
    last_fire_at        timestamptz,
    last_job_id         bigint
);

-- One row per occurrence ever dealt with. The primary key is the deduplication: two nodes
-- computing the same occurrence race on this insert, and the loser inserts no job.
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
