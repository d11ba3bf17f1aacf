"""The argparse types of the ``jobd`` command line: each checks one argument before any
command runs (ids, integers, names, JSON payloads and payload fields, timestamps, durations)
and turns what the user got wrong into a one-line usage error."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any, BinaryIO

from jobd import validation
from jobd.config import parse_duration

BIGINT_MAX = 2**63 - 1


# What PostgreSQL reads as an integer: ASCII digits, a sign, blanks around. (Python's int()
# also takes 1_000 and other scripts' digits, which SQL would refuse.)
_INTEGER = re.compile(r"[ \t]*[-+]?[0-9]+[ \t]*", re.ASCII)


def _integer(text: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}")
    return int(text)


def positive_int(text: str) -> int:
    """1 up to the largest bigint: ids and limits go to PostgreSQL as bigint."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    if value > BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"too large: at most {BIGINT_MAX}")
    return value


def not_empty(text: str) -> str:
    """A value that must be given when the option is: an empty one (``--database-url
    "$UNSET"``) would otherwise fall back to the default, the local server's postgres
    database, and run the command there."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave the option out for its "
                                         "default)")
    return text


def up_to(most: int) -> Callable[[str], int]:
    """1 up to ``most``: a count whose answer is built in memory before it is printed."""
    def count(text: str) -> int:
        value = positive_int(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"at most {most:,}, not {value:,}")
        return value
    return count


def lane_name(text: str) -> str:
    """A lane filter: a name no lane can have is a mistake, not an empty listing. (A valid name
    the config lacks still filters: the jobs of a lane since removed stay listed.)"""
    if "\x00" in text:
        return text  # refused after parsing, as in any argument, naming it (jobd.cli)
    try:
        return validation.name("lane", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int32(text: str) -> int:
    value = _integer(text)
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"out of range for a 32-bit integer: {value}")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (PostgreSQL refuses it)")


def _json_float(text: str) -> float | int:
    """A JSON number written with a fraction or an exponent, as a float. Beyond a float's
    range (1e400) it stays exact, as jsonb keeps it: a whole number, which is what a handler
    gets (jsonb prints it without an exponent), within the integers' 4300-digit bound."""
    value = float(text)
    if math.isfinite(value):
        return value
    exact = Decimal(text)
    if exact != exact.to_integral_value():
        raise ValueError(f"{text[:40]} is beyond a float's range and not a whole number")
    if abs(exact) >= _DECODABLE_INTEGER_BOUND:
        raise ValueError(_TOO_MANY_DIGITS)
    return int(exact)


_DECODABLE_INTEGER_BOUND = 10**4300
_TOO_MANY_DIGITS = ("an integer has more than 4300 digits, which a handler could not "
                    "decode")


def _contains_nul(value: Any) -> bool:
    """Whether any string (key or value) holds NUL; iterative, so depth cannot overflow."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def payload(text: str) -> Any:
    """The decoded payload: JSON that Python can decode and PostgreSQL can store.

    json.loads accepts NaN and Infinity and turns 1e999 into infinity, none of which jsonb
    holds; it fails with RecursionError on deep nesting and ValueError on integers of more
    than 4300 digits. All of these are the user's input, so they are refused here, at
    argument parsing, with a message instead of a traceback.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_json_float)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(
            "payload is nested too deeply to be decoded") from None
    except ValueError as exc:
        message = str(exc)
        if "integer string conversion" in message:
            message = _TOO_MANY_DIGITS
        raise argparse.ArgumentTypeError(f"payload refused: {message}") from None
    if _contains_nul(value):
        raise argparse.ArgumentTypeError(
            "payload refused: a string contains NUL (\\u0000), which PostgreSQL cannot store")
    return value


# More than a jsonb value can hold (255 MiB): a payload read from a file or a pipe stops
# here rather than reading on into memory.
MAX_PAYLOAD_READ = 256 * 1024 * 1024


