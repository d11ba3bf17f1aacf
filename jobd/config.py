"""The YAML configuration: parsing and validation, no I/O beyond reading the file.

Every error names the file, the line and the key that is wrong, e.g.
``config/jobd.yaml:12: lanes.default.workers: must be an integer from 0 to 256, not 'two'``.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from jobd import validation, yamlcheck
from jobd.backoff import Backoff, RetryPolicy
from jobd.db import DEFAULT_SCHEMA, DEFAULT_SESSION, POOLER_MODES, SessionSettings
from jobd.errors import ConfigError, printable
from jobd.handlers import HANDLER, SENDER, ImportPath
from jobd.yamlcheck import parse_duration

__all__ = ["Config", "LaneConfig", "ScheduleConfig", "check_schedules", "load", "parse",
           "parse_duration"]

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Where workers find the built-in handler of outbox delivery jobs (validation.OUTBOX_HANDLER).
OUTBOX_HANDLER_PATH = "jobd.outbox:deliver"
# An empty URL is a mistake, often a template variable that rendered empty: refused rather
# than falling back to $JOBD_DATABASE_URL or the local default behind the user's back.
EMPTY_URL = "is empty: give a URL, or leave the key out ($JOBD_DATABASE_URL, else the default)"
# lanes.<l>.fair_by: "handler" and "fairness_key" name one rule (a job shares by its
# fairness_key when it has one, else by its handler): a lane whose producers set no keys
# shares by handler. "none": no shares.
FAIR_BY = ("handler", "fairness_key", "none")
# schedules[].catchup and schedules[].overlap (jobd.schedules.plan, fire_schedule in SQL).
CATCHUP = ("latest", "all", "none")
OVERLAP = ("allow", "skip")
# A worker reports to the supervisor once a second (jobd.worker_status.REPORT_INTERVAL), and
# that report is its liveness: a worker_timeout shorter than two of them takes healthy
# workers for hung, and aborts and replaces them over and over, charging their jobs.
MIN_WORKER_TIMEOUT = 2.0
# A configuration is a few kilobytes; a schedule's payload in it is held to the payload
# limit besides. A larger file is a wrong path (a data file, a device), refused unparsed.
MAX_CONFIG_BYTES = 8 * 2**20
# supervisor.restart_backoff.base: seconds a slot waits before respawning after a crash.
RESTART_BASE = 0.25


@dataclass(frozen=True, slots=True)
class LaneConfig:
    name: str
    workers: int = 2
    concurrency: int = 8
    visibility_timeout: float = 30.0
    heartbeat: float = 10.0
    timeout: float | None = None
    max_attempts: int = 8
    backoff: Backoff = field(default_factory=Backoff)
    # A job that killed its worker this many times, running alone each time, is dead-lettered
    # whatever attempts it has left: each of its retries would kill a worker again, and the
    # lane's other jobs wait while the slot restarts. Applied by the supervisor's crash
    # attribution, not the workers: compare=False, so a reload changing it alone does not
    # replace the lane's workers.
    max_crashes: int = field(default=2, compare=False)
    poll_interval: float = 5.0
    # Jobs a worker process claims ahead of its free slots (None: adapted to the start rate
    # from a floor of 3 x concurrency, jobd.prefetch), so the database sees larger claims
    # while handlers see ``concurrency`` jobs at a time.
    prefetch: int | None = None
    # Outcomes written on a second connection per worker process while claims go on the
    # first (jobd/settler.py); false: one connection, outcomes ride with the claims; None
    # ("auto"): see settles_apart.
    settle_connection: bool | None = None
    # The pickup SLO (``slo.pickup``): a due job should be claimed within this many seconds.
    # Only `jobd status`, `jobd top` and the metrics read it; workers run the same with or
    # without it. compare=False so that a reload changing only the SLO does not replace the
    # lane's workers (the worker pool compares lane configs to decide that).
    slo_pickup: float | None = field(default=None, compare=False)
    # Limits across all nodes (the database enforces them in each claim, see
    # claim_jobs_limited): at most ``max_running`` jobs claimed at once, and at most
    # ``rate_limit`` jobs claimed per ``rate_per`` seconds (``rate: {limit, per}``).
    max_running: int | None = None
    rate_limit: int | None = None
    rate_per: float = 1.0
    # Fairness (docs/design/fairness.md): a due job passed over for ``max_wait`` seconds is
    # claimed ahead of younger work of any priority; with ``fair_by`` other than "none", each
    # claim is shared round-robin across the share keys of the lane's due jobs (a job's
    # fairness_key, else its handler). Both off by default: strict priority, then age.
    max_wait: float | None = None
    fair_by: str = "none"

    @property
    def ordered(self) -> bool:
        """Whether claims take the fair or age-promoting path (claim_jobs_ordered)."""
        return self.max_wait is not None or self.fair_by != "none"

    def claim_order(self, key_cursor: str | None) -> dict[str, Any]:
        """The claim parameters of the lane's fairness (claim_order in migration 0013)."""
        return {"ordered": self.ordered, "max_wait": self.max_wait,
                "fair": self.fair_by != "none", "key_cursor": key_cursor}

    def settles_apart(self, cores: int, node_workers: int) -> bool:
        """Whether the lane's workers write outcomes on a second connection, on a node of
        ``node_workers`` worker processes (every lane's) and ``cores`` cores. Auto: while the
        workers and their backends (two busy processes each in a drain) leave cores idle,
        the loop claims while the outcomes commit; with more, the cores are busy anyway and
        the second connection's transactions cost more than it overlaps
        (docs/performance.md, "Outcomes on a connection of their own": on 2 cores 1 x 10
        drained 13 % faster, 4 x 100 18 % slower)."""
        if self.settle_connection is not None:
            return self.settle_connection
        return 2 * node_workers <= cores

    @property
    def buffer_size(self) -> int:
        if self.prefetch is not None:
            return self.prefetch
        # Under max_running, jobs claimed ahead would count against the limit while they
        # wait in one worker's buffer, and other workers' slots would stay empty. With one
        # attempt a job, a whole node's crash would send the jobs it had only claimed ahead
        # to the dead-letter queue unrun: the run board that tells them from the started
        # ones dies with the node (docs/design/queue.md, "What an expired lease cannot tell").
        if self.max_running is not None or self.max_attempts == 1:
            return 0
        return 3 * self.concurrency

    @property
    def limited(self) -> bool:
        return self.max_running is not None or self.rate_limit is not None

    def budget(self) -> dict[str, Any]:
        """The claim parameters of the lane's limits (claim_jobs_limited)."""
        return {"max_running": self.max_running, "rate_limit": self.rate_limit,
                "rate_per": self.rate_per}

    def fleet_settings(self) -> dict[str, Any]:
        """The settings that every node of the lane should share: each node applies its own
        to the jobs it claims (attempts, timeout, lease, backoff) or to the limits the
        database enforces across nodes, so nodes that differ decide a job's fate by which of
        them claimed it. Stated in the node's heartbeat (migration 0044), compared by `jobd
        status` and every node. Durations in seconds; None: not set. Workers, concurrency,
        prefetch and the poll are each node's own and left out."""
        return {"max_attempts": self.max_attempts, "max_crashes": self.max_crashes,
                "timeout": self.timeout,
                "visibility_timeout": self.visibility_timeout,
                "backoff_base": self.backoff.base, "backoff_cap": self.backoff.cap,
                "max_running": self.max_running, "rate_limit": self.rate_limit,
                "rate_per": self.rate_per, "max_wait": self.max_wait,
                "fair_by": self.fair_by, "slo_pickup": self.slo_pickup}

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.backoff, self.max_attempts, self.max_crashes)


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    id: str
    cron: str
    handler: str
    timezone: str = "UTC"
    lane: str = "default"
    payload: Any = field(default_factory=dict)
    priority: int = 0
    catchup: str = "latest"
    overlap: str = "allow"


