"""A worker's memory when large payloads follow a run of short small jobs.

Usage (from the repository root)::

    .venv/bin/python -m bench.payload_memory                   # 4 x 10, 2 rounds, ~1 minute
    .venv/bin/python -m bench.payload_memory --setting 2x100 --large 400 --rounds 3

It uses ``bench.daemon_bench``'s private cluster, config and handlers. Each round starts the
daemon (one lane, W worker processes x concurrency C, default 4 x 10, the lane's buffer
adapted: no ``prefetch``), then enqueues in one transaction 20,000 no-op jobs with empty
payloads followed by ``--large`` no-op jobs whose payloads hold ``--payload-kb`` of text
that does not compress (default 400 jobs of 1,000 KB: the default
``limits.max_payload_bytes`` is 1 MB). The small jobs grow each worker's buffer to its cap
(500 jobs); the large ones then arrive in the claims that follow. Per round it prints each
worker process's peak resident memory (``VmHWM``, read before the daemon stops), their
largest and their sum, and the drain's rate: the first claim to the last finish.

What it shows (docs/design/daemon.md, "bounded in bytes"): the claim that first brings large
payloads is sized from the small ones before it; without a bound the database applies, one
claim may carry hundreds of them on every worker.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import (
    DRAIN_SETTLE_S,
    LANE,
    Daemon,
    Env,
    descendants,
    environment,
    log,
    reset_queue,
    source_revision,
    status_kb,
    wait_drained,
    write_config,
)

SMALL_JOBS = 20_000


def vm_hwm_kb(pid: int) -> int:
    """A process's peak resident memory so far (0 if it is gone)."""
    return status_kb(pid, "VmHWM")


def worker_pids(daemon_pid: int) -> list[int]:
    """The daemon's worker processes (their titles start with 'jobd: worker')."""
    found = []
    for pid in descendants(daemon_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if title.startswith(b"jobd: worker"):
            found.append(pid)
    return found


def measure(env: Env, workers: int, concurrency: int, large: int, payload_kb: int,
            round_no: int) -> dict[str, float | list[float]]:
    reset_queue(env)
    stamps = env.scratch(f"payload-memory-{round_no}")
    config = write_config(env, "payload-memory", {LANE: (workers, concurrency)})
    blob = secrets.token_urlsafe(payload_kb * 1024)[:payload_kb * 1024]
    specs = ([jobd.JobSpec("noop", {}, LANE) for _ in range(SMALL_JOBS)]
             + [jobd.JobSpec("noop", {"blob": blob, "n": n}, LANE) for n in range(large)])
    with Daemon(env, config, stamps, workers=workers) as daemon:
        time.sleep(DRAIN_SETTLE_S)
        pids = worker_pids(daemon.pid)
        if len(pids) != workers:
            raise RuntimeError(f"found {len(pids)} worker processes, not {workers}")
        idle = [vm_hwm_kb(pid) / 1024 for pid in pids]
        with env.bench_conn() as conn:
            jobd.enqueue_many(conn, specs)
        wait_drained(env, len(specs), interval=0.05)
        peaks = [vm_hwm_kb(pid) / 1024 for pid in pids]
    with env.bench_conn() as conn:
        row = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at))"
                           "::float8 FROM jobd.jobs_archive").fetchone()
    assert row is not None
    result: dict[str, float | list[float]] = {
        "idle_mb": [round(mb) for mb in idle], "peak_mb": [round(mb) for mb in peaks],
        "largest_mb": max(peaks), "sum_mb": sum(peaks), "jobs_per_s": len(specs) / row[0]}
    log(f"round {round_no}: worker peaks {result['peak_mb']} MB (idle {result['idle_mb']}), "
        f"largest {max(peaks):.0f} MB, all {sum(peaks):.0f} MB; "
        f"{result['jobs_per_s']:,.0f} jobs/s")
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.payload_memory",
        description="Worker memory when large payloads follow short small jobs.")
    parser.add_argument("--setting", default="4x10", metavar="WxC",
                        help="worker processes x concurrency (default: 4x10)")
    parser.add_argument("--large", type=int, default=400,
                        help="jobs with large payloads after the small ones (default: 400)")
    parser.add_argument("--payload-kb", type=int, default=1000,
                        help="each large payload's size in KB (default: 1000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default: 2)")
    args = parser.parse_args(argv)
    try:
        workers, concurrency = (int(part) for part in args.setting.split("x"))
    except ValueError:
        parser.error(f"--setting: expected WxC like 4x10, not {args.setting!r}")
    if workers < 1 or concurrency < 1 or args.large < 1 or args.rounds < 1:
        parser.error("--setting, --large and --rounds must be positive")
    if not 1 <= args.payload_kb <= 1000:
        parser.error("--payload-kb must be 1-1000 (the default max_payload_bytes is 1 MB)")
    args.workers, args.concurrency = workers, concurrency
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"# payload memory at {source_revision()}: {args.workers} x {args.concurrency}, "
          f"{SMALL_JOBS:,} small jobs then {args.large} of {args.payload_kb} KB")
    with environment(statements=False, keep=False) as env:
        results = [measure(env, args.workers, args.concurrency, args.large, args.payload_kb,
                           round_no) for round_no in range(1, args.rounds + 1)]
    largest = [float(result["largest_mb"]) for result in results]  # type: ignore[arg-type]
    total = [float(result["sum_mb"]) for result in results]  # type: ignore[arg-type]
    rates = [float(result["jobs_per_s"]) for result in results]  # type: ignore[arg-type]
    print(f"largest worker peak, MB: median {statistics.median(largest):.0f}, "
          f"all {[round(mb) for mb in largest]}")
    print(f"all workers' peaks summed, MB: median {statistics.median(total):.0f}, "
          f"all {[round(mb) for mb in total]}")
    print(f"drain, jobs/s: median {statistics.median(rates):,.0f}, "
          f"all {[round(rate) for rate in rates]}")


if __name__ == "__main__":
    main()
