"""The load and the pressure bench/pressure.py puts on the database, and the wait-event sampler.

- ``Producer``: an open-loop producer. N autocommit connections, each sending on a fixed
  schedule (rate / N per connection, the connections staggered), one ``SELECT jobd.enqueue(...)``
  per send; every send is timestamped (due, sent, returned) and tagged with the phase it was
  sent in. A send that is due while the previous one on its connection has not returned goes
  out as soon as that one returns (and counts as late), so the schedule, not the server, sets
  the offered rate. Each phase starts the schedule afresh (``restart``): what a phase could
  not send by its end is counted (``behind``) and dropped, not sent in the next. For rates
  beyond what single sends can carry (overload) one send enqueues several jobs with the bulk
  call ``jobd.enqueue_many`` (one COPY), as a fan-out job or an import does: a
  ``jobd.enqueue`` call per job costs the server some 150 us, so on two cores single calls
  offered a third to a half of what the daemon drains (2026-12-03).
- ``IdleInTransaction``: a session that does ``BEGIN; SELECT txid_current();`` and sits.
- ``Readers``: REPEATABLE READ sessions scanning ``jobd.all_jobs`` over and over inside one
  transaction each, as the reference harness's active readers do, so their snapshots hold the
  xmin horizon for as long as they read.
- ``WaitSampler``: samples ``pg_stat_activity`` of the benchmark database every 100 ms from a
  connection to *another* database, counting what each active backend waits on, by kind of
  backend.

Every thread keeps its first error; the owner checks ``raise_error()`` and stops the run: a
benchmark whose load silently stopped would report figures of something else.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg

import jobd
from bench.daemon_bench import percentile

ENQUEUE_ONE = "SELECT jobd.enqueue(%s)"
HANDLER = "noop"
LANE = "default"  # jobd.enqueue's default lane, the one the daemon serves
LATE_S = 0.001  # a send that starts more than this after it was due is late
MAX_SENDS_PER_CONNECTION = 25.0  # per second; beyond it a send carries several jobs
SAMPLE_INTERVAL_S = 0.1
READER_PAUSE_S = 0.1
READER_SCAN = "SELECT count(*) FROM jobd.all_jobs"


class LoadError(RuntimeError):
    """A load thread failed; the message names it."""


class _Failures:
    """The first error of any thread of one load generator."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def record(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.halt.set()

    def raise_error(self) -> None:
        if self.error is not None:
            raise LoadError(f"{self.what} failed: {self.error!r}") from self.error


# --- the producer --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    rate: float  # jobs per second over all connections; 0 pauses
    batch: int  # jobs per statement
    start: float  # perf_counter instant the schedule counts from
    generation: int


@dataclass
class SendLog:
    """One connection's sends (parallel arrays) and the ids they returned."""

    phase: array = field(default_factory=lambda: array("h"))
    due: array = field(default_factory=lambda: array("d"))
    sent: array = field(default_factory=lambda: array("d"))
    returned: array = field(default_factory=lambda: array("d"))
    jobs: array = field(default_factory=lambda: array("l"))
    ids: array = field(default_factory=lambda: array("q"))
    id_phase: array = field(default_factory=lambda: array("h"))


def batch_for(rate: float, connections: int) -> int:
    """Jobs per statement so that no connection sends more than its cap per second."""
    return max(1, math.ceil(rate / (connections * MAX_SENDS_PER_CONNECTION)))