@dataclass(frozen=True, slots=True)
class Config:
    path: str | None = None
    database_url: str | None = None
    schema: str = DEFAULT_SCHEMA
    # A direct connection for LISTEN when database_url goes through a transaction-mode
    # pooler, which cannot hold one (None: database_url).
    listen_url: str | None = None
    # database.pooler and the session settings of jobd's own connections (jobd.db).
    session: SessionSettings = DEFAULT_SESSION
    node_name: str = field(default_factory=socket.gethostname)
    metrics_listen: str | None = None
    handlers: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, LaneConfig] = field(default_factory=dict)
    schedules: tuple[ScheduleConfig, ...] = ()
    # The database holds the limit every entry point enforces; `jobd migrate` writes this
    # there when the file sets it (None: leave the database's as it is).
    max_payload_bytes: int | None = None
    worker_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    duty_interval: float = 10.0
    # A transaction or replication slot holding vacuum back on jobd's tables for longer than
    # this is logged as a warning (jobd.duties.horizon_watch).
    horizon_warning: float = 300.0
    # A crash that crash attribution explains by its jobs restarts its slot after base (no
    # doubling): 250 ms rather than a second, since with poison arriving every 2 s a lane of
    # two slots spent nearly all their time waiting at 1 s (docs/performance.md, "Restarts
    # after a crash the jobs explain").
    restart_backoff: Backoff = field(default_factory=lambda: Backoff(RESTART_BASE, 60.0))
    healthy_uptime: float = 30.0
    archive_retention: float = 7 * 86400.0
    log_level: str = "info"
    outbox_lane: str = "outbox"
    outbox_senders: dict[str, str] = field(default_factory=dict)

    @property
    def workers(self) -> int:
        """The node's worker processes, every lane's."""
        return sum(lane.workers for lane in self.lanes.values())

    def worker_handlers(self) -> dict[str, str]:
        """The handler map workers load: the allow-list plus the outbox delivery handler of
        each sender (a node without a sender leaves its deliveries to the nodes that have
        it), and the one of deliveries queued by daemons of before migration 0043."""
        if not self.outbox_senders:
            return dict(self.handlers)
        deliveries = {validation.outbox_handler(name): OUTBOX_HANDLER_PATH
                      for name in self.outbox_senders}
        return {**self.handlers, validation.OUTBOX_HANDLER: OUTBOX_HANDLER_PATH, **deliveries}

    def import_paths(self) -> list[ImportPath]:
        """Everything the workers import: each handler and each outbox sender, apart (a
        sender may have a handler's name, and a map by name would check only one of them)."""
        return ([ImportPath(HANDLER, name, path) for name, path in self.worker_handlers().items()]
                + [ImportPath(SENDER, name, path) for name, path in self.outbox_senders.items()])

    def retry_policy(self, lane: str) -> RetryPolicy:
        """The lane's retry policy; defaults for a lane this node does not configure."""
        config = self.lanes.get(lane)
        return config.retry_policy if config else RetryPolicy()


