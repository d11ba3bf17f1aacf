-- SQL's jobd.enqueue took a number with a fraction beyond a float's range (a 401-digit number
-- with .5, say), which Python's json, the workers' decoder, reads as infinity: the handler got
-- inf, not the value enqueued, and `jobd --json jobs show` printed Infinity, which is not JSON.
-- The CLI and the Python API refuse such numbers (a Python float cannot hold one); check_job
-- now does too. Same signature: jobd.enqueue calls it unchanged. The rule costs nothing more:
-- one walk of the payload still finds the numbers out of range (the bound is a constant
-- of the path, read once per session).

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
    -- The limits are what the workers' decoder (Python's json) can read back as written:
    -- nesting below its recursion limit, integers below its 4300-digit limit, and a number
    -- with a fraction within a float's range (from 2**1024 - 2**970 on, Python reads it as
    -- infinity: migration 0041). One walk finds the numbers out of that range, which are
    -- rare; only then is each rule asked apart.
    IF jsonb_path_exists(check_job.payload, 'strict $.**{257}') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload is nested more than 256 levels deep'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_path_exists(check_job.payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 || @ <= -179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792))') THEN
        IF jsonb_path_exists(check_job.payload,
                             'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
            RAISE EXCEPTION 'jobd.enqueue: payload holds a number of 4300 digits or more'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_path_exists(check_job.payload,
                             'strict $.** ? (@.type() == "number" && (@ >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 || @ <= -179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792) && @.floor() != @)') THEN
            RAISE EXCEPTION 'jobd.enqueue: payload holds a number beyond a float''s range that is not a whole number (it would be read as infinity)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
END
$$;