class Producer:
    def __init__(self, url: str, connections: int, name: str = "pressure-producer",
                 handler: str = HANDLER) -> None:
        self.url = url
        self.handler = handler
        self.connections = connections
        self.name = name
        self.phase = 0  # set by the orchestrator; read at every send
        self.logs = [SendLog() for _ in range(connections)]
        self._plan = Plan(0.0, 1, time.perf_counter(), 0)
        self._made = [0] * connections  # sends made under the current plan, per connection
        # Per connection, the generation of the last plan of rate 0 it saw between sends.
        self._paused_under = [-1] * connections
        self._failures = _Failures("the producer")
        self._stop = threading.Event()
        self._ready = threading.Barrier(connections + 1)
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"{name}-{i}") for i in range(connections)]

    def __enter__(self) -> Producer:
        for thread in self._threads:
            thread.start()
        try:
            self._ready.wait(timeout=30)
        except threading.BrokenBarrierError:
            self._failures.raise_error()
            raise LoadError("the producer's connections did not open within 30 s") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ready.abort()
        for thread in self._threads:
            thread.join(timeout=30)

    def set_rate(self, rate: float, batch: int = 1) -> None:
        """Offer ``rate`` jobs/s from now on, ``batch`` per statement (0 pauses)."""
        self._plan = Plan(rate, batch, time.perf_counter(), self._plan.generation + 1)

    def pause(self, timeout: float = 30.0) -> None:
        """Stop sending, and return once no send is in flight, so that every job this
        producer will ever send is counted in ``jobs_sent`` (a send already under way when
        the rate went to 0 would otherwise land after the count was read)."""
        self.set_rate(0)
        generation = self._plan.generation
        deadline = time.monotonic() + timeout
        while any(seen != generation for seen in self._paused_under):
            self._failures.raise_error()
            if time.monotonic() > deadline:
                raise LoadError(f"the producer's sends did not stop within {timeout:g} s")
            time.sleep(0.005)

    def restart(self) -> None:
        """The same rate on a schedule that starts now: sends still due are dropped, so a
        phase does not inherit the previous one's backlog of sends."""
        self.set_rate(self._plan.rate, self._plan.batch)

    def behind(self) -> int:
        """Sends due by now under the current plan that have not been made."""
        plan, now = self._plan, time.perf_counter()
        if plan.rate <= 0:
            return 0
        interval = self.connections * plan.batch / plan.rate
        missing = 0
        for index, made in enumerate(self._made):
            due = math.floor((now - plan.start) / interval - index / self.connections) + 1
            missing += max(0, due - made)
        return missing

    def raise_error(self) -> None:
        self._failures.raise_error()

    @property
    def jobs_sent(self) -> int:
        return sum(len(log.ids) for log in self.logs)

    def _run(self, index: int) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True,
                                 application_name=f"{self.name}-{index}") as conn:
                try:
                    self._ready.wait(timeout=30)
                except threading.BrokenBarrierError:
                    return
                self._send_loop(index, conn)
        except BaseException as exc:  # recorded for the orchestrator, which stops the run
            self._failures.record(exc)
            self._ready.abort()

    def _send_loop(self, index: int, conn: psycopg.Connection) -> None:
        log = self.logs[index]
        cur = conn.cursor()
        spec = jobd.JobSpec(self.handler, {}, LANE)
        generation, k = -1, 0
        while not self._stop.is_set() and not self._failures.halt.is_set():
            plan = self._plan
            if plan.generation != generation:
                generation, k = plan.generation, 0
                self._made[index] = 0
            if plan.rate <= 0:
                self._paused_under[index] = plan.generation
                self._stop.wait(0.01)
                continue
            interval = self.connections * plan.batch / plan.rate
            due = plan.start + (index / self.connections + k) * interval
            wait = due - time.perf_counter()
            if wait > 0:
                # Short slices, so a new plan or a stop is seen within 20 ms.
                time.sleep(min(wait, 0.02))
                if wait > 0.02:
                    continue
            phase = self.phase
            sent = time.perf_counter()
            if plan.batch == 1:
                ids = [job_id for (job_id,) in
                       cur.execute(ENQUEUE_ONE, (self.handler,), prepare=True).fetchall()]
            else:
                ids = jobd.enqueue_many(conn, [spec] * plan.batch)
            returned = time.perf_counter()
            log.phase.append(phase)
            log.due.append(due)
            log.sent.append(sent)
            log.returned.append(returned)
            log.jobs.append(len(ids))
            log.ids.extend(ids)
            log.id_phase.extend([phase] * len(ids))
            k += 1
            if self._plan.generation == generation:
                self._made[index] = k

    def send_stats(self, phase: int) -> dict[str, Any]:
        """Call time (sent to returned), time from due to returned, and the share of late
        sends, for the sends of one phase."""
        calls, from_due = [], []
        late = jobs = 0
        for log in self.logs:
            for i, tag in enumerate(log.phase):
                if tag != phase:
                    continue
                calls.append((log.returned[i] - log.sent[i]) * 1000.0)
                from_due.append((log.returned[i] - log.due[i]) * 1000.0)
                late += log.sent[i] - log.due[i] > LATE_S
                jobs += log.jobs[i]
        calls.sort()
        from_due.sort()
        return {"sends": len(calls), "jobs": jobs,
                "call_p50_ms": percentile(calls, 50), "call_p99_ms": percentile(calls, 99),
                "call_max_ms": calls[-1] if calls else math.nan,
                "from_due_p99_ms": percentile(from_due, 99),
                "late_pct": 100.0 * late / len(calls) if calls else math.nan}

    def sent_rows(self) -> bytes:
        """Every sent job as ``id<TAB>phase`` lines, for COPY."""
        return b"".join(b"%d\t%d\n" % pair for log in self.logs
                        for pair in zip(log.ids, log.id_phase, strict=True))


