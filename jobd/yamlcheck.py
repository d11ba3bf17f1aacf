"""Reading a YAML document with the line of every value, and the checks its values pass.

Generic: nothing here knows jobd's keys (jobd.config does). Every failure is an
:class:`Invalid` carrying the line and the dotted path of the key, which the config turns
into ``file:line: key: message``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Context, Decimal
from typing import Any, NoReturn

import yaml

from jobd import validation
from jobd.cron import CronError, CronSchedule, time_zone
from jobd.db import validate_schema
from jobd.errors import UsageError

# Longer durations are certainly a mistake, and PostgreSQL cannot add huge ones to now().
MAX_DURATION_SECONDS = 3650 * 86400.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
# Exact factors: a duration is the nearest float to its number times the unit, so one
# duration written in two units is one value (700ms * 0.001 was 0.7000000000000001, not the
# 0.7 of 0.7s, and nodes were told they configure a lane differently).
_UNIT_SECONDS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60),
                 "h": Decimal(3600), "d": Decimal(86400), None: Decimal(1)}
# A context of its own, not the thread's (a handler module may set that one's precision):
# digits enough for any duration a float can hold, and no traps, so a number too large for
# it becomes Infinity, refused below as no finite number.
_EXACT = Context(prec=40, traps=[])
_INT_TAG = "tag:yaml.org,2002:int"
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")
# Values that YAML aliases may repeat in one document (an anchored schedule payload used by
# several schedules is a few hundred); beyond it the document is refused (_Expansion).
MAX_ALIAS_VALUES = 100_000
_LISTEN = re.compile(r"^(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def parse_duration(value: object, capped: bool = True) -> float:
    """``30s``, ``5m``, ``250ms``, ``1h``, ``2d`` or a bare number of seconds, up to 3650d
    unless not ``capped`` (a caller that applies a rule of its own)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s or 5m, not {value!r}")
    if isinstance(value, int) and abs(value) > MAX_DURATION_SECONDS:
        # Before float(): an integer of hundreds of digits overflows it.
        raise ValueError("a duration cannot exceed 3650d" if value > 0
                         else "a duration cannot be negative")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            if str(value).strip().startswith("-") and _DURATION.match(str(value).strip()[1:]):
                raise ValueError(f"a duration cannot be negative: {value!r}")
            raise ValueError(f"expected a duration like 30s, 5m or 250ms, not {value!r}")
        seconds = float(_EXACT.multiply(Decimal(match[1]), _UNIT_SECONDS[match[2]]))
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be a finite number, not {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative: {value!r}")
    if capped and seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"a duration cannot exceed 3650d, not {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class Located:
    """A parsed YAML value with the line it came from, and for an integer written other than
    in decimal, how it was written (jobd's own keys refuse it: :meth:`Section.take`)."""

    value: Any
    line: int
    not_decimal: str | None = None


class _Expansion:
    """The values a document's aliases have repeated so far. An alias costs nothing to
    write and is expanded where it is used: nine lines of aliases of aliases ("billion
    laughs") expand to hundreds of millions of values, which would hold a command, or a
    daemon's reload, for minutes and take the machine's memory before any key is checked."""

    def __init__(self) -> None:
        self.converted: set[int] = set()
        self.repeated = 0

    def count(self, node: yaml.Node, line: int, path: str) -> None:
        if id(node) not in self.converted:
            self.converted.add(id(node))
            return
        self.repeated += 1
        if self.repeated > MAX_ALIAS_VALUES:
            raise Invalid(line, path, f"YAML aliases here expand to more than "
                                      f"{MAX_ALIAS_VALUES:,} repeated values")


def plain(node: yaml.Node, path: str = "", within: frozenset[int] = frozenset(),
          expansion: _Expansion | None = None) -> Located:
    """Convert a YAML node; a mapping's values carry the line of their key. ``within``: the
    collections the node is inside, so that an alias of one of them (a cycle, which no
    config means) is refused where it is, rather than followed until Python's recursion
    limit. ``expansion``: what aliases have repeated so far in the document (bounded)."""
    line = node.start_mark.line + 1
    expansion = expansion if expansion is not None else _Expansion()
    expansion.count(node, line, path)
    if isinstance(node, yaml.CollectionNode):
        if id(node) in within:
            raise Invalid(line, path, "a YAML alias here refers to a collection that "
                                      "contains it (a cycle)")
        within = within | {id(node)}
    if isinstance(node, yaml.MappingNode):
        mapping: dict[str, Located] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            key = _scalar(key_node, key_line, path)
            if not isinstance(key, str):
                raise Invalid(key_line, path, f"keys must be strings, not {key!r}")
            key_path = f"{path}.{key}" if path else key
            if key in mapping:
                raise Invalid(key_line, key_path, "duplicate key")
            value = plain(value_node, key_path, within, expansion)
            mapping[key] = Located(value.value, key_line, value.not_decimal)
        return Located(mapping, line)
    if isinstance(node, yaml.SequenceNode):
        return Located([plain(item, f"{path}[{i}]", within, expansion)
                        for i, item in enumerate(node.value)], line)
    value = _scalar(node, line, path)
    written = node.value.replace("_", "")
    not_decimal = (node.value if node.tag == _INT_TAG and not _DECIMAL.fullmatch(written)
                   else None)
    return Located(value, line, not_decimal)


def _scalar(node: yaml.Node, line: int, path: str) -> Any:
    """The value of a scalar node (an empty one is null: the key's default). Composing the
    document accepted what constructing the value may still refuse: a tag the safe loader
    does not know (!!python/object), a lone "!", a value its tag cannot read (!!int abc)."""
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise Invalid(line, path, f"invalid YAML value: {' '.join(str(problem).split())}"
                      ) from None
    except Exception as exc:  # the safe loader's own constructors fail this way
        raise Invalid(line, path, f"invalid YAML value {node.value!r} for its tag "
                                  f"{node.tag}: {type(exc).__name__}") from None


class Invalid(Exception):
    def __init__(self, line: int, path: str, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.path = path
        self.message = message


class Section:
    """A mapping being validated: takes keys off it and reports unknown ones."""

    def __init__(self, located: Located, path: str) -> None:
        if located.value is None:
            located = Located({}, located.line)
        if not isinstance(located.value, dict):
            raise Invalid(located.line, path, "must be a mapping")
        self.items: dict[str, Located] = dict(located.value)
        self.line = located.line
        self.path = path

    def _key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, convert: Any, default: Any = None, *,
             empty: str | None = None) -> Any:
        """The key's value converted, or ``default`` when it is missing or null (written as
        ``~``, ``null`` or nothing), unless ``empty`` says why a null is refused."""
        located = self.items.pop(key, None)
        if located is not None and located.value is None and empty is not None:
            raise Invalid(located.line, self._key_path(key), empty)
        if located is None or located.value is None:
            return default
        if located.not_decimal is not None:
            # YAML 1.1 reads 010 as 8 and 1:30 as 90, which nobody writing a setting means.
            raise Invalid(located.line, self._key_path(key),
                          f"write integers in decimal, not {located.not_decimal!r} (YAML 1.1 "
                          f"would read it as {located.value})")
        try:
            return convert(unwrap(located))
        except (ValueError, TypeError) as exc:
            raise Invalid(located.line, self._key_path(key), str(exc)) from None

    def section(self, key: str) -> Section:
        located = self.items.pop(key, None) or Located({}, self.line)
        return Section(located, self._key_path(key))

    def raw(self, key: str) -> Located | None:
        return self.items.pop(key, None)

    def finish(self) -> None:
        for key, located in self.items.items():
            raise Invalid(located.line, self._key_path(key), "unknown key")


def int_between(low: int, high: int) -> Any:
    def convert(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, not {value!r}")
        return value

    return convert


def boolean_or_auto(value: object) -> bool | None:
    """true, false, or "auto" (None: the program decides)."""
    if isinstance(value, str) and value.lower() == "auto":
        return None
    if not isinstance(value, bool):
        raise ValueError(f"must be true, false or auto, not {value!r}")
    return value


def positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be longer than zero, not {value!r}")
    return seconds


def name(kind: str) -> Any:
    def convert(value: object) -> str:
        return validation.name(kind, value)

    return convert


def string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, not {value!r}")
    return value


def connection_string(value: object) -> str:
    """A database URL or conninfo. Refused, it is not quoted: it may hold a password, and a
    refused reload writes the message to the daemon's log."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string (a connection URL), not a "
                         f"{type(value).__name__}")
    return value


def choice(*options: str) -> Any:
    def convert(value: object) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}, not {value!r}")
        return str(value)

    return convert


def timezone(value: object) -> str:
    try:
        time_zone(string(value))
    except CronError as exc:
        raise ValueError(str(exc)) from None
    return str(value)


def listen(value: object) -> str:
    match = _LISTEN.match(string(value))
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"must be HOST:PORT, e.g. 127.0.0.1:9464, not {value!r}")
    return str(value)


def cron(value: object) -> str:
    try:
        return CronSchedule.parse(string(value)).expression
    except CronError as exc:
        raise ValueError(str(exc)) from None


def unwrap(located: Located | None) -> Any:
    if located is None:
        return None
    if isinstance(located.value, dict):
        return {key: unwrap(value) for key, value in located.value.items()}
    if isinstance(located.value, list):
        return [unwrap(value) for value in located.value]
    return located.value


def schema_name(value: object) -> str:
    try:
        return validate_schema(string(value))
    except UsageError as exc:
        raise ValueError(str(exc)) from None


def fail(line: int, path: str, message: str) -> NoReturn:
    raise Invalid(line, path, message)
