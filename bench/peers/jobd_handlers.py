"""The handler the jobd daemon runs in bench/suite.py: a no-op that notes when it started.

The first job of each worker process writes ``first T``; a job whose payload carries ``i``
(the latency workload) writes ``i T``, to $JOBD_BENCH_STAMPS/starts-<pid>.txt.
"""

import os
import threading
import time

_lock = threading.Lock()
_file = None
_first = False


def noop(job):
    global _file, _first
    now = time.time()
    i = job.payload.get("i") if isinstance(job.payload, dict) else None
    if _first and i is None:
        return
    with _lock:
        if _file is None:
            path = os.path.join(os.environ["JOBD_BENCH_STAMPS"], f"starts-{os.getpid()}.txt")
            _file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process
        if not _first:
            _first = True
            _file.write(f"first {now:.6f}\n")
        if i is not None:
            _file.write(f"{i} {now:.6f}\n")
