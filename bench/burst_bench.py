"""A burst enqueued in bulk beside a trickle of single enqueues: how soon it starts, and how
many workers drain it.

Usage (from the repository root)::

    .venv/bin/python -m bench.burst_bench                      # 2 x 10, 3 rounds, ~1 minute
    .venv/bin/python -m bench.burst_bench --setting 4x100 --rounds 5

It uses ``bench.daemon_bench``'s private cluster, config and handlers. Each round runs the
daemon (one lane, W worker processes x concurrency C, default 2 x 10) twice:

idle
    Nothing else runs; 20,000 ``stamp`` jobs go in with one ``jobd.enqueue_many`` (one COPY,
    one transaction).
trickle
    A producer sends single ``jobd.enqueue`` calls into the same lane at 400 jobs/s from 4
    autocommit connections (the standing load of ``bench/pressure.py``), starting 4 s before
    the same burst and going on until the burst is done.

Per burst it prints: the delay from the burst's commit to its first claim, the same for each
worker process that took part (its first claim of the burst), how many took part, and the
drain rate from the first claim to the last finish. Both instants are the server's: the
commit's is its commit timestamp (``track_commit_timestamp``, set on the private cluster),
taken before the commit's WAL flush, so the delay includes that flush, during which the
burst is not yet visible; a claim's is its statement's ``now()`` (the lease expiry less the
lease length). The client's own instant, taken when the commit's answer arrived, came up to
8 ms late on two cores, where the workers the commit woke ran ahead of this process: first
claims then read as before the commit.

Both modes should read alike: a worker whose claim floors sat above the burst (a trickle job
claimed while the burst's transaction was open has a later ``run_at`` than the burst's) left
it for its next scan from the head, up to a second later (docs/design/queue.md, "Claim
floors").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import (
    LANE,
    SCHEMA,
    VISIBILITY_TIMEOUT_S,
    Daemon,
    Env,
    environment,
    log,
    reset_queue,
    write_config,
)
from jobd.db import connect

BURST_JOBS = 20_000
TRICKLE_RATE = 400.0  # jobs/s, all connections together
TRICKLE_CONNECTIONS = 4
TRICKLE_LEAD_S = 4.0
SETTLE_S = 2.0
BURST_TIMEOUT_S = 120.0


class Trickle(threading.Thread):
    """Single ``jobd.enqueue`` calls on a fixed schedule, one connection per thread."""

    def __init__(self, env: Env) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._send, daemon=True)
                        for _ in range(TRICKLE_CONNECTIONS)]

    def run(self) -> None:
        for thread in self.threads:
            thread.start()
        for thread in self.threads:
            thread.join()

    def _send(self) -> None:
        interval = TRICKLE_CONNECTIONS / TRICKLE_RATE
        try:
            with connect(self.env.url, SCHEMA, application_name="burst-bench-trickle") as conn:
                due = time.monotonic()
                while not self.stop_event.is_set():
                    jobd.enqueue(conn, "noop", lane=LANE)
                    due += interval
                    time.sleep(max(0.0, due - time.monotonic()))
        except BaseException as exc:  # reported by finish(): a dead producer voids the round
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop_event.set()
        self.join()
        if self.errors:
            raise RuntimeError(f"the trickle producer failed: {self.errors[0]!r}")


def enqueue_burst(conn: psycopg.Connection) -> tuple[list[int], float]:
    """The burst in one transaction; its ids and the database's commit instant (epoch s).

    The instant is the server's own (``track_commit_timestamp``): the client's, taken when the
    commit's answer arrived, came up to 8 ms late on two cores, where the workers the commit
    woke ran ahead of this process."""
    with conn.transaction():
        row = conn.execute("SELECT pg_current_xact_id()::xid::text").fetchone()
        assert row is not None
        ids = jobd.enqueue_many(conn, [jobd.JobSpec("stamp", {}, LANE)] * BURST_JOBS)
    row = conn.execute("SELECT extract(epoch FROM pg_xact_commit_timestamp(%s::xid))::float8",
                       (row[0],)).fetchone()
    assert row is not None and row[0] is not None, "track_commit_timestamp is off"
    return ids, float(row[0])


def claims_by_process(stamps: Path, ids: set[int]) -> dict[str, list[tuple[float, float]]]:
    """Worker process -> (claim time, start time) of each burst job it ran."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for path in stamps.glob("starts-*.txt"):
        for line in path.read_text().splitlines():
            key, *values = line.split()
            if key != "first" and int(key) in ids:
                runs.setdefault(path.stem, []).append(
                    (float(values[1]) - VISIBILITY_TIMEOUT_S, float(values[0])))
    return runs


