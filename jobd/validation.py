"""The rules every job must meet, whichever way it is enqueued. Pure: no I/O.

The same rules are enforced three times, by the Python API (here, before anything is sent),
by the SQL function ``jobd.enqueue`` (``check_job`` in ``jobd/sql/schema.sql``) and, through
those two, by the CLI, so a job that one entry point accepts is never refused, or worse
accepted and then undeliverable, through another:

- handler and lane names: 1-128 of letters, digits and ``_ . : -``, starting with a letter or
  digit; the handlers :data:`OUTBOX_HANDLER` and ``jobd.outbox:<sender>`` are jobd's own
  (the outbox's deliveries, which only ``outbox_add`` may create);
- text anywhere (keys, payload strings) must be valid Unicode: a lone surrogate has no UTF-8;
- idempotency keys: non-empty, at most :data:`MAX_KEY_BYTES` bytes of UTF-8, no NUL, not in
  jobd's reserved ``jobd:`` namespace (they are indexed, and a btree entry has a size limit);
- ``run_at`` from :data:`EARLIEST_RUN_AT` to before :data:`LATEST_RUN_AT`, so every reader
  (Python's datetime ends at year 9999) can load it;
- the payload: any JSON value (object, array, string, number, boolean or null: the handler
  gets exactly that value), nested at most :data:`MAX_PAYLOAD_DEPTH` levels deep, integers
  below 10^4300 in magnitude (Python's decoder refuses longer digit strings), no ``\\u0000``
  (PostgreSQL's jsonb cannot hold it), no NaN or Infinity (not JSON), and at most the
  database's ``max_payload_bytes`` as JSON text (checked by the database, which holds the
  limit).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeGuard

# Names that Python and SQL share. Python spells each of them here and nowhere else (this
# module imports nothing of jobd's, so the config, the queue and the outbox all can import
# it); SQL spells them in its functions (check_job, fire_schedule, outbox_add and
# outbox_mark_dead in jobd/sql/schema.sql), and tests/test_schema_file.py checks that the
# two agree.

# Handler, lane, schedule, node and sender names: NAME_RULE, which is NAME_CHARS at most
# MAX_NAME_BYTES long (the form SQL checks: a bounded repetition costs its regex engine).
NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
NAME_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
MAX_NAME_BYTES = 128
# Keys of jobd's own making (schedule occurrences, outbox deliveries, keys derived from job
# ids) start with this; callers' keys may not, so the two can never collide.
RESERVED_KEY_PREFIX = "jobd:"
# The handler of outbox delivery jobs: OUTBOX_HANDLER + ":" + the sender's name (migration
# 0043: a node runs the deliveries of the senders it has), or OUTBOX_HANDLER alone from
# daemons of before it. A config may not name a handler of its own either way.
OUTBOX_HANDLER = "jobd.outbox"
_OUTBOX_PREFIX = OUTBOX_HANDLER + ":"
# A sender's name leaves room for the prefix within a handler name's MAX_NAME_BYTES.
MAX_SENDER_BYTES = MAX_NAME_BYTES - len(_OUTBOX_PREFIX)
MAX_KEY_BYTES = 512
# A fairness key is part of an index entry (jobs_fair_idx): bounded well below its limit.
MAX_FAIRNESS_KEY_BYTES = 256
MAX_PAYLOAD_DEPTH = 256
# The database's payload limit until `jobd migrate -c` sets another (migration 0006).
DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576
MAX_DELAY_SECONDS = 10**9
EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_RUN_AT = datetime(9999, 1, 1, tzinfo=UTC)

# Python's json decodes integers of at most this many digits (sys.get_int_max_str_digits).
MAX_INTEGER_DIGITS = 4300
# numeric's last decimal place: jsonb refuses 1e-16384 ("value overflows numeric format").
MIN_NUMERIC_EXPONENT = -16383

# A JSON \u0000 escape that is not itself an escaped backslash followed by "u0000".
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def is_name(value: object) -> TypeGuard[str]:
    """Whether ``value`` may name a lane, handler, schedule, node or sender."""
    return isinstance(value, str) and NAME_RULE.fullmatch(value) is not None


def name(kind: str, value: object) -> str:
    """A lane, handler or schedule name, or ValueError."""
    if not is_name(value):
        raise ValueError(
            f"invalid {kind} name {value!r}: use 1-128 letters, digits and _ . : - "
            "(starting with a letter or digit)"
        )
    return value


def is_outbox_handler(value: str) -> bool:
    """Whether ``value`` names the outbox's delivery jobs (of any sender)."""
    return value == OUTBOX_HANDLER or value.startswith(_OUTBOX_PREFIX)