# --- the horizon holders -------------------------------------------------------------------


class IdleInTransaction:
    """``BEGIN; SELECT txid_current();`` on a session of its own, held until exit."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection | None = None
        self.xid: int | None = None

    def __enter__(self) -> IdleInTransaction:
        self.conn = psycopg.connect(self.url, autocommit=False,
                                    application_name="pressure-idle-in-tx")
        row = self.conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        self.xid = int(row[0])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()


class Readers:
    """REPEATABLE READ sessions, each scanning ``jobd.all_jobs`` in one long transaction."""

    def __init__(self, url: str, count: int) -> None:
        self.url = url
        self.scans = [0] * count
        self.scan_seconds = [0.0] * count
        self._failures = _Failures("a REPEATABLE READ reader")
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"pressure-reader-{i}") for i in range(count)]

    def __enter__(self) -> Readers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
            if thread.is_alive():
                raise LoadError(f"{thread.name} did not finish its scan within 60 s")

    def raise_error(self) -> None:
        self._failures.raise_error()

    def _run(self, index: int) -> None:
        try:
            with psycopg.connect(self.url, autocommit=False,
                                 application_name=f"pressure-reader-{index}") as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                while not self._stop.is_set():
                    t0 = time.perf_counter()
                    conn.execute(READER_SCAN).fetchone()
                    self.scan_seconds[index] += time.perf_counter() - t0
                    self.scans[index] += 1
                    self._stop.wait(READER_PAUSE_S)
                conn.rollback()
        except BaseException as exc:  # recorded for the orchestrator, which stops the run
            self._failures.record(exc)


# --- wait events ---------------------------------------------------------------------------

_ACTIVITY = """
SELECT application_name, backend_type, wait_event_type, wait_event
  FROM pg_stat_activity
 WHERE datname = %s AND state = 'active' AND pid <> pg_backend_pid()
"""


def backend_kind(application_name: str, backend_type: str) -> str:
    """Which part of the benchmark a backend belongs to."""
    if application_name.startswith(("pressure-producer", "pgbench")):
        return "producer"
    if application_name.startswith("jobd worker") or application_name.startswith("jobd job"):
        return "worker"
    if application_name.startswith("jobd "):
        return "supervisor"
    if application_name.startswith("pressure-reader"):
        return "reader"
    if backend_type != "client backend":
        return backend_type
    return "other"


class WaitSampler:
    """Counts (kind, wait event) of the active backends of one database, per phase."""

    def __init__(self, admin_url: str, dbname: str) -> None:
        self.admin_url = admin_url
        self.dbname = dbname
        self.phase = 0
        self.samples: Counter[int] = Counter()
        self.counts: dict[int, Counter[tuple[str, str]]] = {}
        self._failures = _Failures("the wait-event sampler")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pressure-waits")

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def raise_error(self) -> None:
        self._failures.raise_error()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.admin_url, autocommit=True,
                                 application_name="pressure-wait-sampler") as conn:
                cur = conn.cursor()
                while not self._stop.wait(SAMPLE_INTERVAL_S):
                    phase = self.phase
                    rows = cur.execute(_ACTIVITY, (self.dbname,), prepare=True).fetchall()
                    counts = self.counts.setdefault(phase, Counter())
                    self.samples[phase] += 1
                    for app, backend_type, event_type, event in rows:
                        kind = backend_kind(app or "", backend_type or "")
                        counts[(kind, f"{event_type}:{event}" if event_type else "CPU")] += 1
        except BaseException as exc:  # recorded for the orchestrator, which stops the run
            self._failures.record(exc)

    def top(self, phase: int, per_kind: int = 3) -> dict[str, list[tuple[str, float]]]:
        """Per kind of backend, its most frequent wait events, each as the average number of
        its backends seen in that state per sample (1.0: one backend, all the time)."""
        samples = self.samples.get(phase, 0)
        by_kind: dict[str, Counter[str]] = {}
        for (kind, event), n in self.counts.get(phase, Counter()).items():
            by_kind.setdefault(kind, Counter())[event] += n
        return {kind: [(event, round(n / samples, 3)) for event, n in c.most_common(per_kind)]
                for kind, c in sorted(by_kind.items())} if samples else {}
