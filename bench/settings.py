"""The in-flight settings of bench/suite.py: W worker processes x C jobs in flight per process.

Every system runs at the same settings. ``KNOBS`` says, per system, which of its own settings
W and C become, and what else it is given (its best documented setting for throughput at that
size); bench/README_suite.md has the same table. The values themselves come from the adapters
(``knobs C`` on their command line), so what the results file records is what ran.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_SETTINGS = "1x10,2x10,4x100"
_SETTING = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


@dataclass(frozen=True)
class Setting:
    workers: int  # W: worker processes (jobd: workers under one supervisor)
    concurrency: int  # C: jobs in flight per worker process

    @property
    def label(self) -> str:
        return f"{self.workers}x{self.concurrency}"

    @property
    def in_flight(self) -> int:
        return self.workers * self.concurrency

    def as_dict(self) -> dict[str, int | str]:
        return {"label": self.label, "workers": self.workers, "concurrency": self.concurrency,
                "in_flight": self.in_flight}


def parse_setting(text: str) -> Setting:
    match = _SETTING.match(text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"not a setting W x C (e.g. 2x10): {text!r}")
    return Setting(int(match[1]), int(match[2]))


def parse_settings(text: str) -> list[Setting]:
    settings = [parse_setting(part) for part in text.split(",") if part.strip()]
    if not settings:
        raise ValueError("no setting given")
    if len({s.label for s in settings}) != len(settings):
        raise ValueError(f"a setting is listed twice: {text!r}")
    return settings


# What W and C mean for each system, and what it gets besides (the adapters hold the values:
# bench/peers/py_peer.py, bench/peers/node_peer.mjs; jobd's lane is written by bench/suite.py).
KNOBS: dict[str, dict[str, str]] = {
    "jobd": {
        "W": "`lanes.default.workers: W` (worker processes under one supervisor: one node)",
        "C": "`lanes.default.concurrency: C` (jobs a worker process runs at once)",
        "besides": "`visibility_timeout: 30s`, `archive.retention: 90d`; every other key at "
                   "its default (`poll_interval` 5 s, LISTEN/NOTIFY wake-ups)",
    },
    "procrastinate": {
        "W": "W worker processes, each one `App.run_worker_async`",
        "C": "`concurrency=C` (jobs a worker runs at once; it fetches one job per query, "
             "it has no batching)",
        "besides": "`listen_notify=True`, `fetch_job_polling_interval=0.1`, `PsycopgConnector` "
                   "with its default pool, `delete_jobs` default (never)",
    },
    "pgqueuer": {
        "W": "W worker processes, each one `QueueManager.run`",
        "C": "`max_concurrent_tasks=C` (its hard cap on the jobs a worker has picked, "
             "enforced by the dequeue query) and `batch_size=C/2` (jobs per dequeue and per "
             "completion-log flush; it requires `max_concurrent_tasks >= 2 x batch_size`, so "
             "C/2 is the largest batch that keeps C in flight)",
        "besides": "`AsyncpgDriver`; the completion log's flush timer at its default (0.1 s)",
    },
    "graphile": {
        "W": "W worker processes, each one `run()` (one pool)",
        "C": "`concurrentJobs: C` (jobs run at once per pool), `maxPoolSize: max(10, C + 2)` "
             "(its documented advice)",
        "besides": "its documented batching, as on its performance page: `localQueue: {size: "
                   "500}` (jobs fetched and locked ahead per pool, on top of C), "
                   "`completeJobBatchDelay: 0`, `failJobBatchDelay: 0`",
    },
    "pgboss": {
        "W": "W worker processes, each one `boss.work()`",
        "C": "`batchSize: C`, `localConcurrency: 1` (in flight = jobs per fetch x fetch "
             "loops per process; one loop with batches of C drained as fast or faster than "
             "two with batches of C/2)",
        "besides": "queue `notify: true`, instance `useListenNotify: true`, pool `max: 10`; "
                   "`pollingIntervalSeconds: 0.5` (the minimum), `burstWhenBatchFull: true`",
    },
}
