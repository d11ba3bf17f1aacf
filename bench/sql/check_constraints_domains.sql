-- For bench/check_constraints.py: jobs's rules of single columns as domains instead of table
-- CHECK constraints (the lease rule, over three columns, stays a table constraint). Run with
-- search_path set to a freshly migrated jobd schema; names are unqualified, as in the
-- migrations. Not a migration: jobd's tables keep the contract's column types
-- (docs/performance.md, "What a statement pays for jobs's CHECK constraints").
CREATE DOMAIN job_state AS text
    CONSTRAINT job_state_known CHECK (VALUE IN ('pending', 'claimed', 'failed'));
CREATE DOMAIN job_attempts AS integer
    CONSTRAINT job_attempts_not_negative CHECK (VALUE >= 0);
CREATE DOMAIN job_max_attempts AS integer
    CONSTRAINT job_max_attempts_positive CHECK (VALUE > 0);
CREATE DOMAIN job_run_at AS timestamptz
    CONSTRAINT job_run_at_range
        CHECK (VALUE >= '1970-01-01 00:00:00+00' AND VALUE < '9999-01-01 00:00:00+00');

-- all_jobs reads the columns: set aside while their types change, then made again as it was.
CREATE TEMP TABLE all_jobs_definition AS SELECT pg_get_viewdef('all_jobs'::regclass) AS body;
DROP VIEW all_jobs;
ALTER TABLE jobs
    DROP CONSTRAINT jobs_state_check,
    DROP CONSTRAINT jobs_attempts_check,
    DROP CONSTRAINT jobs_max_attempts_check,
    DROP CONSTRAINT jobs_run_at_range,
    ALTER COLUMN state TYPE job_state,
    ALTER COLUMN attempts TYPE job_attempts,
    ALTER COLUMN max_attempts TYPE job_max_attempts,
    ALTER COLUMN run_at TYPE job_run_at;
DO $$
BEGIN
    EXECUTE 'CREATE VIEW all_jobs AS ' || (SELECT body FROM all_jobs_definition);
END
$$;
DROP TABLE all_jobs_definition;
