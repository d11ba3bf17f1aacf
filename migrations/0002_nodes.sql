-- Live supervisors: each writes its row every duty tick, so `jobd status` can show live
-- workers per node and claim/failure rates without asking the nodes themselves.

CREATE TABLE nodes (
    instance        text        PRIMARY KEY,      -- node name, pid and a random suffix
    node            text        NOT NULL,
    pid             integer     NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    seen_at         timestamptz NOT NULL DEFAULT now(),
    -- {"lane": number of live workers}
    workers         jsonb       NOT NULL DEFAULT '{}',
    -- {"lane": {"claimed": n, "completed": n, "failed": n, "dead": n}}, totals since start;
    -- the previous sample is kept so rates need only this row.
    counters        jsonb       NOT NULL DEFAULT '{}',
    prev_counters   jsonb       NOT NULL DEFAULT '{}',
    prev_seen_at    timestamptz
);