def _lane(name: str, located: yamlcheck.Located, path: str) -> LaneConfig:
    section = yamlcheck.Section(located, path)
    backoff_section = section.section("backoff")
    base = backoff_section.take("base", yamlcheck.positive_duration, 1.0)
    cap = backoff_section.take("cap", yamlcheck.positive_duration, 300.0)
    if cap < base:
        raise yamlcheck.Invalid(backoff_section.line, backoff_section.path,
                                "cap must not be below base")
    backoff_section.finish()
    slo_section = section.section("slo")
    slo_pickup = slo_section.take("pickup", yamlcheck.positive_duration, None)
    slo_section.finish()
    rate_limit, rate_per = _rate(section)
    lane = LaneConfig(
        name=name,
        workers=section.take("workers", yamlcheck.int_between(0, 256), 2),
        concurrency=section.take("concurrency", yamlcheck.int_between(1, 10_000), 8),
        visibility_timeout=section.take("visibility_timeout", yamlcheck.positive_duration, 30.0),
        heartbeat=section.take("heartbeat", yamlcheck.positive_duration, 10.0),
        timeout=section.take("timeout", yamlcheck.positive_duration, None),
        max_attempts=section.take("max_attempts", yamlcheck.int_between(1, 1000), 8),
        backoff=Backoff(base, cap),
        max_crashes=section.take("max_crashes", yamlcheck.int_between(1, 1000), 2),
        poll_interval=section.take("poll_interval", yamlcheck.positive_duration, 5.0),
        prefetch=section.take("prefetch", yamlcheck.int_between(0, 10_000), None),
        settle_connection=section.take("settle_connection", yamlcheck.boolean_or_auto, None),
        slo_pickup=slo_pickup,
        max_running=section.take("max_running", yamlcheck.int_between(1, 1_000_000), None),
        rate_limit=rate_limit,
        rate_per=rate_per,
        max_wait=section.take("max_wait", yamlcheck.positive_duration, None),
        fair_by=section.take("fair_by", yamlcheck.choice(*FAIR_BY), "none"),
    )
    section.finish()
    if lane.heartbeat >= lane.visibility_timeout:
        raise yamlcheck.Invalid(
            located.line, path,
            f"heartbeat ({lane.heartbeat:g}s) must be shorter than visibility_timeout "
            f"({lane.visibility_timeout:g}s), or leases expire between renewals",
        )
    return lane