def outbox_handler(sender: str) -> str:
    """The handler of the delivery jobs of ``sender``."""
    return _OUTBOX_PREFIX + sender


def sender(value: object) -> str:
    """An outbox sender's name: a name short enough for its deliveries' handler name."""
    if not isinstance(value, str) or not is_name(value) or len(value.encode()) > MAX_SENDER_BYTES:
        raise ValueError(
            f"invalid outbox sender name {value!r}: use 1-{MAX_SENDER_BYTES} letters, digits and "
            f"_ . : - (starting with a letter or digit; its deliveries' handler is "
            f"{_OUTBOX_PREFIX}<sender>)")
    return value


def handler(value: object) -> str:
    """The handler of a job to enqueue: a name, and not the outbox's own."""
    if isinstance(value, str) and is_outbox_handler(value):
        raise ValueError(f"handler {value!r} is reserved for jobd's outbox deliveries "
                         "(a transactional handler's outbox_add creates them)")
    return name("handler", value)


def utf8_size(kind: str, text: str) -> int:
    """The UTF-8 size of ``text``, or ValueError naming ``kind`` if it holds a lone surrogate
    (text decoded from bytes that were not UTF-8, or a "\\ud800" escape), which no database
    text can hold."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{kind} is not valid Unicode: it holds {exc.object[exc.start]!r}, "
                         "which has no UTF-8 form") from None


def _key(kind: str, value: object, max_bytes: int) -> str:
    """A non-empty string of at most ``max_bytes`` bytes of UTF-8 without NUL, or
    ValueError naming ``kind``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    if "\x00" in value:
        raise ValueError(f"{kind} must not contain NUL characters")
    size = utf8_size(kind, value)
    if size > max_bytes:
        raise ValueError(f"{kind} is {size} bytes; at most {max_bytes} are allowed")
    return value


def idempotency_key(value: object) -> str:
    key = _key("idempotency_key", value, MAX_KEY_BYTES)
    if key.startswith(RESERVED_KEY_PREFIX):
        raise ValueError(f"idempotency keys starting with {RESERVED_KEY_PREFIX!r} are "
                         "reserved for jobd's own jobs")
    return key


def fairness_key(value: object) -> str:
    """A job's fairness key (its share of a fair lane's claims), or ValueError. The rule of
    check_job in migrations/0013_fairness.sql."""
    return _key("fairness_key", value, MAX_FAIRNESS_KEY_BYTES)


def run_at(value: object) -> datetime:
    if not isinstance(value, datetime):
        raise ValueError(f"run_at must be a timezone-aware datetime, not {value!r}")
    if value.utcoffset() is None:
        raise ValueError("run_at must be timezone-aware (a naive datetime is ambiguous)")
    if not EARLIEST_RUN_AT <= value < LATEST_RUN_AT:
        raise ValueError(f"run_at {value.isoformat()} is out of range: it must be from "
                         f"{EARLIEST_RUN_AT:%Y-%m-%d} to before {LATEST_RUN_AT:%Y-%m-%d} (UTC)")
    return value


