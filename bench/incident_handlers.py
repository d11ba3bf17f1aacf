"""The handlers of the incident drill (bench/incident.py).

- ``work``: the lane's ordinary handlers (``email``, ``thumbnail`` in the drill's config): a
  short sleep, ``payload["ms"]`` milliseconds (default 20).
- ``poison``: a payload that kills its worker process on every attempt, as a segfault in a
  C extension would: it notes the crash (``<job id> <attempt> <epoch>`` appended to
  ``$JOBD_BENCH_STAMPS/crashes.txt``, one ``os.write``, so the drill knows the first crash to
  the millisecond) and sends its own process SIGSEGV.

The herd's handler is bench/pressure_handlers.py's ``noop``, which stamps every run.
"""

from __future__ import annotations

import os
import signal
import time

import jobd

DEFAULT_MS = 20


def work(job: jobd.Job) -> None:
    payload = job.payload if isinstance(job.payload, dict) else {}
    time.sleep(float(payload.get("ms", DEFAULT_MS)) / 1000.0)


def poison(job: jobd.Job) -> None:
    line = b"%d %d %.6f\n" % (job.id, job.attempt, time.time())
    path = os.path.join(os.environ["JOBD_BENCH_STAMPS"], "crashes.txt")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, line)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGSEGV)
