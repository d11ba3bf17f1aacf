-- A producer role could enqueue a job of the handler 'jobd.outbox' through jobd.enqueue: an
-- outbox delivery that no transactional handler recorded, which the worker's built-in handler
-- then ran, re-sending an entry whose delivery had died or sending a pending one early. Only
-- outbox_add, which inserts its delivery job itself, creates them now; check_job refuses the
-- name, as the Python API (validation.handler) and a config (no handler of its own so named)
-- do. Same signature: jobd.enqueue calls it unchanged.
CREATE OR REPLACE FUNCTION check_job(
    handler text, lane text, payload jsonb, run_at timestamptz, idempotency_key text,
    max_attempts integer, fairness_key text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql STABLE
-- No search_path of its own: enqueue, its one caller, pins one, and a function that sets
-- search_path costs each call a switch and a switch back (migration 0019).
AS $$
DECLARE
    name_chars constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]*$';
BEGIN
    IF check_job.handler IS NULL OR check_job.handler !~ name_chars
       OR octet_length(check_job.handler) > 128 THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid handler name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.handler), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The outbox's deliveries (validation.OUTBOX_HANDLER) come from outbox_add alone: a
    -- producer that could enqueue one would re-send an effect that died, or send one early.
    IF check_job.handler = 'jobd.outbox' THEN
        RAISE EXCEPTION 'jobd.enqueue: handler ''jobd.outbox'' is reserved for jobd''s outbox deliveries (a transactional handler''s outbox_add creates them)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.lane IS NULL OR check_job.lane !~ name_chars
       OR octet_length(check_job.lane) > 128 THEN
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
    -- The key is part of an index entry: bounded well below B-tree's entry size limit.
    IF check_job.fairness_key IS NOT NULL THEN
        IF check_job.fairness_key = '' THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key must be a non-empty string'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(check_job.fairness_key) > 256 THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key is % bytes; at most 256 are allowed',
                octet_length(check_job.fairness_key)
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