def wait_done(env: Env, ids: list[int]) -> float:
    """Until every burst job is archived; returns the epoch of the last finish."""
    deadline = time.monotonic() + BURST_TIMEOUT_S
    with env.bench_conn() as conn:
        while True:
            row = conn.execute("SELECT count(*), extract(epoch FROM max(finished_at))::float8 "
                               "FROM jobd.jobs_archive WHERE id = ANY(%s)", (ids,)).fetchone()
            assert row is not None
            if row[0] == len(ids):
                return float(row[1])
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(ids) - row[0]} burst jobs not done after "
                                   f"{BURST_TIMEOUT_S:g}s")
            time.sleep(0.05)


def measure(env: Env, workers: int, concurrency: int, trickle: bool,
            round_no: int) -> dict[str, Any]:
    mode = "trickle" if trickle else "idle"
    reset_queue(env)
    stamps = env.scratch(f"burst-{mode}-{round_no}")
    config = write_config(env, "burst", {LANE: (workers, concurrency)})
    with Daemon(env, config, stamps, workers=workers) as daemon:
        time.sleep(SETTLE_S)
        producer = Trickle(env) if trickle else None
        if producer is not None:
            producer.start()
            time.sleep(TRICKLE_LEAD_S)
        try:
            with env.bench_conn() as conn:
                ids, committed = enqueue_burst(conn)
            last_finish = wait_done(env, ids)
        finally:
            if producer is not None:
                producer.finish()
        problems = daemon.problems()
    runs = claims_by_process(stamps, set(ids))
    if sum(len(r) for r in runs.values()) != len(ids):
        raise RuntimeError("a burst job has no recorded start")
    firsts = sorted(min(claim for claim, _start in r) - committed for r in runs.values())
    first_claim = committed + firsts[0]
    result = {"mode": mode, "workers": workers, "concurrency": concurrency,
              "jobs": len(ids), "pickup_delay_ms": round(1000.0 * firsts[0], 1),
              "worker_first_claims_ms": [round(1000.0 * f, 1) for f in firsts],
              "workers_that_took_part": len(runs),
              "jobs_per_s": round(len(ids) / (last_finish - first_claim), 1),
              "daemon_warnings": len(problems)}
    log(f"{mode} round {round_no}: {result['jobs_per_s']:,.0f} jobs/s; first claim "
        f"{result['pickup_delay_ms']:.1f} ms after the commit; workers' first claims (ms) "
        f"{result['worker_first_claims_ms']}")
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A 20,000-job bulk enqueue into an idle lane and beside a 400 jobs/s "
                    "trickle: pickup delay, workers that take part, drain rate.")
    parser.add_argument("--setting", default="2x10", metavar="WxC",
                        help="worker processes x concurrency (default 2x10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (daemon logs, stamps, cluster)")
    args = parser.parse_args(argv)
    try:
        args.workers, args.concurrency = (int(n) for n in args.setting.split("x"))
    except ValueError:
        parser.error(f"--setting: expected WxC such as 2x10: {args.setting!r}")
    if min(args.workers, args.concurrency, args.rounds) < 1:
        parser.error("--setting and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {"idle": [], "trickle": []}
    with environment(statements=False, keep=args.keep,
                     settings={"track_commit_timestamp": "on"}) as env:
        print(f"burst benchmark: {BURST_JOBS:,} jobs by enqueue_many, {args.workers} x "
              f"{args.concurrency}, trickle {TRICKLE_RATE:g} jobs/s from "
              f"{TRICKLE_CONNECTIONS} connections; PostgreSQL "
              f"{env.settings['server_version']}, synchronous_commit="
              f"{env.settings['synchronous_commit']}; jobd {jobd.__version__}", flush=True)
        for r in range(args.rounds):
            # Alternate which mode goes first, so drift does not favour one.
            for trickle in ((False, True) if r % 2 == 0 else (True, False)):
                result = measure(env, args.workers, args.concurrency, trickle, r + 1)
                results[result["mode"]].append(result)
    print(f"{'mode':8} {'drain jobs/s (median, min-max)':>32} {'first claim ms (max)':>22} "
          f"{'last worker in ms (max)':>24} {'workers':>8}")
    for mode, rs in results.items():
        rates = [r["jobs_per_s"] for r in rs]
        print(f"{mode:8} {statistics.median(rates):>14,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
              f"{'':4} {statistics.median(r['pickup_delay_ms'] for r in rs):>12.1f} "
              f"({max(r['pickup_delay_ms'] for r in rs):.1f})"
              f"{statistics.median(r['worker_first_claims_ms'][-1] for r in rs):>16.1f} "
              f"({max(r['worker_first_claims_ms'][-1] for r in rs):.1f})"
              f"{min(r['workers_that_took_part'] for r in rs):>6}-"
              f"{max(r['workers_that_took_part'] for r in rs)}")
    for rs in results.values():
        for r in rs:
            print(json.dumps({"benchmark": "burst", **r}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except psycopg.Error as exc:
        sys.exit(f"burst benchmark: {exc}")
