"""jobd behind the command line the peers share (bench/peers/py_peer.py), for bench/suite.py.

Runs in jobd's own virtualenv::

    python jobd_peer.py enqueue URL N                       # jobd.enqueue_many; {"seconds": ...}
    python jobd_peer.py steady URL RATE SECONDS OUTFILE     # jobd.enqueue, one job at a time

The worker side is the daemon itself (``python -m jobd run``), with
bench/peers/jobd_handlers.py on PYTHONPATH.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jobd
from jobd.db import connect


def main(argv: list[str]) -> None:
    action, url, *args = argv
    with connect(url, "jobd", application_name="bench-enqueuer") as conn:
        if action == "enqueue":
            specs = [jobd.JobSpec("noop", {}) for _ in range(int(args[0]))]
            t0 = time.perf_counter()
            jobd.enqueue_many(conn, specs)
            print(json.dumps({"seconds": time.perf_counter() - t0}))
        elif action == "steady":
            rate, seconds, out = float(args[0]), float(args[1]), args[2]
            total = int(rate * seconds)
            interval = 1.0 / rate
            lines = []
            worst_lag = 0.0
            begin = time.perf_counter() + 0.05
            for i in range(total):
                wait = begin + i * interval - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    worst_lag = max(worst_lag, -wait)
                t = time.time()
                jobd.enqueue(conn, "noop", {"i": i})
                lines.append(f"{i} {t:.6f}\n")
            elapsed = time.perf_counter() - begin
            Path(out).write_text("".join(lines))
            print(json.dumps({"jobs": total, "offered_per_s": total / elapsed,
                              "worst_lag_ms": worst_lag * 1000.0}))


if __name__ == "__main__":
    main(sys.argv[1:])
