-- A schedule whose expression or zone changed (a reload, a rolling deploy) kept its cursor,
-- the instant of its last fire, and the first tick under the new definition fired every
-- occurrence of the new expression since then as missed: changing '0 3 * * *' to
-- '*/5 * * * *' (catchup: all) at 14:00 enqueued 100 jobs at once, and with catchup: latest a
-- new '0 12 * * *' fired at once. Those occurrences never were due. reconcile_schedule now
-- moves the cursor to the moment of the change when the expression or the zone changes (as
-- enabling a schedule does); a change of anything else keeps it.
CREATE OR REPLACE FUNCTION reconcile_schedule(
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION reconcile_schedule(text, timestamptz, boolean) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$$;