def payload_argument(text: str) -> validation.JsonText:
    """``--payload``: JSON text, ``@FILE`` to read it from a file, or ``-`` to read it from
    standard input (neither ``@`` nor ``-`` can start a JSON text). A payload larger than
    the command line takes (about 128 KiB on Linux) has to come from one of those. Checked
    here; sent as written, so that its numbers keep every digit (jobd.validation.JsonText)."""
    if text == "-":
        return _checked_text(_decoded(_read_stdin(), "standard input"))
    if text.startswith("@"):
        path = text[1:]
        if not path:
            raise argparse.ArgumentTypeError("@ needs a file name: --payload @payload.json")
        try:
            with open(path, "rb") as source:
                data = _read_at_most(source)
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"cannot read the payload file {path!r}: {exc.strerror}") from None
        return _checked_text(_decoded(data, f"the payload file {path!r}"))
    return _checked_text(text)


def _checked_text(text: str) -> validation.JsonText:
    """The text as a payload, checked by the rules every entry point shares (a decode of its
    own refused what jobd.enqueue takes: a number too long in a member that a later one of
    the same name replaces)."""
    checked = validation.JsonText(text)
    try:
        validation.encode_payload(checked)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return checked


def _read_stdin() -> bytes:
    if sys.stdin is None:  # closed (`<&-`): Python has no stream for it
        raise argparse.ArgumentTypeError("- reads standard input, which is closed")
    try:
        return _read_at_most(sys.stdin.buffer)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot read standard input: {exc.strerror}") from None


def _read_at_most(source: BinaryIO) -> bytes:
    data = source.read(MAX_PAYLOAD_READ + 1)
    if len(data) > MAX_PAYLOAD_READ:
        raise argparse.ArgumentTypeError(
            "payload refused: larger than 256 MiB (a jsonb value holds at most 255 MiB)")
    return data


def _decoded(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"payload refused: {source} is not UTF-8 (byte {exc.start})") from None


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's json reads them, JSON has no such words."""


def _not_json(name: str) -> Any:
    raise _NotJson(name)


def where(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``: a payload field to match. VALUE is JSON when it parses as JSON (42,
    true, "42", {"a": 1}), else the text itself (a@example.com, NaN)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text[:40]!r}")
    try:
        json.loads(value, parse_constant=_not_json)
    except (json.JSONDecodeError, _NotJson):
        return key, value
    except (ValueError, RecursionError):
        pass  # a number too long, nested too deeply: payload says which
    return key, payload(value)


def timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 timestamp: {text!r} (e.g. 2026-12-01T09:30:00+01:00)") from None
    if value.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no UTC offset; add one (e.g. +00:00 or Z) so the instant is exact")
    return value


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def delay(text: str) -> float:
    """``enqueue --delay``: a duration without the config's 3650d cap; jobd.enqueue's rule
    (below 10**9 seconds) decides, as for every other entry point."""
    try:
        return validation.delay(parse_duration(text, capped=False))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# A refresh more often than this would load the database for figures no one can read.
MIN_TOP_INTERVAL = 0.1


def interval(text: str) -> float:
    seconds = duration(text)
    if seconds < MIN_TOP_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_TOP_INTERVAL * 1000:.0f}ms, not {text!r}")
    return seconds


# An age for ``dlq purge --before``: a number with its unit. A bare number is refused there:
# it reads as seconds elsewhere, but here it is as likely an instant (2024, 20240101 in ISO
# 8601's basic form), and a purge cannot be undone.
_AGE = re.compile(r"\s*-?\d+(?:\.\d+)?\s*(?:ms|s|m|h|d)\s*", re.ASCII)
_BARE_NUMBER = re.compile(r"\s*[-+]?\d+(?:\.\d+)?\s*", re.ASCII)


def timestamp_or_age(text: str) -> datetime | float:
    """An instant with its UTC offset, or an age with its unit meaning "that long ago" (7d,
    12h); an age beyond 3650d or below zero is refused as such, and so is a number without a
    unit."""
    if _AGE.fullmatch(text):
        return duration(text)
    if _BARE_NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r} has no unit: give an age such as 30d or 12h, or an instant "
            "such as 2024-01-01T00:00:00Z")
    return timestamp(text)
