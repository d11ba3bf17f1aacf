"""Where a drain's time goes: the drain of ``bench/daemon_bench.py`` (20,000 no-op jobs committed
at once, a daemon with one lane) with the daemon's and the server's side watched.

Usage::

    .venv/bin/python -m bench.drain_profile [--settings 1x10,2x10] [--py-spy PATH]
                                            [--jobs N] [--no-explain] [--gil]
                                            [--against KEY=VALUE [--pairs N]]

For each setting (worker processes x concurrency), one drain, on the same throwaway cluster as
the daemon benchmark; the jobs are enqueued while the lane is paused and the drain is timed from
the resume, so that nothing but the drain is measured. During it:

- the CPU seconds of the supervisor, of each worker process and of each worker's backend are
  read from /proc before and after (divided by the jobs: CPU per job, per process);
- the commits of the benchmark database and the cluster's WAL writes and syncs
  (``pg_stat_database``, ``pg_stat_wal``) are counted;
- ``pg_stat_activity`` is sampled every 10 ms from the ``postgres`` database: for each worker
  backend, whether it is idle (waiting for its worker: the time is the client's), active on
  CPU, or active waiting (and on what: ``wait_event_type:wait_event``);
- with ``--py-spy``, ``py-spy record --nonblocking --threads --idle --format raw`` (``--gil``
  in place of ``--idle`` with ``--gil``: the Python CPU alone) samples the
  first worker process at 100 Hz: the main (loop) thread's samples are split into asleep in
  ``select``, waiting for the server inside an exchange, the exchange's own client work, and
  the rest of the loop; the top frames of the main thread and of the handler threads are
  printed, by self and by inclusive share of samples (idle waits included).

Then ``EXPLAIN (ANALYZE, BUFFERS)`` of the worker's claim (``claim_jobs``, the limit a worker
of the first setting asks for) on a queue of 20,000 due jobs, in a transaction rolled back.
With ``--against KEY=VALUE`` each setting drains in pairs, the lane as configured by default
and with that key set (e.g. ``settle_connection=false``), the order alternating from pair to
pair, and the medians and their ratio are printed: a baseline measured in the same run.
Output on stderr, then one JSON line per drain. py-spy is an optional dependency (the
``bench`` extra has it); without ``--py-spy`` there is no stack profile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import (
    DRAIN_JOBS,
    DRAIN_SETTLE_S,
    LANE,
    Daemon,
    Env,
    LoadMeter,
    _drain_settings,
    descendants,
    environment,
    log,
    own_cpu_seconds,
    reset_queue,
    wait_drained,
    write_config,
)
from jobd import queue
from jobd.claim_floors import full_scan_params
from jobd.cli_types import positive_int
from jobd.config import LaneConfig
from jobd.queries import query

SAMPLE_INTERVAL_S = 0.01
PY_SPY_RATE = 100
TOP_FRAMES = 12


class ActivitySampler(threading.Thread):
    """pg_stat_activity of the worker backends, tallied by what each was doing."""

    def __init__(self, env: Env) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.tally: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        with self.env.admin() as admin:
            while not self.stop_event.is_set():
                rows = admin.execute(
                    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
                    " WHERE datname = %s AND application_name LIKE 'jobd worker %%'",
                    (self.env.dbname,)).fetchall()
                self.samples += 1
                for state, wait_type, wait_event in rows:
                    self.tally[_activity(state, wait_type, wait_event)] += 1
                time.sleep(SAMPLE_INTERVAL_S)

    def finish(self) -> dict[str, float]:
        """Each kind's share of the backend samples, in percent."""
        self.stop_event.set()
        self.join()
        total = sum(self.tally.values()) or 1
        return {kind: round(100.0 * n / total, 1) for kind, n in self.tally.most_common()}


def _activity(state: str | None, wait_type: str | None, wait_event: str | None) -> str:
    if state == "active":
        return "active: CPU" if wait_type is None else f"active: {wait_type}:{wait_event}"
    # idle: the backend waits for its client (ClientRead): the time is the worker's.
    return str(state)


