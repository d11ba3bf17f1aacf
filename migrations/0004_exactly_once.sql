-- Exactly-once effect: the dedup store written by transactional handlers, and the outbox.

-- One row per idempotency key whose effect has committed. A transactional handler's writes,
-- this row and the job's completion commit together, so a replay of the key finds it and
-- does nothing.
CREATE TABLE processed_keys (
    idempotency_key text        PRIMARY KEY,
    job_id          bigint      NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX processed_keys_processed_at_idx ON processed_keys (processed_at);

-- Intent to cause an effect outside PostgreSQL (an email, an API call), recorded in the
-- handler's transaction and delivered afterwards by a delivery job (handler 'jobd.outbox')
-- that passes the entry's key to the sender, at least once.
CREATE TABLE outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key             text        NOT NULL UNIQUE,
    sender          text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}',
    source_job_id   bigint,
    delivery_job_id bigint      NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'delivered', 'dead')),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz
);
CREATE INDEX outbox_delivery_job_idx ON outbox (delivery_job_id);
CREATE INDEX outbox_created_at_idx ON outbox (created_at);

-- Records an outbox entry and its delivery job in the caller's transaction. A key already
-- recorded returns the existing entry's id and adds nothing.
CREATE FUNCTION outbox_add(
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
    VALUES (outbox_add.key, outbox_add.sender, coalesce(outbox_add.payload, '{}'),
            outbox_add.source_job_id, job_id)
    ON CONFLICT DO NOTHING
    RETURNING o.id INTO entry_id;
    IF entry_id IS NULL THEN
        SELECT o.id INTO entry_id FROM outbox AS o WHERE o.key = outbox_add.key;
        RETURN entry_id;
    END IF;
    INSERT INTO jobs (id, lane, handler, payload, idempotency_key)
    VALUES (job_id, outbox_add.lane, 'jobd.outbox', jsonb_build_object('outbox_id', entry_id),
            'jobd:outbox:' || outbox_add.key);
    INSERT INTO job_keys (idempotency_key, job_id) VALUES ('jobd:outbox:' || outbox_add.key, job_id)
    ON CONFLICT DO NOTHING;
    RETURN entry_id;
END
$$;

-- A delivery job that exhausted its attempts marks its entry dead (the job itself is in the
-- dead-letter queue with its error history; replaying it retries the delivery).
CREATE FUNCTION outbox_mark_dead() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE outbox AS o SET state = 'dead', last_error = d.last_error
      FROM new_dead AS d
     WHERE d.handler = 'jobd.outbox' AND o.delivery_job_id = d.id AND o.state = 'pending';
    RETURN NULL;
END
$$;

CREATE TRIGGER dead_letter_outbox AFTER INSERT ON dead_letter
    REFERENCING NEW TABLE AS new_dead
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_mark_dead();
