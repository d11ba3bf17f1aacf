"""What the lane limits (``max_running``, ``rate``) cost the drain, and whether a binding rate
holds.

Usage::

    .venv/bin/python bench/limits_bench.py [--rounds N] [--jobs N] [--settings 2x10]
                                           [--only none,max_running,...]

It uses ``bench/daemon_bench.py``'s environment (a private throwaway cluster,
``synchronous_commit = on``, its no-op handlers and its daemon runner). Per round and per
contender it commits ``--jobs`` no-op jobs in one ``enqueue_many`` while the daemon idles and
measures jobs/s from the first handler start to the last ``finished_at``, as the daemon
benchmark's drain does. The contenders, all with the same workers x concurrency:

none
    no limits: the plain claim (``claim_jobs``).
max_running
    ``max_running`` far above what the workers can hold, so it never binds: the cost of the
    limited claim (the lane's budget lock, the count of claimed jobs) alone.
rate
    ``rate: {limit: 1000000, per: 1s}``, never binding: the cost of the token bucket.
both
    both of the above.
rate 2000/s
    ``rate: {limit: 2000, per: 1s}``, binding: the claims beyond the first bucketful per
    second since the first claim, from the archive's ``claimed_at`` (at most the limit).

Every contender claims ahead 3 x concurrency (``prefetch``; a lane with ``max_running``
defaults to 0), so that the figures differ by the limits alone. Rounds are interleaved.
Output: a table on stdout, one JSON line per contender and round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench import daemon_bench as bench
from bench.settings import parse_setting

LANE = bench.LANE
BINDING_RATE = 2000

CONTENDERS: dict[str, dict[str, Any]] = {
    "none": {},
    "max_running": {"max_running": 1_000_000},
    "rate": {"rate": {"limit": 1_000_000, "per": "1s"}},
    "both": {"max_running": 1_000_000, "rate": {"limit": 1_000_000, "per": "1s"}},
    f"rate {BINDING_RATE}/s": {"rate": {"limit": BINDING_RATE, "per": "1s"}},
}


def write_config(env: bench.Env, name: str, workers: int, concurrency: int,
                 limits: dict[str, Any]) -> Path:
    # The same prefetch for every contender (the default of a lane without max_running), so
    # that the figures differ by the limits alone.
    lane: dict[str, Any] = {"workers": workers, "concurrency": concurrency,
                            "prefetch": 3 * concurrency,
                            "visibility_timeout": f"{bench.VISIBILITY_TIMEOUT_S:g}s",
                            **limits}
    config = {"database": {"schema": bench.SCHEMA}, "node": {"name": "bench"},
              "supervisor": {"shutdown_timeout": "30s", "log_level": "info"},
              "handlers": {"noop": f"{bench.HANDLER_MODULE}:noop"},
              "lanes": {LANE: lane}}
    path = env.config_dir / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def achieved_rate(env: bench.Env, limit: int) -> float | None:
    """Claims per second beyond the first bucketful, from the first claim on: the bucket
    starts full and refills from then on, so this is at most the limit."""
    with env.bench_conn() as conn:
        rows = [row[0] for row in conn.execute(
            "SELECT extract(epoch FROM claimed_at)::float8 FROM jobd.jobs_archive"
            " ORDER BY claimed_at").fetchall()]
    if len(rows) <= limit:
        return None
    return (len(rows) - limit) / (rows[-1] - rows[0])


def measure(env: bench.Env, name: str, limits: dict[str, Any], workers: int,
            concurrency: int, jobs: int, round_no: int) -> dict[str, Any]:
    bench.reset_queue(env)
    with env.bench_conn() as conn:
        conn.execute("TRUNCATE jobd.lane_tokens")
    slug = name.replace(" ", "-").replace("/", "")
    stamps = env.scratch(f"limits-{slug}-{round_no}")
    config = write_config(env, f"limits-{slug}", workers, concurrency, limits)
    with bench.Daemon(env, config, stamps, workers=workers) as daemon:
        time.sleep(bench.DRAIN_SETTLE_S)
        with env.bench_conn() as conn:
            jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE) for _ in range(jobs)])
        bench.wait_drained(env, jobs, interval=0.05)
        problems = daemon.problems()
    _, firsts = bench.read_stamps(stamps)
    with env.bench_conn() as conn:
        row = conn.execute("SELECT extract(epoch FROM max(finished_at))::float8"
                           " FROM jobd.jobs_archive").fetchone()
    assert row is not None
    seconds = row[0] - min(firsts)
    result: dict[str, Any] = {"contender": name, "limits": limits, "workers": workers,
                              "concurrency": concurrency, "jobs": jobs, "round": round_no,
                              "seconds": round(seconds, 3), "jobs_per_s": jobs / seconds,
                              "daemon_warnings": len(problems)}
    rate = limits.get("rate", {}).get("limit")
    if rate is not None and rate < jobs:
        result["claims_per_s_after_the_first_bucket"] = achieved_rate(env, rate)
    bench.log(f"{name} round {round_no}: {result['jobs_per_s']:,.0f} jobs/s ({seconds:.2f}s)")
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per contender (3)")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per drain (20000)")
    parser.add_argument("--settings", default="2x10",
                        help="workers x concurrency of the lane (default 2x10)")
    parser.add_argument("--only", default=",".join(CONTENDERS),
                        help="comma-separated contenders (default: all of "
                             + ", ".join(CONTENDERS) + ")")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args(argv)
    try:
        args.settings = parse_setting(args.settings)
    except ValueError as exc:
        parser.error(f"--settings: {exc}")
    args.only = [name.strip() for name in args.only.split(",")]
    unknown = sorted(set(args.only) - set(CONTENDERS))
    if unknown:
        parser.error(f"--only: unknown contenders {', '.join(unknown)}; choose from "
                     + ", ".join(CONTENDERS))
    if min(args.rounds, args.jobs) < 1:
        parser.error("--rounds and --jobs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workers, concurrency = args.settings.workers, args.settings.concurrency
    chosen = args.only
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    with bench.environment(statements=False, keep=args.keep) as env:
        print(f"server {env.settings['server_version']}, synchronous_commit "
              f"{env.settings['synchronous_commit']}, lane {workers}x{concurrency}, "
              f"{args.jobs} jobs, {args.rounds} round(s)")
        # Interleaved rounds, so that other load on the machine spreads over all contenders.
        for round_no in range(1, args.rounds + 1):
            for name in chosen:
                results[name].append(measure(env, name, CONTENDERS[name], workers,
                                             concurrency, args.jobs, round_no))
    print(f"{'contender':<16} {'median jobs/s':>14} {'rounds':>30}  achieved claims/s")
    for name, runs in results.items():
        rates = [run["jobs_per_s"] for run in runs]
        achieved = [run.get("claims_per_s_after_the_first_bucket") for run in runs]
        shown = ", ".join(f"{value:,.0f}" for value in rates)
        extra = ", ".join(f"{value:,.0f}" for value in achieved if value is not None)
        print(f"{name:<16} {statistics.median(rates):>14,.0f} {shown:>30}  {extra}")
    for runs in results.values():
        for run in runs:
            print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
