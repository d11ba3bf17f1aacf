"""Procrastinate and PgQueuer behind one command line, for bench/suite.py.

Runs in the peers' own virtualenv (see bench/peers/install.py), never in jobd's::

    python py_peer.py SYSTEM install URL
    python py_peer.py SYSTEM enqueue URL N          # bulk path; prints {"seconds": ...}
    python py_peer.py SYSTEM worker URL STAMPDIR C  # one worker process, C jobs in flight
    python py_peer.py SYSTEM steady URL RATE SECONDS OUTFILE
    python py_peer.py SYSTEM knobs URL C            # the worker settings for C, as JSON

SYSTEM is ``procrastinate`` or ``pgqueuer``. The job is a no-op; its handler notes
``time.time()`` for the first job of the process (``first T``) and, for jobs whose payload
carries ``i`` (the latency workload), ``i T`` - in STAMPDIR/starts-<pid>.txt. ``steady``
enqueues one job at a time through the single-job path at a fixed schedule and writes
``i T`` (the time just before the enqueue call) per job to OUTFILE.

C, the jobs in flight per worker process, becomes each system's own settings in
``procrastinate_knobs`` / ``pgqueuer_knobs`` (the table in bench/README_suite.md says the same;
change them together). ``$JOBD_BENCH_KNOBS_<SYSTEM>`` (a JSON object) overrides single
settings, for trying alternatives; ``knobs`` reports the result, so the suite records it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

# Worker settings (per process) for C jobs in flight; see bench/README_suite.md.


def _overridden(system: str, knobs: dict) -> dict:
    extra = os.environ.get(f"JOBD_BENCH_KNOBS_{system.upper()}")
    return {**knobs, **json.loads(extra)} if extra else knobs


def procrastinate_knobs(c: int) -> dict:
    # No batching in Procrastinate: each of the C slots fetches its own job. LISTEN/NOTIFY
    # wakes the worker; the polling interval is only the fallback.
    return _overridden("procrastinate", {
        "concurrency": c, "listen_notify": True, "fetch_job_polling_interval": 0.1})


def pgqueuer_knobs(c: int) -> dict:
    # max_concurrent_tasks caps the picked jobs of the worker (in the dequeue query); PgQueuer
    # refuses a batch_size above half of it, so C/2 is the largest batch at C in flight.
    return _overridden("pgqueuer", {"max_concurrent_tasks": c, "batch_size": max(1, c // 2)})


_stamps = None
_first = False


def _open_stamps(directory: str) -> None:
    global _stamps
    _stamps = open(  # noqa: SIM115 - open for the life of the process
        Path(directory) / f"starts-{os.getpid()}.txt", "a", buffering=1)


def _stamp(i: object) -> None:
    global _first
    now = time.time()
    if not _first:
        _first = True
        _stamps.write(f"first {now:.6f}\n")
    if i is not None:
        _stamps.write(f"{i} {now:.6f}\n")


# --- procrastinate --------------------------------------------------------------------------


def procrastinate_app(url: str):
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=url, kwargs={"options": "-c synchronous_commit=on"}))

    @app.task(name="noop")
    async def noop(i: int | None = None) -> None:
        _stamp(i)

    return app, noop


async def procrastinate_main(action: str, url: str, args: list[str]) -> None:
    app, noop = procrastinate_app(url)
    async with app.open_async():
        if action == "install":
            await app.schema_manager.apply_schema_async()
        elif action == "enqueue":
            n = int(args[0])
            payloads = [{} for _ in range(n)]
            t0 = time.perf_counter()
            await noop.batch_defer_async(*payloads)
            print(json.dumps({"seconds": time.perf_counter() - t0}))
        elif action == "worker":
            _open_stamps(args[0])
            task = asyncio.create_task(app.run_worker_async(
                wait=True, install_signal_handlers=False, **procrastinate_knobs(int(args[1])),
            ))
            await _until_sigterm()
            task.cancel()
            try:
                await asyncio.wait_for(task, 10)
            except (TimeoutError, asyncio.CancelledError, Exception):
                pass
        elif action == "steady":
            rate, seconds, out = float(args[0]), float(args[1]), args[2]

            async def one(i: int) -> None:
                await noop.defer_async(i=i)

            await _steady(one, rate, seconds, out)


# --- pgqueuer -------------------------------------------------------------------------------


async def pgqueuer_driver(url: str):
    import asyncpg
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(url, server_settings={"synchronous_commit": "on"})
    return conn, AsyncpgDriver(conn)


async def pgqueuer_main(action: str, url: str, args: list[str]) -> None:
    from pgqueuer.queries import Queries

    conn, driver = await pgqueuer_driver(url)
    try:
        if action == "install":
            await Queries(driver).install()
        elif action == "enqueue":
            n = int(args[0])
            queries = Queries(driver)
            t0 = time.perf_counter()
            await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
            print(json.dumps({"seconds": time.perf_counter() - t0}))
        elif action == "worker":
            from pgqueuer import QueueManager

            _open_stamps(args[0])
            qm = QueueManager(Queries(driver))

            @qm.entrypoint("noop")
            async def noop(job) -> None:
                _stamp(int(job.payload) if job.payload else None)

            task = asyncio.create_task(qm.run(**pgqueuer_knobs(int(args[1]))))
            await _until_sigterm()
            qm.shutdown.set()
            try:
                await asyncio.wait_for(task, 30)
            except (TimeoutError, Exception):
                task.cancel()
        elif action == "steady":
            rate, seconds, out = float(args[0]), float(args[1]), args[2]
            queries = Queries(driver)

            async def one(i: int) -> None:
                await queries.enqueue("noop", str(i).encode())

            await _steady(one, rate, seconds, out)
    finally:
        await conn.close()


# --- shared ---------------------------------------------------------------------------------


async def _until_sigterm() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()


async def _steady(one, rate: float, seconds: float, out: str) -> None:
    total = int(rate * seconds)
    interval = 1.0 / rate
    lines = []
    begin = time.perf_counter() + 0.05
    worst_lag = 0.0
    for i in range(total):
        wait = begin + i * interval - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            worst_lag = max(worst_lag, -wait)
        t = time.time()
        await one(i)
        lines.append(f"{i} {t:.6f}\n")
    elapsed = time.perf_counter() - begin
    Path(out).write_text("".join(lines))
    print(json.dumps({"jobs": total, "offered_per_s": total / elapsed,
                      "worst_lag_ms": worst_lag * 1000.0}))


def main(argv: list[str]) -> None:
    system, action, url, *args = argv
    if action == "knobs":
        knobs = {"procrastinate": procrastinate_knobs, "pgqueuer": pgqueuer_knobs}[system]
        print(json.dumps(knobs(int(args[0]))))
        return
    runner = {"procrastinate": procrastinate_main, "pgqueuer": pgqueuer_main}[system]
    asyncio.run(runner(action, url, args))
    if action == "worker":
        # Connection pools and their background tasks can outlive a cancelled worker; the
        # work is done and every stamp is written, so leave without waiting for them.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
