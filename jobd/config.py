"""The YAML configuration: parsing and validation, no I/O beyond reading the file.

Every error names the file, the line and the key that is wrong, e.g.
``config/jobd.yaml:12: lanes.default.workers: must be an integer from 1 to 256, not 'two'``.
"""

from __future__ import annotations

import math
import re
import socket
import zoneinfo
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobd import validation
from jobd.backoff import Backoff, RetryPolicy
from jobd.cron import CronError, CronSchedule
from jobd.db import DEFAULT_SCHEMA, validate_schema
from jobd.errors import ConfigError, UsageError

# Longer durations are certainly a mistake, and PostgreSQL cannot add huge ones to now().
MAX_DURATION_SECONDS = 3650 * 86400.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Where workers find the built-in handler of outbox delivery jobs (validation.OUTBOX_HANDLER).
OUTBOX_HANDLER_PATH = "jobd.outbox:deliver"
_LISTEN = re.compile(r"^(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def parse_duration(value: object) -> float:
    """``30s``, ``5m``, ``250ms``, ``1h``, ``2d`` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s or 5m, not {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"expected a duration like 30s, 5m or 250ms, not {value!r}")
        seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be a finite number, not {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative: {value!r}")
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"a duration cannot exceed 3650d, not {value!r}")
    return seconds


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
    poll_interval: float = 5.0

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.backoff, self.max_attempts)


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
    restart_backoff: Backoff = field(default_factory=lambda: Backoff(1.0, 60.0))
    healthy_uptime: float = 30.0
    archive_retention: float = 7 * 86400.0
    log_level: str = "info"
    outbox_lane: str = "outbox"
    outbox_senders: dict[str, str] = field(default_factory=dict)

    def worker_handlers(self) -> dict[str, str]:
        """The handler map workers load: the allow-list plus the outbox delivery handler."""
        if not self.outbox_senders:
            return dict(self.handlers)
        return {**self.handlers, validation.OUTBOX_HANDLER: OUTBOX_HANDLER_PATH}

    def retry_policy(self, lane: str) -> RetryPolicy:
        """The lane's retry policy; defaults for a lane this node does not configure."""
        config = self.lanes.get(lane)
        return config.retry_policy if config else RetryPolicy()


# --- reading YAML with line numbers --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Located:
    """A parsed YAML value with the line it came from."""

    value: Any
    line: int


def _plain(node: yaml.Node, path: str = "") -> _Located:
    """Convert a YAML node; a mapping's values carry the line of their key."""
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        mapping: dict[str, _Located] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            key = yaml.safe_load(yaml.serialize(key_node))
            if not isinstance(key, str):
                raise _Invalid(key_line, path, f"keys must be strings, not {key!r}")
            key_path = f"{path}.{key}" if path else key
            if key in mapping:
                raise _Invalid(key_line, key_path, "duplicate key")
            value = _plain(value_node, key_path)
            mapping[key] = _Located(value.value, key_line)
        return _Located(mapping, line)
    if isinstance(node, yaml.SequenceNode):
        return _Located([_plain(item, f"{path}[{i}]") for i, item in enumerate(node.value)],
                        line)
    return _Located(yaml.safe_load(yaml.serialize(node)), line)


class _Invalid(Exception):
    def __init__(self, line: int, path: str, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.path = path
        self.message = message


class _Section:
    """A mapping being validated: takes keys off it and reports unknown ones."""

    def __init__(self, located: _Located, path: str) -> None:
        if located.value is None:
            located = _Located({}, located.line)
        if not isinstance(located.value, dict):
            raise _Invalid(located.line, path, "must be a mapping")
        self.items: dict[str, _Located] = dict(located.value)
        self.line = located.line
        self.path = path

    def _key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, convert: Any, default: Any = None) -> Any:
        located = self.items.pop(key, None)
        if located is None or located.value is None:
            return default
        try:
            return convert(located.value)
        except (ValueError, TypeError) as exc:
            raise _Invalid(located.line, self._key_path(key), str(exc)) from None

    def section(self, key: str) -> _Section:
        located = self.items.pop(key, None) or _Located({}, self.line)
        return _Section(located, self._key_path(key))

    def raw(self, key: str) -> _Located | None:
        return self.items.pop(key, None)

    def finish(self) -> None:
        for key, located in self.items.items():
            raise _Invalid(located.line, self._key_path(key), "unknown key")


def _int_between(low: int, high: int) -> Any:
    def convert(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, not {value!r}")
        return value

    return convert


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be longer than zero, not {value!r}")
    return seconds


def _name(kind: str) -> Any:
    def convert(value: object) -> str:
        return validation.name(kind, value)

    return convert


def _string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, not {value!r}")
    return value


def _choice(*options: str) -> Any:
    def convert(value: object) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}, not {value!r}")
        return str(value)

    return convert


def _timezone(value: object) -> str:
    try:
        zoneinfo.ZoneInfo(_string(value))
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {value!r} (use an IANA name like Europe/Berlin)") from None
    return str(value)


def _listen(value: object) -> str:
    match = _LISTEN.match(_string(value))
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"must be HOST:PORT, e.g. 127.0.0.1:9464, not {value!r}")
    return str(value)