def worker_pids(daemon_pid: int) -> list[int]:
    """The daemon's worker processes (their titles begin 'jobd: worker')."""
    found = []
    for pid in descendants(daemon_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"jobd: worker"):
            found.append(pid)
    return sorted(found)


def backend_pids(env: Env) -> list[int]:
    with env.admin() as admin:
        rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND "
                             "application_name LIKE 'jobd worker %%'", (env.dbname,)).fetchall()
    return [pid for (pid,) in rows]


def server_counts(env: Env) -> dict[str, int]:
    """Commits of the benchmark database (the drain's transactions, and wait_drained's few
    polls) and the cluster's WAL writes and syncs (pg_stat_wal: flushes to disk)."""
    with env.admin() as admin:
        row = admin.execute(
            "SELECT d.xact_commit, w.wal_write, w.wal_sync FROM pg_stat_database d, "
            "pg_stat_wal w WHERE d.datname = %s", (env.dbname,)).fetchone()
    assert row is not None
    commits, wal_writes, wal_syncs = row
    return {"commits": commits, "wal_writes": wal_writes, "wal_syncs": wal_syncs}


def profile_drain(env: Env, workers: int, concurrency: int, py_spy: str | None,
                  jobs: int = DRAIN_JOBS, gil_only: bool = False,
                  lane_options: dict[str, Any] | None = None) -> dict[str, Any]:
    reset_queue(env)
    stamps = env.scratch(f"profile-w{workers}c{concurrency}")
    config = write_config(env, f"profile-w{workers}c{concurrency}",
                          {LANE: (workers, concurrency)},
                          lane_options={LANE: dict(lane_options or {})})
    specs = [jobd.JobSpec("noop", {}, LANE) for _ in range(jobs)]
    with Daemon(env, config, stamps, workers=workers) as daemon:
        time.sleep(DRAIN_SETTLE_S)
        with env.bench_conn() as conn:
            # Enqueued while the lane is paused, so the profiles and counts cover the drain
            # alone: the resume tells the workers (a CONTROLS wake-up) and they start at once.
            jobd.pause(conn, LANE)
            jobd.enqueue_many(conn, specs)
        workers_now, backends = worker_pids(daemon.pid), backend_pids(env)
        groups = {"supervisor": [daemon.pid], "workers": workers_now, "backends": backends}
        spy = _start_py_spy(py_spy, workers_now[0], stamps, gil_only) if py_spy else None
        sampler = ActivitySampler(env)
        before = {name: own_cpu_seconds(pids) for name, pids in groups.items()}
        counts_before = server_counts(env)
        meter = LoadMeter(env)
        sampler.start()
        started = time.monotonic()
        with env.bench_conn() as conn:
            jobd.resume(conn, LANE)
        wait_drained(env, jobs, interval=0.05)
        seconds = time.monotonic() - started
        activity = sampler.finish()
        load = meter.stop()
        cpu = {name: own_cpu_seconds(pids) - before[name] for name, pids in groups.items()}
        counts = {name: value - counts_before[name]
                  for name, value in server_counts(env).items()}
        stacks = _stop_py_spy(spy) if spy else None
    result: dict[str, Any] = {
        "workers": workers, "concurrency": concurrency, "jobs": jobs,
        "lane_options": dict(lane_options or {}),
        "seconds": round(seconds, 3), "jobs_per_s": round(jobs / seconds),
        "cpu_ms_per_job": {name: round(1000.0 * s / jobs, 3) for name, s in cpu.items()},
        "cpu_cores": {name: round(s / seconds, 2) for name, s in cpu.items()},
        "backend_activity_pct": activity, "activity_samples": sampler.samples,
        "per_1000_jobs": {name: round(1000.0 * n / jobs, 1) for name, n in counts.items()},
        **load}
    log(f"drain {workers}x{concurrency} {json.dumps(lane_options or {})}: "
        f"{result['jobs_per_s']:,} jobs/s ({seconds:.2f}s, "
        f"from the resume); other load {load['other_load_cores']:.2f} cores")
    log(f"  CPU ms per job: {result['cpu_ms_per_job']}; cores: {result['cpu_cores']}")
    log(f"  worker backends (% of samples): {activity}")
    log(f"  server, per 1,000 jobs: {result['per_1000_jobs']}")
    if stacks is not None:
        result["py_spy"] = stacks
        log(f"  py-spy, main thread phases (%): {stacks.pop('main thread phases')}")
        for thread, tops in stacks.items():
            log(f"  py-spy, {thread}: {tops['samples']} samples")
            for kind in ("self", "inclusive"):
                log(f"    by {kind}:")
                for frame, pct in tops[kind]:
                    log(f"      {pct:5.1f}%  {frame}")
    return result