def _rate(lane: yamlcheck.Section) -> tuple[int | None, float]:
    """``rate: {limit: 100, per: 1s}``: (limit, per seconds), or (None, 1.0) without one."""
    present = "rate" in lane.items and lane.items["rate"].value is not None
    rate = lane.section("rate")
    limit = rate.take("limit", yamlcheck.int_between(1, 1_000_000), None)
    per = rate.take("per", yamlcheck.positive_duration, 1.0)
    rate.finish()
    if present and limit is None:
        raise yamlcheck.Invalid(rate.line, rate.path,
                                "needs limit: the jobs claimed per `per` (default 1s)")
    return limit, per


def _schedule(located: yamlcheck.Located, path: str, handlers: dict[str, str],
              payload_limit: int) -> ScheduleConfig:
    section = yamlcheck.Section(located, path)
    values = {key: section.take(key, convert, _SCHEDULE_DEFAULTS.get(key))
              for key, convert in _schedule_keys(handlers).items()}
    for key in ("id", "cron", "handler"):
        if values[key] is None:
            raise yamlcheck.Invalid(located.line, path, f"missing required key {key!r}")
    values["payload"] = _schedule_payload(section.raw("payload"), f"{path}.payload",
                                          payload_limit)
    section.finish()
    schedule = ScheduleConfig(**values)
    try:
        _catchup_with_overlap(schedule)
    except ValueError as exc:
        raise yamlcheck.Invalid(located.line, path, str(exc)) from None
    return schedule


# A schedule's keys that have a default, and the default (ScheduleConfig's own).
_SCHEDULE_DEFAULTS = {f.name: f.default for f in fields(ScheduleConfig)
                      if f.default is not MISSING}


def _schedule_keys(handlers: Mapping[str, str] | None) -> dict[str, Any]:
    """The check of each key of a schedule but its payload (:func:`_payload_rules`), which
    a config file's schedules and ScheduleConfig values built in Python (check_schedules)
    both pass. ``handlers``: the allow-list a schedule's handler must be in (None: any)."""

    def known_handler(value: object) -> str:
        name = validation.handler(value)
        if handlers is not None and name not in handlers:
            raise ValueError(f"handler {name!r} is not in handlers")
        return name

    return {
        "id": yamlcheck.name("schedule"),
        "cron": yamlcheck.cron,
        "handler": known_handler,
        "timezone": yamlcheck.timezone,
        "lane": yamlcheck.name("lane"),
        "priority": yamlcheck.int_between(-(2**31), 2**31 - 1),
        "catchup": yamlcheck.choice(*CATCHUP),
        "overlap": yamlcheck.choice(*OVERLAP),
    }


def _catchup_with_overlap(schedule: ScheduleConfig) -> None:
    """ValueError for ``catchup: all`` with ``overlap: skip``, which cannot both be kept.
    The occurrences a downtime missed are all due at once when it ends, so skip lets one of
    them run (the newest, jobd.schedules.plan) and records the others as skipped: the job
    for each missed occurrence that ``all`` promises would quietly be ``latest``'s one job.
    Refused, the mistake shows at load, before any downtime has lost an occurrence, and
    each alternative the message names keeps one of the two promises whole."""
    if schedule.catchup == "all" and schedule.overlap == "skip":
        raise ValueError(
            "catchup: all and overlap: skip cannot both hold: after a downtime the missed "
            "occurrences are all due at once, and skip would run one and drop the rest; use "
            "catchup: all with overlap: allow to run each (one at a time on a lane with "
            "max_running: 1), or catchup: latest with overlap: skip to run the newest")