def delay(value: object) -> float:
    """A delay in seconds: a number from 0 to below 10**9 (about 31 years)."""
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not 0 <= value < MAX_DELAY_SECONDS):
        raise ValueError(f"delay must be a non-negative number of seconds below 10**9, "
                         f"not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class JsonText:
    """A payload given as JSON text, its numbers stored as written: every digit kept, as
    ``jobd.enqueue(handler, '<text>'::jsonb)`` keeps them in SQL. A payload decoded to Python
    values first holds floats: ``0.1000000000000000000001`` would be stored as ``0.1`` and
    ``19.90`` as ``19.9``. ``jobd enqueue --payload`` sends its text so. The rules are a
    payload's (:func:`encode_payload`); a handler still decodes the numbers with Python's
    json."""

    text: str


def encode_payload(payload: Any) -> str:
    """The payload as JSON text, or ValueError saying why it cannot be a payload."""
    if isinstance(payload, JsonText):
        return _encode_json_text(payload.text)
    _check_shape(payload)
    try:
        text = json.dumps(payload, allow_nan=False, ensure_ascii=False)
    except ValueError as exc:  # NaN/Infinity, or an integer too long for a string
        raise ValueError(f"payload cannot be stored as JSON: {exc}") from None
    except (TypeError, RecursionError) as exc:
        raise ValueError(f"payload cannot be stored as JSON: {exc}") from None
    if _NUL_ESCAPE.search(text):
        raise ValueError("payload strings must not contain NUL characters (\\u0000)")
    if not text.isascii():  # ASCII (the common payload) holds no lone surrogate
        utf8_size("payload", text)
    if "e+" in text or "e-" in text or "-0.0" in text:
        return _spell_out_exponents(text)
    return text


def _encode_json_text(text: str) -> str:
    """``text`` checked as a payload and written as :func:`encode_payload` writes one, its
    numbers with a fraction or an exponent as jsonb prints them. They are decoded as marker
    strings (a nonce, which no string of the payload can hold by chance), then put back.

    The rules apply as jsonb applies them. What its parser refuses (NUL, a lone surrogate, a
    number numeric cannot hold) is refused anywhere in the text, also in a member that a
    later one of the same name replaces; the rules on what is stored (nesting, digits, a
    float's range) apply to the value kept, as ``check_job`` sees only that."""
    if not text.isascii():  # a lone surrogate anywhere, even in a member not kept
        utf8_size("payload", text)
    marker = f"\ue000{secrets.token_hex(8)}:"
    numbers: list[str] = []
    # Numbers a handler could not read, by their place in numbers: refused if they are kept.
    unreadable: dict[int, str] = {}

    def placed(spelled: str, problem: str | None = None) -> str:
        numbers.append(spelled)
        if problem is not None:
            unreadable[len(numbers) - 1] = problem
        return f"{marker}{len(numbers) - 1}"

    def number(token: str) -> str:
        try:
            return placed(_exact_number(token))
        except _Unreadable as exc:
            return placed(token, str(exc))

    def integer(token: str) -> int | str:
        if len(token.removeprefix("-")) > MAX_INTEGER_DIGITS:
            return placed(token, _TOO_MANY_DIGITS)
        return int(token)

    try:
        value = json.loads(text, parse_float=number, parse_int=integer,
                           parse_constant=_not_json, object_pairs_hook=_members)
    except json.JSONDecodeError as exc:
        raise ValueError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("payload is nested too deeply to be decoded") from None
    encoded = encode_payload(value)
    if not numbers:
        return encoded

    def put_back(match: re.Match[str]) -> str:
        index = int(match[1])
        if index in unreadable:
            raise ValueError(unreadable[index])
        return numbers[index]

    return re.sub(f'"{re.escape(marker)}([0-9]+)"', put_back, encoded)


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as json builds one (a repeated name keeps its last value); the values a
    repeated name drops are checked for what jsonb's parser refuses, as it parses them."""
    value = dict(pairs)
    if len(value) < len(pairs):
        _check_parsable([member for _, member in pairs])
    return value


def _check_parsable(values: list[Any]) -> None:
    """ValueError if a string in ``values`` holds NUL (jsonb refuses ``\\u0000``) or a lone
    surrogate (a ``\\ud800`` escape). Iterative: a dropped member may be nested deeply."""
    stack = list(values)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise ValueError("payload strings must not contain NUL characters (\\u0000)")
            if not item.isascii():
                utf8_size("payload", item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


class _Unreadable(ValueError):
    """A number jsonb holds but a handler could not read as written (Python's json)."""


_TOO_MANY_DIGITS = (f"an integer has more than {MAX_INTEGER_DIGITS} digits, which a handler "
                    "could not decode")


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (PostgreSQL refuses it)")


def _exact_number(token: str) -> str:
    """A JSON number with a fraction or an exponent as jsonb prints it (numeric, no
    exponent); ValueError for one jsonb cannot hold, _Unreadable for one a handler could not
    decode. A zero is 0 whatever its exponent (0e5000 is stored as 0)."""
    exact = Decimal(token)
    exponent = exact.as_tuple().exponent
    # json hands NaN and Infinity to parse_constant, never here: the number is finite.
    assert isinstance(exponent, int)
    if exponent < MIN_NUMERIC_EXPONENT:  # digits beyond numeric's scale
        raise ValueError(f"{token[:40]} is too small for PostgreSQL's numeric")
    if not exact.is_zero() and exact.adjusted() >= MAX_INTEGER_DIGITS:
        raise _Unreadable(_TOO_MANY_DIGITS)
    if math.isinf(float(token)) and exact != exact.to_integral_value():
        # Python reads it as infinity (migration 0041).
        raise _Unreadable(f"{token[:40]} is beyond a float's range and not a whole number")
    spelled = f"{exact:f}"
    return spelled.removeprefix("-") if exact.is_zero() else spelled  # numeric has no -0


# A JSON string, a number with an exponent (only floats are written so), or a negative zero
# (repr(-0.0)), which numeric, having no sign for zero, stores as 0.0.
_STRING_OR_EXPONENT = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?e[+-]\d+|-0\.0(?![0-9])')


def _spell_out_exponents(text: str) -> str:
    """The payload as jsonb prints it back, so that its size here is the size the database
    measures against ``max_payload_bytes`` (the bulk path's check): jsonb keeps numbers as
    numeric and prints them without an exponent, 1e-300 as 302 characters. A float with a
    positive exponent (7.061036108043807e+16) is also given a fractional digit: printed as
    the integer its repr spells, it would come back as another type and, past 2**53, another
    value (70610361080438070, not the float's 70610361080438064). A negative zero loses its
    sign, as numeric stores it: measured with it, the bulk path refused a payload at the
    limit that jobd.enqueue took."""
    return _STRING_OR_EXPONENT.sub(lambda m: _spelled_out(m[0]), text)


def _spelled_out(token: str) -> str:
    if token.startswith('"'):
        return token
    if token == "-0.0":
        return "0.0"
    digits = f"{Decimal(token):f}"
    return digits if "." in digits else f"{digits}.0"


def _check_shape(payload: Any) -> None:
    """Refuse values nested deeper than MAX_PAYLOAD_DEPTH (the root is level 0), the rule
    the SQL function checks with the JSON path ``strict $.**{257}``, and object keys that
    are not strings: json.dumps would write 1, True and None as "1", "true" and "null", so
    the handler would get another payload than the one enqueued ({1: "a", "1": "b"} even
    loses a member). Iterative, so a deep payload is refused with a message rather than a
    RecursionError."""
    stack: list[tuple[Any, int]] = [(payload, 0)]
    while stack:
        value, level = stack.pop()
        if level > MAX_PAYLOAD_DEPTH:
            raise ValueError(f"payload is nested more than {MAX_PAYLOAD_DEPTH} levels deep")
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise ValueError(f"payload object keys must be strings, as in JSON, "
                                     f"not {key!r} ({type(key).__name__})")
            stack.extend((child, level + 1) for child in value.values())
        elif isinstance(value, list | tuple):
            stack.extend((child, level + 1) for child in value)
