"""The handler bench/pressure.py runs: a no-op that notes which claim it ran under.

Each run appends ``<job id> <lease_until epoch> <start epoch>`` to
``$JOBD_BENCH_STAMPS/runs-<pid>.txt``. ``lease_until`` is what the claim statement set
(``now() + visibility_timeout``, the database clock), so the claim time is that minus the lane's
visibility timeout; the start time is this machine's clock, for the hand-off from claim to
handler. One ``os.write`` per job on a file opened with O_APPEND: a few microseconds, no
database round trip, and lines of several threads never interleave.
"""

from __future__ import annotations

import os
import threading
import time

import jobd

_lock = threading.Lock()
_fd: int | None = None


def _file() -> int:
    global _fd
    if _fd is None:
        with _lock:
            if _fd is None:
                path = os.path.join(os.environ["JOBD_BENCH_STAMPS"], f"runs-{os.getpid()}.txt")
                _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    return _fd


def noop(job: jobd.Job) -> None:
    started = time.time()
    line = b"%d %.6f %.6f\n" % (job.id, job.lease_until.timestamp(), started)
    os.write(_file(), line)
