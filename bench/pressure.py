"""The pressure benchmark: jobd under the conditions that hurt PostgreSQL queues.

Usage (from the repository root)::

    .venv/bin/python bench/pressure.py                     # every scenario, about 20 minutes
    .venv/bin/python bench/pressure.py --quick             # 20 s phases, a few minutes
    .venv/bin/python bench/pressure.py --scenarios baseline,idle_in_tx
    python -m bench.pressure --duration 90 --rate 400 --producers 4

It starts a throwaway PostgreSQL cluster (``jobd.localpg.throwaway_cluster``: a free port, a
temp directory, removed at the end) with ``synchronous_commit=on`` and ``pg_stat_statements``,
and otherwise the server's defaults unless ``--server-setting NAME=VALUE`` says otherwise.
Each scenario gets a database of its own, migrated with ``jobd migrate``, and a daemon of its
own, ``jobd run -c CONFIG`` with one lane of 2 workers x concurrency 10 and the no-op handler
``bench.pressure_handlers:noop`` (this repository on ``PYTHONPATH``). The benchmark talks to
jobd only through its public surface: those two commands, ``SELECT jobd.enqueue(...)`` (and
the documented bulk call ``jobd.enqueue_many`` for the drains and the overload), the ``jobd.jobs``
table and the ``jobd.all_jobs`` view.

The load is an open-loop producer (``--rate`` jobs/s, default 400, from ``--producers``
autocommit connections, default 4), every send on a fixed schedule and timestamped
(bench/pressure_load.py); each phase restarts the schedule, and the sends a phase could not
make by its end are reported and dropped rather than sent in the next phase. The scenarios,
modelled on the phases of the public hardbyte/postgresql-job-queue-benchmarking harness:

enqueue
    Closed loop: pgbench runs single-job ``SELECT jobd.enqueue(...)`` against a bare
    ``INSERT ... RETURNING id`` into a table of jobd.jobs's shape (``LIKE jobd.jobs INCLUDING
    ALL``: its columns, defaults, checks and indexes, no trigger, so no NOTIFY), from 4 and 8
    connections, alternately, with the daemon up (its LISTEN connection is what NOTIFY
    delivers to). The jobs go to a lane the daemon does not serve, so no worker competes for
    the CPU with the contenders; they are counted against pgbench's figure, then deleted.
    Open loop: the producer at ``--rate`` from 4 and from 8 connections into the served lane,
    for call time (send to return) p50/p99 and the share of late sends (a send is late when
    it goes out more than 1 ms after it was due, because the previous one on its connection
    had not returned).
baseline
    The producer at ``--rate``, nothing else (60 s).
idle_in_tx
    A clean lead phase, then a session that runs ``BEGIN; SELECT txid_current();`` and sits
    for the held phase (180 s), then a recovery phase.
active_readers
    A clean lead phase, then 4 REPEATABLE READ sessions, each scanning ``jobd.all_jobs``
    (``count(*)``, 100 ms apart) inside one transaction for the whole held phase (180 s), then
    a recovery phase.
overload
    First, on the fresh table, a backlog of 20,000 jobs is enqueued at once with
    ``jobd.enqueue_many`` (``measure_drain`` in bench/pressure_scenarios.py says why), twice;
    the faster drain (first claim to last finish) is the clean drain rate. Then a clean lead
    phase; two more drains of 20,000 jobs while the producer keeps sending at ``--rate``
    (``drain_loaded_1``/``_2``: the faster is the clean drain beside the standing load the
    backlog phase also has, printed beside the backlog verdict); then the producer offers
    1.5x the drain rate for a minute, several jobs per
    send with ``jobd.enqueue_many`` (at most 25 sends/s per connection: with a
    ``jobd.enqueue`` call per job the producers' own server time, not the workers, would set
    the pace on two cores); then ``--rate`` again until the backlog is gone
    (the backlog phase, whose done/s is the backlog drain rate); then a recovery phase;
    then, the producer stopped and ``jobd.jobs`` vacuumed, a drain of as many jobs as the
    overload left (``drain_same_size``, reported beside the backlog verdict).

Every phase but the warm-up is reported. ``--duration S`` sets every phase to S seconds
(recovery at most 60, lead at most 30); ``--quick`` is ``--duration 20`` with shorter
closed loops.

Pickup delay. jobd records no claim time once a job is finished: the archive keeps
``run_at``, ``created_at`` and ``finished_at``, and ``lease_until`` lives only while the job is
claimed. But every claim sets ``lease_until = now() + visibility_timeout`` (the database clock)
and hands it to the handler on the job. So the no-op handler appends ``id lease_until
start_time`` to a file of its process, one ``os.write`` (bench/pressure_handlers.py), and the
pickup delay is ``lease_until - visibility_timeout - run_at``: both ends the database's own
clock, no round trip per job. (Writing a row per job through the handler's own connection
would add a transaction per job to the very thing measured.) A job the worker gave back
unstarted and claimed again counts from its last claim. Pickup figures are per phase of
*sending*: the jobs enqueued while the phase ran.

Per phase it prints: offered/s (jobs sent / phase seconds) and done/s (``jobd.all_jobs`` rows
with state done whose ``finished_at`` falls in the phase), pickup p50/p95/p99/max, the backlog
at its end (``jobd.jobs`` rows not claimed), ``n_dead_tup`` of jobd.jobs, its heap and index
sizes, index entries read per claim (the change in ``pg_stat_user_indexes.idx_tup_read`` of
the claim index ``jobs_claimable_idx`` divided by the calls of the claim statement in
``pg_stat_statements``, and per claimed job), the enqueue call time and late share, the CPU
other processes on the machine used meanwhile, and the top wait events (``pg_stat_activity``
sampled every 100 ms from another database, active backends only, no wait event = CPU, by
kind of backend: producer, worker, supervisor, reader). At the end of each scenario its
database checks that every sent job is done exactly once (bench/pressure_stats.py); at the
end of the run one verdict line per target. Results: ``bench/results/pressure-<date>.json``
and ``.md`` (``-quick`` added for ``--quick`` runs, ``-2``, ``-3``... for a later run of the
same day). bench/README.md explains every figure.

Modules: this one is the command line; bench/pressure_run.py the cluster, the database and
daemon of a scenario and its phases; bench/pressure_scenarios.py the scenarios;
bench/pressure_load.py the producer, the horizon holders and the wait-event sampler;
bench/pressure_stats.py what is read from the database and computed in it;
bench/pressure_report.py the figures, tables, verdicts and result files;
bench/pressure_handlers.py the handler.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_bench import log, source_revision
from bench.pressure_report import finish_scenario, write_results
from bench.pressure_run import (
    CONCURRENCY,
    REPO,
    VISIBILITY_TIMEOUT_S,
    WORKERS,
    Durations,
    cluster,
    scenario_run,
)
from bench.pressure_scenarios import RUNNERS, SCENARIOS
from jobd.localpg import LocalPgError

RESULTS_DIR = REPO / "bench" / "results"
QUICK_S = 20.0


def durations_for(args: argparse.Namespace) -> Durations:
    d = args.duration if args.duration is not None else (QUICK_S if args.quick else None)
    if d is None:
        return Durations()
    base = replace(Durations(), baseline=d, held=d, overload=d, recovery=min(d, 60.0),
                   lead=min(d, 30.0), open_loop=min(d, 30.0))
    if args.quick:
        base = replace(base, warmup=3.0, closed=5.0, closed_rounds=1)
    return base


# --- the command line ----------------------------------------------------------------------


def _scenarios(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or '(none)'}; choose from "
            f"{','.join(SCENARIOS)}")
    return [n for n in SCENARIOS if n in names]  # always in the documented order


def _connections(text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 4,8: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers such as 4,8: {text!r}")
    return values


def _server_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    # The pair goes on the server's command line as one word (jobd.localpg): no spaces or
    # quotes in it. A module's setting has a dot in its name (auto_explain.log_min_duration).
    if (not sep or not name or not value or not name.replace("_", "").replace(".", "").isalnum()
            or any(c.isspace() or c in "'\"\\" for c in value)):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE such as shared_buffers=4GB: "
                                         f"{text!r}")
    return name, value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/pressure.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS),
                        metavar="A,B", help=f"scenarios to run (default: all: "
                        f"{','.join(SCENARIOS)})")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="length of every phase in seconds (default: 60 s baseline and "
                             "overload, 180 s held phases, 60 s recovery, 30 s lead and open "
                             "loop)")
    parser.add_argument("--quick", action="store_true",
                        help="20 s phases and one short closed-loop round: a few minutes in "
                             "all")
    parser.add_argument("--rate", type=float, default=400.0,
                        help="jobs/s the open-loop producer offers (default 400)")
    parser.add_argument("--producers", type=int, default=4,
                        help="autocommit connections of the producer (default 4)")
    parser.add_argument("--enqueue-connections", type=_connections, default=[4, 8],
                        metavar="N,M", help="connections of the enqueue scenario's closed "
                                            "and open loops (default 4,8)")
    parser.add_argument("--readers", type=int, default=4,
                        help="REPEATABLE READ readers in active_readers (default 4)")
    parser.add_argument("--claim-index", default="jobs_claimable_idx",
                        help="the index of jobd.jobs the claim walks (default "
                             "jobs_claimable_idx; if absent, every index but the primary "
                             "key counts)")
    parser.add_argument("--no-statements", dest="statements", action="store_false",
                        help="do not load pg_stat_statements (index reads are then given "
                             "per claimed job only)")
    parser.add_argument("--server-setting", type=_server_setting, action="append",
                        default=[], metavar="NAME=VALUE", dest="server_settings",
                        help="a setting of the throwaway cluster, on its command line "
                             "(repeatable; e.g. shared_buffers=4GB). Default: the server's "
                             "own defaults (shared_buffers 128MB, max_wal_size 1GB)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (daemon logs, handler files, cluster)")
    parser.add_argument("--no-results", dest="results", action="store_false",
                        help="do not write bench/results/pressure-<date>.json and .md")
    args = parser.parse_args(argv)
    if not all(math.isfinite(value) for value in (args.duration or 5.0, args.rate)):
        parser.error("--duration and --rate must be finite numbers")
    if args.duration is not None and args.duration < 5:
        parser.error("--duration must be at least 5 seconds")
    if args.rate <= 0 or args.producers < 1 or args.readers < 1:
        parser.error("--rate, --producers and --readers must be positive")
    return args


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    durations = durations_for(args)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "source": source_revision(), "cores": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items()}, "durations": vars(durations),
        "workers": WORKERS, "concurrency": CONCURRENCY,
        "visibility_timeout_s": VISIBILITY_TIMEOUT_S,
    }
    results: list[dict[str, Any]] = []
    try:
        with cluster(args) as cl:
            meta["server"] = cl.settings
            for name in args.scenarios:
                with scenario_run(cl, name, args, durations) as run:
                    RUNNERS[name](run)
                results.append(finish_scenario(run))
    except LocalPgError as exc:  # a setting the server refuses, binaries missing
        print(f"bench/pressure.py: error: the throwaway cluster: {exc}", file=sys.stderr)
        return 2
    meta["seconds"] = round(time.monotonic() - started)
    write_results(meta, results, RESULTS_DIR if args.results else None, quick=args.quick)
    log(f"done in {meta['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
