-- Arming in two transactions (migration 0020), which arm_waiter above did in one: it held
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
--    'work' (a due job above the floors; the worker's row is removed, the worker claims) or
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

CREATE FUNCTION arm_waiter_probe(lane text, worker_id text, floor_priorities integer[],
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
    paused_handlers text[] := ARRAY(SELECT p.handler FROM lane_pauses AS p
                                     WHERE p.lane = arm_waiter_probe.lane
                                       AND p.handler IS NOT NULL);
BEGIN
    FOR level, floor_at, floor_id IN
        SELECT l.priority, l.floor_at, l.floor_id
          FROM lane_floors(arm_waiter_probe.lane, floor_priorities, floor_run_ats, floor_ids,
                           floor_ages, default_floor_age, now()) AS l
    LOOP
        IF EXISTS (SELECT 1 FROM jobs AS j
                    WHERE j.lane = arm_waiter_probe.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
                      AND j.run_at <= now() AND NOT j.suspect
                      AND runnable(j.handler, paused_handlers)) THEN
            DELETE FROM lane_waiters AS w WHERE w.worker_id = arm_waiter_probe.worker_id;
            RETURN 'work';
        END IF;
    END LOOP;
    RETURN 'armed';
END
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION arm_waiter_register(text, text) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION arm_waiter_probe(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8) SET search_path = %I, pg_temp', current_schema());
END
$$;
