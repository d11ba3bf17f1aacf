-- The rules every job meets, whichever way it is enqueued (jobd/validation.py states them for
-- the Python API; this is the same set for the SQL function). Before this, jobd.enqueue
-- accepted names, keys, run_at values and payloads that the CLI refused, and some of them
-- (a year-10000 run_at, a payload no client can decode) broke readers or burnt a job's whole
-- retry budget.

-- Database-wide settings. max_payload_bytes: the largest payload, measured as JSON text.
-- `jobd migrate -c FILE` writes the config's limits.max_payload_bytes here.
CREATE TABLE settings (
    name  text  PRIMARY KEY,
    value jsonb NOT NULL
);
INSERT INTO settings (name, value) VALUES ('max_payload_bytes', '1048576');

-- Every reader can load run_at (Python's datetime ends at year 9999); the range also implies
-- a finite value, so the older constraint is subsumed.
ALTER TABLE jobs ADD CONSTRAINT jobs_run_at_range
    CHECK (run_at >= '1970-01-01 00:00:00+00' AND run_at < '9999-01-01 00:00:00+00') NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_run_at_range;
ALTER TABLE jobs DROP CONSTRAINT jobs_run_at_finite;

-- Raises invalid_parameter_value (22023) naming the first rule a job breaks. Shared by
-- jobd.enqueue and by the bulk path's size check.
CREATE FUNCTION check_job(
    handler text, lane text, payload jsonb, run_at timestamptz, idempotency_key text,
    max_attempts integer
) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    name_rule constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$';
BEGIN
    IF check_job.handler IS NULL OR check_job.handler !~ name_rule THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid handler name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.handler), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.lane IS NULL OR check_job.lane !~ name_rule THEN
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
    PERFORM check_payload_size(octet_length(check_job.payload::text));
    -- Both limits are what the workers' decoder (Python's json) can read back: nesting
    -- below its recursion limit, integers below its 4300-digit limit.
    IF jsonb_path_exists(check_job.payload, 'strict $.**{257}') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload is nested more than 256 levels deep'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_path_exists(check_job.payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload holds a number of 4300 digits or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- The payload size limit alone, for the bulk path: the client measures its largest payload and
-- asks in the statement that reserves the batch's ids.
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

CREATE OR REPLACE FUNCTION enqueue(
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
    PERFORM check_job(enqueue.handler, enqueue.lane, enqueue.payload, enqueue.run_at,
                      enqueue.idempotency_key, enqueue.max_attempts);
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
         VALUES (new_id, enqueue.lane, enqueue.handler, enqueue.payload,
                 coalesce(enqueue.priority, 0), coalesce(enqueue.run_at, now()),
                 enqueue.idempotency_key, enqueue.max_attempts);
    RETURN new_id;
END
$$;