def _payload_rules(payload: Any, limit: int) -> None:
    """ValueError unless ``payload`` meets every job's rules (jobd.validation) and its size
    is within ``limit``."""
    size = validation.utf8_size("payload", validation.encode_payload(payload))
    if size > limit:
        raise ValueError(f"payload is {size:,} bytes, over the limit of {limit:,} "
                         f"(limits.max_payload_bytes)")


def _schedule_payload(located: yamlcheck.Located | None, path: str, limit: int) -> Any:
    """A schedule's payload, held to every job's rules (jobd.validation) now, at load: a
    value YAML reads as no JSON type (a date, binary) or that jsonb cannot hold (NaN, NUL)
    would otherwise fail each time the schedule is declared or fires. Its size is held to
    the config's ``limits.max_payload_bytes``, the limit ``jobd migrate -c`` gives the
    database: a fire does not check it, and would store jobs no other entry point takes."""
    # Left out or null, {} (as for jobd.enqueue); any other value as written: [], 0, false
    # and "" are JSON values of their own.
    payload = {} if located is None or located.value is None else yamlcheck.unwrap(located)
    try:
        _payload_rules(payload, limit)
    except ValueError as exc:
        hint = (" (YAML reads an unquoted date or time, or !!binary, as no JSON value: "
                "quote it to keep it as text)" if "not JSON serializable" in str(exc) else "")
        assert located is not None  # the default, {}, is valid
        yamlcheck.fail(located.line, path, f"{exc}{hint}")
    return payload


def check_schedules(schedules: Sequence[ScheduleConfig],
                    handlers: Mapping[str, str] | None = None,
                    payload_limit: int = validation.DEFAULT_MAX_PAYLOAD_BYTES,
                    ) -> list[ScheduleConfig]:
    """ScheduleConfig values built in Python held to the rules of a config file's
    schedules, which no file checked: the same checks, which raise :class:`ConfigError`
    naming the schedule and the key. Returns them as a config stores them (a cron
    expression normalized: ``0 5-5 * * *`` as ``0 5 * * *``). ``handlers``: the allow-list
    their handlers must be in (None: any handler name); ``payload_limit``: the config's
    ``limits.max_payload_bytes``."""
    if isinstance(schedules, ScheduleConfig | str | bytes | Mapping) or not isinstance(
            schedules, Sequence):
        # One value, or a Config (materialize_schedules takes those): iterating would fail
        # with "not iterable", or go through a string's characters.
        raise TypeError(f"schedules must be a list of jobd.config.ScheduleConfig values, "
                        f"not {type(schedules).__name__}")
    checked: list[ScheduleConfig] = []
    for schedule in schedules:
        if not isinstance(schedule, ScheduleConfig):
            raise ConfigError(f"a schedule must be a jobd.config.ScheduleConfig, not "
                              f"{type(schedule).__name__}")
        where = f"schedule {printable(repr(schedule.id))}"
        values: dict[str, Any] = {}
        for key, convert in _schedule_keys(handlers).items():
            try:
                values[key] = convert(getattr(schedule, key))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{where}: {key}: {printable(str(exc))}") from None
        if values["id"] in {s.id for s in checked}:
            raise ConfigError(f"{where}: id: duplicate schedule id {values['id']!r}")
        try:
            _payload_rules(schedule.payload, payload_limit)
            _catchup_with_overlap(replace(schedule, **values))
        except ValueError as exc:
            raise ConfigError(f"{where}: {printable(str(exc))}") from None
        checked.append(replace(schedule, **values))
    return checked