def _lane(name: str, located: _Located, path: str) -> LaneConfig:
    section = _Section(located, path)
    backoff_section = section.section("backoff")
    base = backoff_section.take("base", _positive_duration, 1.0)
    cap = backoff_section.take("cap", _positive_duration, 300.0)
    if cap < base:
        raise _Invalid(backoff_section.line, backoff_section.path, "cap must not be below base")
    backoff_section.finish()
    lane = LaneConfig(
        name=name,
        workers=section.take("workers", _int_between(0, 256), 2),
        concurrency=section.take("concurrency", _int_between(1, 10_000), 8),
        visibility_timeout=section.take("visibility_timeout", _positive_duration, 30.0),
        heartbeat=section.take("heartbeat", _positive_duration, 10.0),
        timeout=section.take("timeout", _positive_duration, None),
        max_attempts=section.take("max_attempts", _int_between(1, 1000), 8),
        backoff=Backoff(base, cap),
        poll_interval=section.take("poll_interval", _positive_duration, 5.0),
    )
    section.finish()
    if lane.heartbeat >= lane.visibility_timeout:
        raise _Invalid(
            located.line, path,
            f"heartbeat ({lane.heartbeat:g}s) must be shorter than visibility_timeout "
            f"({lane.visibility_timeout:g}s), or leases expire between renewals",
        )
    return lane


def _cron(value: object) -> str:
    try:
        return CronSchedule.parse(_string(value)).expression
    except CronError as exc:
        raise ValueError(str(exc)) from None


def _schedule(located: _Located, path: str, handlers: dict[str, str]) -> ScheduleConfig:
    section = _Section(located, path)

    def known_handler(value: object) -> str:
        name = _name("handler")(value)
        if name not in handlers:
            raise ValueError(f"handler {name!r} is not in handlers")
        return name

    schedule = ScheduleConfig(
        id=section.take("id", _name("schedule")),
        cron=section.take("cron", _cron),
        handler=section.take("handler", known_handler),
        timezone=section.take("timezone", _timezone, "UTC"),
        lane=section.take("lane", _name("lane"), "default"),
        payload=_unwrap(section.raw("payload")) or {},
        priority=section.take("priority", _int_between(-(2**31), 2**31 - 1), 0),
        catchup=section.take("catchup", _choice("latest", "all", "none"), "latest"),
        overlap=section.take("overlap", _choice("allow", "skip"), "allow"),
    )
    for key in ("id", "cron", "handler"):
        if getattr(schedule, key) is None:
            raise _Invalid(located.line, path, f"missing required key {key!r}")
    section.finish()
    return schedule


def _unwrap(located: _Located | None) -> Any:
    if located is None:
        return None
    if isinstance(located.value, dict):
        return {key: _unwrap(value) for key, value in located.value.items()}
    if isinstance(located.value, list):
        return [_unwrap(value) for value in located.value]
    return located.value