def _start_py_spy(py_spy: str, pid: int, stamps: Path,
                  gil_only: bool) -> tuple[subprocess.Popen[bytes], Path]:
    out = stamps / f"py-spy-{pid}.txt"
    # Every thread's waits included, or only the thread holding the GIL: where the
    # process's Python CPU goes.
    which = "--gil" if gil_only else "--idle"
    proc = subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--rate", str(PY_SPY_RATE), "--nonblocking",
         "--threads", which, "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # attached before the jobs arrive
    return proc, out


def _stop_py_spy(spy: tuple[subprocess.Popen[bytes], Path]) -> dict[str, Any]:
    proc, out = spy
    proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
    _, err = proc.communicate(timeout=30)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')}")
    return summarize_stacks(out.read_text())


def summarize_stacks(raw: str) -> dict[str, Any]:
    """Collapsed stacks ('thread;frame;frame count', root first) as the top frames of the
    main thread and of all other threads together, by self and inclusive share."""
    per_thread: dict[str, tuple[collections.Counter[str], collections.Counter[str]]] = {}
    totals: collections.Counter[str] = collections.Counter()
    phases: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        group = "main thread" if "MainThread" in thread else "handler threads"
        own, inclusive = per_thread.setdefault(
            group, (collections.Counter(), collections.Counter()))
        count = int(count_text)
        totals[group] += count
        if frames:
            own[_short(frames[-1])] += count
        names = {_short(f) for f in frames}
        for frame in names:
            inclusive[frame] += count
        if group == "main thread":
            phases[_phase(names)] += count
    summary: dict[str, Any] = {
        group: {"samples": totals[group],
                "self": _top(own, totals[group]), "inclusive": _top(inclusive, totals[group])}
        for group, (own, inclusive) in per_thread.items()}
    summary["main thread phases"] = dict(_top(phases, totals["main thread"]))
    return summary


def _phase(frames: set[str]) -> str:
    """What the loop thread was doing in one sample."""
    if "EpollSelector.select (selectors.py)" in frames:
        return "asleep in select (nothing due)"
    if "_wait (fastpath.py)" in frames:
        return "exchange: waiting for the server"
    if "settle_and_claim (queue.py)" in frames:
        return "exchange: client work (encode, send, decode)"
    return "rest of the loop (slots, completer, claimer, report)"