def _build(root: yamlcheck.Located, path: str | None) -> Config:
    top = yamlcheck.Section(root, "")
    database = top.section("database")
    node = top.section("node")
    metrics = top.section("metrics")
    limits = top.section("limits")
    supervisor = top.section("supervisor")
    archive = top.section("archive")
    outbox = top.section("outbox")
    restart = supervisor.section("restart_backoff")

    handlers: dict[str, str] = {}
    handler_section = top.section("handlers")
    for name in list(handler_section.items):
        line = handler_section.items[name].line
        if not validation.is_name(name):
            yamlcheck.fail(line, f"handlers.{name}", "invalid handler name")
        if validation.is_outbox_handler(name):
            yamlcheck.fail(line, f"handlers.{name}", "this name is reserved for outbox delivery")
        target = handler_section.take(name, yamlcheck.string)
        if target is None or not _IMPORT_PATH.fullmatch(target):  # None: `name: null`
            yamlcheck.fail(line, f"handlers.{name}",
                           f"must be an import path module:function, not {target!r}")
        handlers[name] = target

    lanes: dict[str, LaneConfig] = {}
    lane_section = top.section("lanes")
    for name, located in lane_section.items.items():
        if not validation.is_name(name):
            yamlcheck.fail(located.line, f"lanes.{name}", "invalid lane name")
        lanes[name] = _lane(name, located, f"lanes.{name}")
    lane_section.items.clear()

    max_payload_bytes = limits.take(
        "max_payload_bytes", yamlcheck.int_between(1, 256 * 1024 * 1024), None)
    schedules: list[ScheduleConfig] = []
    schedules_raw = top.raw("schedules")
    if schedules_raw is not None and schedules_raw.value is not None:
        if not isinstance(schedules_raw.value, list):
            yamlcheck.fail(schedules_raw.line, "schedules", "must be a list")
        for index, item in enumerate(schedules_raw.value):
            schedule = _schedule(item, f"schedules[{index}]", handlers,
                                 max_payload_bytes or validation.DEFAULT_MAX_PAYLOAD_BYTES)
            if schedule.id in {s.id for s in schedules}:
                yamlcheck.fail(item.line, f"schedules[{index}].id",
                               f"duplicate schedule id {schedule.id!r}")
            schedules.append(schedule)

    config = Config(
        path=path,
        database_url=database.take("url", yamlcheck.connection_string, empty=EMPTY_URL),
        schema=database.take("schema", yamlcheck.schema_name, DEFAULT_SCHEMA),
        listen_url=database.take("listen_url", yamlcheck.connection_string, empty=EMPTY_URL),
        session=_session(database),
        node_name=node.take("name", yamlcheck.name("node")) or socket.gethostname(),
        metrics_listen=metrics.take("listen", yamlcheck.listen),
        handlers=handlers,
        lanes=lanes,
        schedules=tuple(schedules),
        max_payload_bytes=max_payload_bytes,
        worker_timeout=supervisor.take("worker_timeout", _worker_timeout, 30.0),
        shutdown_timeout=supervisor.take("shutdown_timeout", yamlcheck.positive_duration, 30.0),
        duty_interval=supervisor.take("duty_interval", yamlcheck.positive_duration, 10.0),
        horizon_warning=supervisor.take("horizon_warning", yamlcheck.positive_duration, 300.0),
        restart_backoff=_restart_backoff(restart),
        healthy_uptime=supervisor.take("healthy_uptime", yamlcheck.positive_duration, 30.0),
        outbox_lane=outbox.take("lane", yamlcheck.name("lane"), "outbox"),
        outbox_senders=_senders(outbox.section("senders")),
        log_level=supervisor.take(
            "log_level", yamlcheck.choice("debug", "info", "warning", "error"), "info"),
        archive_retention=archive.take("retention", yamlcheck.positive_duration, 7 * 86400.0),
    )
    for section in (database, node, metrics, limits, restart, supervisor, archive, outbox, top):
        section.finish()
    if config.outbox_senders and config.outbox_lane not in config.lanes:
        yamlcheck.fail(outbox.line, "outbox.lane", "outbox senders are configured but lane "
                       f"{config.outbox_lane!r} is not in lanes")
    return config


def _worker_timeout(value: object) -> float:
    seconds = yamlcheck.parse_duration(value)
    if seconds < MIN_WORKER_TIMEOUT:
        raise ValueError(f"must be at least {MIN_WORKER_TIMEOUT:g}s, not {value!r}: workers "
                         "report once a second, and one silent this long is killed as hung")
    return seconds


