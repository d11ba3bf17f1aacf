-- Least privilege: the role that runs `jobd migrate` owns every object; the daemon and the
-- CLI may run as a runtime role that has only data privileges (no DDL, no ownership), and
-- producers as a role that can only call enqueue (`jobd migrate --grant-runtime ROLE
-- --grant-producer ROLE`; docs/operations.md, "Roles").
--
-- The roles granted so far. Every later `jobd migrate` grants them again, so the tables and
-- functions a later migration adds reach them without anyone remembering to re-grant.
CREATE TABLE role_grants (
    role       name        NOT NULL,
    kind       text        NOT NULL CHECK (kind IN ('runtime', 'producer')),
    granted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role, kind)
);

-- enqueue runs as the owner, so a producer needs no privilege on any table: it can add jobs
-- through the function's checks and nothing else (a grant of INSERT on jobs would also let it
-- write any state, attempt count or lease, and SELECT would show it other producers'
-- payloads). The archive partitions are created and dropped the same way, so the daemon's
-- hourly maintenance needs no DDL privilege. Each pins its search_path with pg_temp last: a
-- caller's temporary table named like one of jobd's tables must not stand in for it (a
-- search_path that does not name pg_temp searches it first).
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

-- EXECUTE is granted to PUBLIC by default, and a producer has USAGE on the schema for enqueue:
-- without this it could drop the whole archive with drop_archive_partitions('infinity').
-- enqueue keeps PUBLIC's grant, as before: USAGE on the schema is what admits a caller.
REVOKE EXECUTE ON FUNCTION ensure_archive_partitions(integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drop_archive_partitions(timestamptz) FROM PUBLIC;