def _short(frame: str) -> str:
    """'func (path/to/module.py:123)' as 'func (module.py)': lines apart are one function."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({os.path.basename(path)})"


def _top(counter: collections.Counter[str], total: int) -> list[tuple[str, float]]:
    return [(frame, round(100.0 * n / max(total, 1), 1))
            for frame, n in counter.most_common(TOP_FRAMES)]


def explain_claim(env: Env, limit: int, repeats: int = 5) -> tuple[str, list[float]]:
    """EXPLAIN ANALYZE of a claim of ``limit`` jobs on a queue of DRAIN_JOBS due jobs,
    ``repeats`` times (each rolled back, so each finds the same queue): the last plan and
    every execution time (ms; the first one meets a cold cache)."""
    reset_queue(env)
    times, plan = [], ""
    with env.bench_conn() as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE) for _ in range(DRAIN_JOBS)])
        conn.execute("VACUUM (ANALYZE) jobd.jobs")
        request = queue.ClaimRequest(LANE, "bench:explain", limit, 30.0,
                                     floors=full_scan_params())
        for _ in range(repeats):
            with conn.transaction(force_rollback=True):
                rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query("claim_jobs"),
                                    queue._claim_params(request, None)).fetchall()
            plan = "\n".join(row[0] for row in rows)
            times.append(float(plan.rsplit("Execution Time: ", 1)[1].split()[0]))
    return plan, times


def _lane_option(text: str) -> dict[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        return {key: json.loads(value)}
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON value") from None


def _pair(env: Env, workers: int, concurrency: int, args: argparse.Namespace,
          first_default: bool) -> list[dict[str, Any]]:
    """One drain with the defaults and one with ``--against``, in the order given (pairs
    alternate it, so a drift over the run favours neither), defaults first in the list."""
    order = [{}, args.against] if first_default else [args.against, {}]
    drains = [profile_drain(env, workers, concurrency, args.py_spy, args.jobs, args.gil,
                            options) for options in order]
    return drains if first_default else drains[::-1]


def _compare(workers: int, concurrency: int, against: dict[str, Any],
             pairs: list[list[dict[str, Any]]]) -> None:
    """The medians of both sides, their ratio, and how many pairs the defaults won."""
    rates = [[drain["jobs_per_s"] for drain in pair] for pair in pairs]
    ours, theirs = (statistics.median(side) for side in zip(*rates, strict=True))
    won = sum(default > other for default, other in rates)
    log(f"{workers}x{concurrency}: defaults {ours:,.0f} jobs/s (median of {rates_of(rates, 0)}), "
        f"{json.dumps(against)} {theirs:,.0f} ({rates_of(rates, 1)}); ratio "
        f"{ours / theirs:.2f}, defaults faster in {won} of {len(pairs)} pairs")


def rates_of(rates: list[list[int]], side: int) -> str:
    return " / ".join(f"{pair[side]:,}" for pair in rates)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", type=_drain_settings, default=((1, 10), (2, 10)),
                        help="worker processes x concurrency, e.g. 1x10,2x10")
    parser.add_argument("--py-spy", default=None, help="the py-spy binary (optional)")
    parser.add_argument("--jobs", type=positive_int, default=DRAIN_JOBS,
                        help=f"jobs per drain (default {DRAIN_JOBS:,}; a drain of 20,000 "
                             "lasts about a second, so rates spread; more steadies them)")
    parser.add_argument("--gil", action="store_true",
                        help="with --py-spy, sample only the thread holding the GIL (where "
                             "the worker's Python CPU goes) instead of every thread with its "
                             "waits")
    parser.add_argument("--no-explain", action="store_true",
                        help="skip the EXPLAIN ANALYZE of the claim after the drains")
    parser.add_argument("--against", type=_lane_option, default=None, metavar="KEY=VALUE",
                        help="also drain with this lane key set (a JSON value, e.g. "
                             "settle_connection=false), alternating with the defaults, and "
                             "print the medians and their ratio per setting")
    parser.add_argument("--pairs", type=positive_int, default=None,
                        help="with --against: pairs of drains per setting (default 3)")
    args = parser.parse_args(argv)
    if args.pairs is not None and args.against is None:
        parser.error("--pairs needs --against")
    results = []
    with environment(statements=False, keep=False) as env:
        for workers, concurrency in args.settings:
            if args.against is None:
                results.append(profile_drain(env, workers, concurrency, args.py_spy,
                                             args.jobs, args.gil))
                continue
            pairs = [_pair(env, workers, concurrency, args, first_default=n % 2 == 0)
                     for n in range(args.pairs or 3)]
            results += [drain for pair in pairs for drain in pair]
            _compare(workers, concurrency, args.against, pairs)
        if not args.no_explain:
            workers, concurrency = args.settings[0]
            limit = LaneConfig(LANE, concurrency=concurrency).buffer_size + concurrency
            plan, times = explain_claim(env, limit)
            log(f"EXPLAIN ANALYZE of claim_jobs, limit {limit}, {DRAIN_JOBS:,} due jobs, "
                f"execution times (ms) {times}; the last plan:\n{plan}")
    for result in results:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