def _session(database: yamlcheck.Section) -> SessionSettings:
    """``database.pooler`` and the timeouts of jobd's sessions (0 turns one off)."""
    default = DEFAULT_SESSION
    return SessionSettings(
        pooler=database.take("pooler", yamlcheck.choice(*POOLER_MODES), default.pooler),
        statement_timeout=database.take("statement_timeout", yamlcheck.parse_duration,
                                        default.statement_timeout),
        lock_timeout=database.take("lock_timeout", yamlcheck.parse_duration,
                                   default.lock_timeout),
        idle_in_transaction_session_timeout=database.take(
            "idle_in_transaction_session_timeout", yamlcheck.parse_duration,
            default.idle_in_transaction_session_timeout),
    )


def _restart_backoff(section: yamlcheck.Section) -> Backoff:
    base = section.take("base", yamlcheck.positive_duration, RESTART_BASE)
    cap = section.take("cap", yamlcheck.positive_duration, 60.0)
    if cap < base:
        raise yamlcheck.Invalid(section.line, section.path, "cap must not be below base")
    return Backoff(base, cap)


def _senders(section: yamlcheck.Section) -> dict[str, str]:
    senders = {}
    for name in list(section.items):
        line = section.items[name].line
        target = section.take(name, yamlcheck.string)
        if (not validation.is_name(name) or target is None
                or not _IMPORT_PATH.fullmatch(target)):
            yamlcheck.fail(line, f"outbox.senders.{name}",
                           f"must be name: module:function, not {name}: {target!r}")
        try:
            validation.sender(name)
        except ValueError as error:
            yamlcheck.fail(line, f"outbox.senders.{name}", str(error))
        senders[name] = target
    return senders


def parse(text: str, source: str = "<config>") -> Config:
    """Parse configuration text; :class:`ConfigError` names ``source``, line and key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(_invalid_yaml(exc, source)) from None
    if node is None or node.tag == "tag:yaml.org,2002:null":
        # Empty, or comments alone: a file truncated mid-deploy, most likely. Taken as a
        # config of no lanes, it would stop every worker of a node reloading it.
        raise ConfigError(f"{source}: the configuration is empty: it must declare at least "
                          "the node's lanes (see config/jobd.example.yaml)")
    try:
        return _build(yamlcheck.plain(node), source)
    except yamlcheck.Invalid as exc:
        key = f" {printable(exc.path)}:" if exc.path else ""
        raise ConfigError(f"{source}:{exc.line}:{key} {printable(exc.message)}") from None


def _invalid_yaml(exc: yaml.YAMLError, source: str) -> str:
    """One line: the file, the line when YAML knows it, and the problem without the
    excerpt of the document that PyYAML appends on lines of their own."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{source}:{mark.line + 1}" if mark else source
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    return f"{where}: invalid YAML: {' '.join(str(problem).split())}"


def _read_capped(path: Path) -> bytes:
    """The file's bytes, at most one more than MAX_CONFIG_BYTES: a device that never ends
    (``-c /dev/zero``, ``/dev/urandom``) would otherwise be read until memory runs out. A
    pipe is read like a file (``-c <(render-config)``)."""
    with path.open("rb") as file:
        return file.read(MAX_CONFIG_BYTES + 1)


def load(path: str | Path) -> Config:
    """Read and validate the configuration file at ``path``.

    Whatever is wrong with the file, missing, a directory, not UTF-8, nested beyond what the
    parser can follow, is a :class:`ConfigError` naming it: the CLI exits 2 on it and a
    daemon's reload refuses the file and keeps its running config.
    """
    try:
        data = _read_capped(Path(path))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: "
                          f"{exc.strerror or exc}") from None
    except ValueError as exc:  # a path with a NUL character
        raise ConfigError(f"{path!r}: cannot read the configuration: {exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: the configuration is larger than "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB: not a jobd configuration")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}:{line}: the configuration is not UTF-8 text (byte "
                          f"0x{data[exc.start]:02x} at offset {exc.start})") from None
    try:
        return parse(text, str(path))
    except RecursionError:
        raise ConfigError(f"{path}: the configuration is nested too deeply") from None
