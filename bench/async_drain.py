"""A lane of ``async def`` handlers against the same lane with a plain function, draining
no-op jobs: what the event loop costs a job.

Usage (from the repository root)::

    .venv/bin/python -m bench.async_drain                    # 1 x 10 and 2 x 10, 3 rounds
    .venv/bin/python -m bench.async_drain --settings 1x10 --rounds 5

It reuses ``bench/daemon_bench.py``'s drain (a throwaway PostgreSQL cluster, 20,000 jobs
enqueued in one transaction while the workers idle, jobs/s from the first handler start to
the last completion by the database clock). Each round drains once with the sync no-op
handler and once with an ``async def`` one that does the same, alternating, and prints the
medians per setting and their ratio. An ``async def`` handler runs as a task on the worker's
event loop (``jobd/async_handlers.py``) and has no deck (``jobd/slots.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench import daemon_bench
from bench.daemon_bench import LANE, Env, log

ASYNC_MODULE = "async_drain_handlers"
ASYNC_SOURCE = f'''\
"""The async twin of {daemon_bench.HANDLER_MODULE}.noop, for bench/async_drain.py."""

import {daemon_bench.HANDLER_MODULE} as plain


async def noop(job):
    plain.noop(job)
'''
KINDS = {"sync": "noop", "async": "async_noop"}


def drain(env: Env, workers: int, concurrency: int, round_no: int, kind: str) -> float:
    specs = [jobd.JobSpec(KINDS[kind], {}, LANE) for _ in range(daemon_bench.DRAIN_JOBS)]
    result = daemon_bench.measure_drain(
        env, workers, concurrency, round_no, specs=specs,
        label=f"{kind}-{workers}x{concurrency}",
        handlers={KINDS["async"]: f"{ASYNC_MODULE}:noop"})
    return float(result["jobs_per_s"])


def rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", type=daemon_bench._drain_settings,
                        default=((1, 10), (2, 10)),
                        help="worker processes x concurrency (default: 1x10,2x10)")
    parser.add_argument("--rounds", type=rounds, default=3,
                        help="drains of each kind (default 3)")
    args = parser.parse_args(argv)
    with daemon_bench.environment(statements=False, keep=False) as env:
        (env.handler_dir / f"{ASYNC_MODULE}.py").write_text(ASYNC_SOURCE, "utf-8")
        for workers, concurrency in args.settings:
            rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for round_no in range(args.rounds):
                for kind in KINDS:
                    rates[kind].append(drain(env, workers, concurrency, round_no, kind))
            sync, async_ = (statistics.median(rates[kind]) for kind in KINDS)
            log(f"{workers}x{concurrency}: sync {sync:,.0f} jobs/s "
                f"{[round(r) for r in rates['sync']]}, async {async_:,.0f} "
                f"{[round(r) for r in rates['async']]}; async / sync {async_ / sync:.2f}")


if __name__ == "__main__":
    main()
