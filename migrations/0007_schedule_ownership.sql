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

-- `enabled` is from now on the operator's flag (`jobd schedules disable/enable`) and no sync
-- writes it. Until now it only recorded that the last node to start did not configure the
-- schedule, which declarations now express, so no schedule starts out disabled.
UPDATE schedules SET enabled = true WHERE NOT enabled;

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
    UPDATE schedules AS sc
       SET cron = chosen->>'cron', timezone = chosen->>'timezone',
           handler = chosen->>'handler', lane = chosen->>'lane', payload = chosen->'payload',
           priority = (chosen->>'priority')::integer, catchup = chosen->>'catchup',
           overlap = chosen->>'overlap', updated_at = now()
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
