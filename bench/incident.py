"""The incident drill: a poison pill and a thundering herd from a clock jump, in one command.

Usage (from the repository root, as root or a user that can start PostgreSQL)::

    .venv/bin/python bench/incident.py --fairness off
    .venv/bin/python bench/incident.py --fairness on --herd 40000
    python -m bench.incident --fairness off --no-results      # nothing written to the repo

It needs the PostgreSQL server binaries, ``prometheus`` and ``libfaketime`` (Debian packages
postgresql, prometheus, faketime) and matplotlib (``pip install -e '.[bench]'``).

What it does, in about two minutes (up to five when the herd does not drain: it gives up
200 s after the cause):

1. Starts a throwaway PostgreSQL cluster whose server runs under libfaketime with the offset
   in a file (+0), migrates a database, and enqueues ``--herd`` no-op jobs with
   ``jobd.enqueue_many``, ``run_at`` an hour ahead by the database clock.
2. Starts ``jobd run`` (one lane, four handlers: herd, email, thumbnail, poison), a real
   Prometheus scraping it and evaluating contrib/prometheus/alerts.yml every 2 s, and steady
   traffic for email and thumbnail (20 ms jobs).
3. After the baseline, the cause: the clock file becomes +1h, so the server's ``now()`` is an
   hour ahead and the whole herd is due at once; from the same moment a poison job (it
   kills its worker with SIGSEGV on every attempt) arrives every 2 s.
4. Watches Prometheus. When JobdDeadLetterQueueGrowing fires (or ``--mitigate-by`` seconds
   after the cause without it) it runs the runbook: ``jobd lanes pause default --handler
   poison``, then ``jobd dlq quarantine --handler poison``. It waits for the herd to drain.
5. Writes ``bench/results/incident-<date>-fairness-<on|off>/``: timeline.md, timeline.json and
   chart.png (depth, oldest unclaimed age, DLQ depth, restarts and per-handler throughput,
   from what Prometheus recorded).

``--fairness on`` writes ``fair_by: handler`` into the lane's config, ``off`` writes
``fair_by: none``; a jobd that does not know the key runs ``off`` with the key left out (the
same behaviour) and refuses ``on``. Modules: bench/incident_run.py (the drill),
bench/incident_stats.py (the figures), bench/incident_report.py (the files),
bench/incident_prom.py (Prometheus), bench/incident_handlers.py (the handlers).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_bench import log, source_revision
from bench.incident_prom import available as prometheus_available
from bench.incident_report import write
from bench.incident_run import LIBFAKETIME, REPO, RULES, Drill, DrillError, Settings
from bench.incident_stats import collect

RESULTS_DIR = REPO / "bench" / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/incident.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings(fairness="off")
    parser.add_argument("--fairness", choices=["on", "off"], required=True,
                        help="fair_by: handler (on) or none (off) in the lane's config")
    parser.add_argument("--herd", type=int, default=defaults.herd,
                        help=f"delayed jobs made due by the jump (default {defaults.herd})")
    parser.add_argument("--baseline", type=float, default=defaults.baseline_s, metavar="S",
                        help=f"seconds of steady traffic before the cause (default "
                             f"{defaults.baseline_s:g})")
    parser.add_argument("--mitigate-by", type=float, default=defaults.mitigate_by_s,
                        metavar="S", help="act this long after the cause if the DLQ alert "
                                          f"has not fired (default {defaults.mitigate_by_s:g})")
    parser.add_argument("--no-mitigation", dest="mitigate", action="store_false",
                        help="never run the runbook (pause, quarantine): how the lane copes "
                             "with the poison on its own")
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts, metavar="N",
                        help=f"the lane's max_attempts (default {defaults.max_attempts})")
    parser.add_argument("--poison-every", type=float, default=defaults.poison_every_s,
                        metavar="S", help=f"a poison job every S seconds from the cause; 0 "
                                          f"sends none, the herd alone (default "
                                          f"{defaults.poison_every_s:g})")
    parser.add_argument("--tail", type=float, default=defaults.tail_s, metavar="S",
                        help=f"seconds the drill runs on after the herd drained and the "
                             f"mitigation (default {defaults.tail_s:g})")
    parser.add_argument("--interval", type=float, default=defaults.interval_s, metavar="S",
                        help=f"Prometheus scrape and evaluation interval (default "
                             f"{defaults.interval_s:g})")
    parser.add_argument("--rules", type=Path, default=RULES,
                        help="the alert rules Prometheus loads (default: the shipped ones)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (cluster, daemon log, Prometheus TSDB)")
    parser.add_argument("--no-results", dest="results", action="store_false",
                        help="do not write bench/results/incident-*")
    parser.add_argument("--out", type=Path, help="write the results here instead")
    args = parser.parse_args(argv)
    seconds = (args.baseline, args.interval, args.mitigate_by, args.tail, args.poison_every)
    if not all(math.isfinite(value) for value in seconds):  # nan passes every comparison below
        parser.error("--baseline, --interval, --mitigate-by, --tail and --poison-every must be "
                     "finite numbers of seconds")
    if args.max_attempts < 1:
        parser.error("--max-attempts must be at least 1")
    if (args.herd < 1 or args.baseline < 10 or args.interval <= 0 or args.mitigate_by <= 0
            or args.tail < 0 or args.poison_every < 0):
        parser.error("--herd must be positive, --baseline at least 10 s, --interval and "
                     "--mitigate-by positive, --tail and --poison-every not negative")
    if not args.rules.is_file():
        parser.error(f"--rules: no such file: {args.rules}")
    return args


def missing_tools() -> list[str]:
    missing = []
    if not prometheus_available():
        missing.append("prometheus (Debian package prometheus)")
    if not LIBFAKETIME.exists():
        missing.append("libfaketime (Debian package faketime)")
    if shutil.which("pg_ctl") is None and not list(Path("/usr/lib/postgresql").glob("*/bin")):
        missing.append("the PostgreSQL server binaries (Debian package postgresql)")
    return missing


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"bench/incident.py: needs {', '.join(missing)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    settings = Settings(fairness=args.fairness, herd=args.herd, baseline_s=args.baseline,
                        mitigate_by_s=args.mitigate_by, interval_s=args.interval, tail_s=args.tail,
                        poison_every_s=args.poison_every, mitigate=args.mitigate,
                        max_attempts=args.max_attempts,
                        rules=args.rules.resolve(), keep=args.keep)
    started = time.monotonic()
    source = source_revision()  # before the run: what the daemon's processes loaded
    drill = Drill(settings)
    try:
        record = drill.run(collect)
    except DrillError as exc:
        print(f"bench/incident.py: {exc}", file=sys.stderr)
        return 1
    record["notes"].update({
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "source": source, "cores": os.cpu_count(),
        "command": "python bench/incident.py " + " ".join(sys.argv[1:] if argv is None
                                                          else argv),
        "wall_s": round(time.monotonic() - started, 1),
    })
    if args.results:
        out = args.out or RESULTS_DIR / (f"incident-{datetime.now(UTC):%Y-%m-%d}-fairness-"
                                         f"{args.fairness}")
        write(record, out)
        log(f"wrote {out}")
    s = record["summary"]
    log(f"done in {record['notes']['wall_s']}s: herd drained at {s['herd_drain_s']}s, "
        f"alerts firing {s['alerts_firing_s']}, pickup p99 ratio {s['pickup_p99_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