def _build(root: _Located, path: str | None) -> Config:
    top = _Section(root, "")
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
            _raise(line, f"handlers.{name}", "invalid handler name")
        if name == validation.OUTBOX_HANDLER:
            _raise(line, f"handlers.{name}", "this name is reserved for outbox delivery")
        target = handler_section.take(name, _string)
        if not _IMPORT_PATH.match(target):
            _raise(line, f"handlers.{name}",
                   f"must be an import path module:function, not {target!r}")
        handlers[name] = target

    lanes: dict[str, LaneConfig] = {}
    lane_section = top.section("lanes")
    for name, located in lane_section.items.items():
        if not validation.is_name(name):
            _raise(located.line, f"lanes.{name}", "invalid lane name")
        lanes[name] = _lane(name, located, f"lanes.{name}")
    lane_section.items.clear()

    schedules = []
    schedules_raw = top.raw("schedules")
    if schedules_raw is not None and schedules_raw.value is not None:
        if not isinstance(schedules_raw.value, list):
            _raise(schedules_raw.line, "schedules", "must be a list")
        for index, item in enumerate(schedules_raw.value):
            schedule = _schedule(item, f"schedules[{index}]", handlers)
            if schedule.id in {s.id for s in schedules}:
                _raise(item.line, f"schedules[{index}].id",
                       f"duplicate schedule id {schedule.id!r}")
            schedules.append(schedule)

    config = Config(
        path=path,
        database_url=database.take("url", _string),
        schema=database.take("schema", _schema_name, DEFAULT_SCHEMA),
        node_name=node.take("name", _name("node")) or socket.gethostname(),
        metrics_listen=metrics.take("listen", _listen),
        handlers=handlers,
        lanes=lanes,
        schedules=tuple(schedules),
        max_payload_bytes=limits.take(
            "max_payload_bytes", _int_between(1, 256 * 1024 * 1024), None),
        worker_timeout=supervisor.take("worker_timeout", _positive_duration, 30.0),
        shutdown_timeout=supervisor.take("shutdown_timeout", _positive_duration, 30.0),
        duty_interval=supervisor.take("duty_interval", _positive_duration, 10.0),
        restart_backoff=_restart_backoff(restart),
        healthy_uptime=supervisor.take("healthy_uptime", _positive_duration, 30.0),
        outbox_lane=outbox.take("lane", _name("lane"), "outbox"),
        outbox_senders=_senders(outbox.section("senders")),
        log_level=supervisor.take("log_level", _choice("debug", "info", "warning", "error"),
                                  "info"),
        archive_retention=archive.take("retention", _positive_duration, 7 * 86400.0),
    )
    for section in (database, node, metrics, limits, restart, supervisor, archive, outbox, top):
        section.finish()
    if config.outbox_senders and config.outbox_lane not in config.lanes:
        _raise(outbox.line, "outbox.lane",
               f"outbox senders are configured but lane {config.outbox_lane!r} is not in lanes")
    return config


def _restart_backoff(section: _Section) -> Backoff:
    base = section.take("base", _positive_duration, 1.0)
    cap = section.take("cap", _positive_duration, 60.0)
    if cap < base:
        raise _Invalid(section.line, section.path, "cap must not be below base")
    return Backoff(base, cap)


def _senders(section: _Section) -> dict[str, str]:
    senders = {}
    for name in list(section.items):
        line = section.items[name].line
        target = section.take(name, _string)
        if not validation.is_name(name) or not _IMPORT_PATH.match(target):
            _raise(line, f"outbox.senders.{name}",
                   f"must be name: module:function, not {name}: {target!r}")
        senders[name] = target
    return senders


def _schema_name(value: object) -> str:
    try:
        return validate_schema(_string(value))
    except UsageError as exc:
        raise ValueError(str(exc)) from None


def _raise(line: int, path: str, message: str) -> None:
    raise _Invalid(line, path, message)


def parse(text: str, source: str = "<config>") -> Config:
    """Parse configuration text; :class:`ConfigError` names ``source``, line and key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if node is None:
        return Config(path=source)
    try:
        return _build(_plain(node), source)
    except _Invalid as exc:
        key = f" {exc.path}:" if exc.path else ""
        raise ConfigError(f"{source}:{exc.line}:{key} {exc.message}") from None


def load(path: str | Path) -> Config:
    """Read and validate the configuration file at ``path``.

    Whatever is wrong with the file, missing, a directory, not UTF-8, nested beyond what the
    parser can follow, is a :class:`ConfigError` naming it: the CLI exits 2 on it and a
    daemon's reload refuses the file and keeps its running config.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: "
                          f"{exc.strerror or exc}") from None
    except ValueError as exc:  # a path with a NUL character
        raise ConfigError(f"{path!r}: cannot read the configuration: {exc}") from None
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
