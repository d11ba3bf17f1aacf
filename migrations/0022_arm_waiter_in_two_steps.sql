-- arm_waiter, kept for daemons of releases before migration 0020, as 0020's two steps in one
-- transaction instead of the body 0011 gave it: one arming protocol, spelled once (0020 itself
-- shipped without this and is not edited after it was applied).
CREATE OR REPLACE FUNCTION arm_waiter(lane text, worker_id text, floor_priorities integer[],
                           floor_run_ats timestamptz[], floor_ids bigint[],
                           floor_ages float8[], default_floor_age float8)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    registered text := arm_waiter_register(arm_waiter.lane, arm_waiter.worker_id);
BEGIN
    IF registered <> 'registered' THEN
        RETURN registered;
    END IF;
    RETURN arm_waiter_probe(arm_waiter.lane, arm_waiter.worker_id, floor_priorities,
                            floor_run_ats, floor_ids, floor_ages, default_floor_age);
END
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION arm_waiter(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8) SET search_path = %I, pg_temp', current_schema());
END
$$;
