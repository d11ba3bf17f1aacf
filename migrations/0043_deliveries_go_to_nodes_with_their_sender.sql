-- A delivery job's handler was 'jobd.outbox' whatever its sender, so every node with an
-- outbox lane claimed every delivery, including those of senders its config does not have
-- (a rolling deploy that adds a sender, two nodes with their own configs). Such a node ran
-- the delivery, failed it ("no outbox sender named ...") and spent an attempt each time:
-- with the other nodes busy or stopped, the entry went dead although a node could deliver
-- it. A delivery job's handler now names its sender, 'jobd.outbox:<sender>', and a node runs
-- only the senders it has (config.worker_handlers): a node without the sender gives the job
-- back with its attempt unspent and steps over that handler's jobs, as for any handler it
-- lacks (handler_filter.py).
--
-- outbox_add keeps its signature and its 'jobd.outbox' for daemons of before this migration
-- (a rolling upgrade: their deliveries stay with every node, as before); daemons of this
-- release call outbox_add_for_sender. The dead-letter trigger and check_job know both forms.

-- Records an outbox entry and its delivery job, of handler 'jobd.outbox:<sender>', in the
-- caller's transaction. A key already recorded returns the existing entry's id and adds
-- nothing.
CREATE FUNCTION outbox_add_for_sender(
    key text, sender text, payload jsonb, lane text, source_job_id bigint DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    entry_id bigint;
    job_id   bigint := nextval('job_id_seq');
BEGIN
    INSERT INTO outbox AS o (key, sender, payload, source_job_id, delivery_job_id)
    VALUES (outbox_add_for_sender.key, outbox_add_for_sender.sender,
            coalesce(outbox_add_for_sender.payload, '{}'),
            outbox_add_for_sender.source_job_id, job_id)
    ON CONFLICT DO NOTHING
    RETURNING o.id INTO entry_id;
    IF entry_id IS NULL THEN
        SELECT o.id INTO entry_id FROM outbox AS o WHERE o.key = outbox_add_for_sender.key;
        RETURN entry_id;
    END IF;
    INSERT INTO jobs (id, lane, handler, payload, idempotency_key)
    VALUES (job_id, outbox_add_for_sender.lane, 'jobd.outbox:' || outbox_add_for_sender.sender,
            jsonb_build_object('outbox_id', entry_id), 'jobd:outbox:' || outbox_add_for_sender.key);
    INSERT INTO job_keys (idempotency_key, job_id)
    VALUES ('jobd:outbox:' || outbox_add_for_sender.key, job_id)
    ON CONFLICT DO NOTHING;
    RETURN entry_id;
END
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION outbox_add_for_sender(text, text, jsonb, text, bigint) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$$;

-- A delivery job that exhausted its attempts marks its entry dead (the job itself is in the
-- dead-letter queue with its error history; replaying it retries the delivery).
CREATE OR REPLACE FUNCTION outbox_mark_dead() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox AS o SET state = 'dead', last_error = d.last_error
      FROM new_dead AS d
     WHERE (d.handler = 'jobd.outbox' OR starts_with(d.handler, 'jobd.outbox:'))
       AND o.delivery_job_id = d.id AND o.state = 'pending';
    RETURN NULL;
END
$$;

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
    -- The outbox's deliveries (validation.OUTBOX_HANDLER, and since migration 0043
    -- 'jobd.outbox:<sender>') come from outbox_add alone: a producer that could enqueue one
    -- would re-send an effect that died, or send one early.
    IF check_job.handler = 'jobd.outbox' OR starts_with(check_job.handler, 'jobd.outbox:') THEN
        RAISE EXCEPTION 'jobd.enqueue: handler % is reserved for jobd''s outbox deliveries (a transactional handler''s outbox_add creates them)',
            quote_literal(check_job.handler)
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
