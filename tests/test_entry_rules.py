"""Every entry point accepts and refuses the same jobs: the SQL function ``jobd.enqueue``, the
Python API (``jobd.enqueue`` and ``jobd.enqueue_many``) and the CLI (see jobd/validation.py
for the rules). A job one of them accepts is one every worker can load and decode."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from cli_support import assert_one_line_error, cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jobd
from jobd import validation

DEEP = 300  # levels: over the limit of 256
HUGE = 10 ** 4300  # 4301 digits: Python's decoder refuses it
BEYOND_FLOAT = str(2**1024 - 2**970)  # from here on, a number with a fraction reads as inf


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@dataclass(frozen=True)
class Case:
    """One job, as each entry point is given it."""

    handler: str = "h"
    payload: Any = field(default_factory=dict)  # a Python value
    payload_sql: str | None = None  # the jsonb literal, when json.dumps cannot write it
    lane: str = "default"
    run_at: datetime | None = None
    key: str | None = None
    max_attempts: int | None = None
    fairness_key: str | None = None

    def sql_payload(self) -> str:
        return self.payload_sql if self.payload_sql is not None else json.dumps(self.payload)

    def cli_args(self, url: str) -> list[str]:
        args = ["enqueue", self.handler, "--payload", self.sql_payload(), "--lane", self.lane,
                "--database-url", url]
        if self.run_at is not None:
            args += ["--run-at", self.run_at.isoformat()]
        if self.key is not None:
            args += ["--idempotency-key", self.key]
        if self.max_attempts is not None:
            args += ["--max-attempts", str(self.max_attempts)]
        if self.fairness_key is not None:
            args += ["--fairness-key", self.fairness_key]
        return args


REFUSED = {
    "empty handler": Case(handler=""),
    "handler with a space": Case(handler="send email"),
    "129-character handler": Case(handler="h" * 129),
    "empty lane": Case(lane=""),
    "lane with a slash": Case(lane="a/b"),
    "run_at in year 9999": Case(run_at=datetime(9999, 6, 1, tzinfo=UTC)),
    "run_at before 1970": Case(run_at=datetime(1969, 12, 31, tzinfo=UTC)),
    "10 KB idempotency key": Case(key="k" * 10_000),
    "513-byte idempotency key": Case(key="k" * 513),
    "empty idempotency key": Case(key=""),
    # A fair claim lists the keys after '': a job of the key '' was never claimed there.
    "empty fairness key": Case(fairness_key=""),
    "257-byte fairness key": Case(fairness_key="f" * 257),
    "max_attempts 0": Case(max_attempts=0),
    "reserved idempotency key": Case(key="jobd:mine"),
    "payload nested 300 levels": Case(payload=nested(DEEP)),
    "payload with a 4301-digit number": Case(payload=[HUGE], payload_sql="[1" + "0" * 4300 + "]"),
    "payload with a NUL character": Case(payload={"s": "a\x00b"}),
    "handler starting with a dot": Case(handler=".h"),
    # Only outbox_add creates the outbox's deliveries: a producer must not send one.
    "the outbox's own handler": Case(handler=validation.OUTBOX_HANDLER,
                                     payload={"outbox_id": 1}),
    "the outbox's handler of a sender": Case(handler=validation.outbox_handler("mail"),
                                             payload={"outbox_id": 1}),
    "payload with a lone surrogate": Case(payload={"s": "\ud800"},
                                          payload_sql='{"s": "\\ud800"}'),
    # Python's json reads it as infinity: the handler would not get the value enqueued.
    "payload with a fraction beyond a float's range": Case(
        payload=[Decimal(BEYOND_FLOAT + ".5")], payload_sql="[" + BEYOND_FLOAT + ".5]"),
}

ACCEPTED = {
    "128-character names": Case(handler="h" * 128, lane="l" * 128),
    "a JSON null payload": Case(payload=None),
    "an array payload": Case(payload=[1, "two", None]),
    "a string payload": Case(payload="just text"),
    "payload nested 256 levels": Case(payload=nested(256)),
    "a 4300-digit number": Case(payload=[HUGE - 1]),
    "a 512-byte key": Case(key="k" * 512),
    "a 256-byte fairness key": Case(fairness_key="f" * 256),
    "run_at on the last accepted day": Case(run_at=datetime(9998, 12, 31, tzinfo=UTC)),
    "floats with exponents": Case(payload=[1e-300, 1.5e-05, -2.5e-07, 1e22]),
}


def via_sql(conn: psycopg.Connection, case: Case) -> int:
    row = conn.execute(
        "SELECT jobd.enqueue(%s, %s::jsonb, lane => %s, run_at => coalesce(%s, now()),"
        " idempotency_key => %s, max_attempts => %s, fairness_key => %s)",
        (case.handler, case.sql_payload(), case.lane, case.run_at, case.key,
         case.max_attempts, case.fairness_key)).fetchone()
    assert row is not None
    return int(row[0])


def via_python(conn: psycopg.Connection, case: Case) -> int:
    return jobd.enqueue(conn, case.handler, case.payload, lane=case.lane, run_at=case.run_at,
                        idempotency_key=case.key, max_attempts=case.max_attempts,
                        fairness_key=case.fairness_key)


def via_bulk(conn: psycopg.Connection, case: Case) -> int:
    [job_id] = jobd.enqueue_many(conn, [jobd.JobSpec(
        case.handler, case.payload, case.lane, case.run_at, 0, case.key, case.max_attempts,
        fairness_key=case.fairness_key)])
    return job_id


def via_python_text(conn: psycopg.Connection, case: Case) -> int:
    return jobd.enqueue(conn, case.handler, jobd.JsonText(case.sql_payload()), lane=case.lane,
                        run_at=case.run_at, idempotency_key=case.key,
                        max_attempts=case.max_attempts, fairness_key=case.fairness_key)


def via_bulk_text(conn: psycopg.Connection, case: Case) -> int:
    [job_id] = jobd.enqueue_many(conn, [jobd.JobSpec(
        case.handler, jobd.JsonText(case.sql_payload()), case.lane, case.run_at, 0, case.key,
        case.max_attempts, fairness_key=case.fairness_key)])
    return job_id


def with_key(case: Case, tag: str) -> Case:
    """The case with a key of its own for one entry point (same length, last byte differs)."""
    return Case(**{**case.__dict__, "key": case.key[:-1] + tag}) if case.key else case


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_entry_point_refuses(name: str, conn: psycopg.Connection, db_url: str) -> None:
    case = REFUSED[name]
    # A data exception (SQLSTATE class 22): jobd.enqueue's invalid_parameter_value, or for
    # \u0000 PostgreSQL's own jsonb parser, before jobd.enqueue is reached.
    with pytest.raises(psycopg.DataError):
        via_sql(conn, case)
    for enqueue in (via_python, via_bulk, via_python_text, via_bulk_text):
        with pytest.raises(ValueError):
            enqueue(conn, case)
    assert_one_line_error(cli(*case.cli_args(db_url)), 2)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_every_entry_point_accepts(name: str, conn: psycopg.Connection, db_url: str) -> None:
    case = ACCEPTED[name]
    ids = [via_sql(conn, with_key(case, "a")), via_python(conn, with_key(case, "b")),
           via_bulk(conn, with_key(case, "c")), via_python_text(conn, with_key(case, "e")),
           via_bulk_text(conn, with_key(case, "f"))]
    result = cli(*with_key(case, "d").cli_args(db_url))
    assert result.returncode == 0, result.stderr
    ids.append(int(result.stdout))
    assert len(set(ids)) == 6
    # Every entry point stored the same value, and a worker decodes exactly it.
    rows = conn.execute("SELECT payload, payload::text, fairness_key FROM jobs"
                        " WHERE id = ANY(%s)", (ids,)).fetchall()
    assert len(rows) == 6
    for stored, text, fairness_key in rows:
        assert stored == case.payload
        assert jobd.jobs.decode_stored_payload(text) == case.payload
        assert fairness_key == case.fairness_key


def test_numbers_given_as_json_text_keep_every_digit_as_sql_keeps_them(
    conn: psycopg.Connection, db_url: str
) -> None:
    # The CLI decoded its --payload to Python values: 19.90 was stored as 19.9, and
    # 0.1000000000000000000001 as 0.1, where SQL's jobd.enqueue keeps the numeric as written.
    text = ('{"amount": 19.90, "rate": 0.1000000000000000000001, "whole": 1.5e400,'
            ' "small": 1.0e-5, "zero": -0.0, "id": 12345678901234567890, "s": "1.10",'
            ' "list": [1E+2, 2.50]}')
    case = Case(payload_sql=text)
    ids = [via_sql(conn, case), via_python_text(conn, case), via_bulk_text(conn, case)]
    result = cli(*case.cli_args(db_url))
    assert result.returncode == 0, result.stderr
    ids.append(int(result.stdout))
    stored = [row[0] for row in conn.execute(
        "SELECT payload::text FROM jobs WHERE id = ANY(%s) ORDER BY id", (ids,))]
    assert len(stored) == 4 and len(set(stored)) == 1, stored
    assert '"amount": 19.90' in stored[0] and "0.1000000000000000000001" in stored[0]
    assert '"list": [100, 2.50]' in stored[0] and '"zero": 0.0' in stored[0]
    # Digits beyond numeric's last decimal place are refused, as the database refuses them.
    with pytest.raises(psycopg.DataError):
        via_sql(conn, Case(payload_sql="[1e-16384]"))
    for enqueue in (via_python_text, via_bulk_text):
        with pytest.raises(ValueError, match="numeric"):
            enqueue(conn, Case(payload_sql="[1e-16384]"))
    enqueue(conn, Case(payload_sql="[1e-16383]"))


def test_no_priority_is_the_default_at_every_entry_point(conn: psycopg.Connection) -> None:
    # SQL took priority => NULL as 0 where Python raised ValueError for priority=None.
    row = conn.execute("SELECT jobd.enqueue('h', priority => NULL)").fetchone()
    assert row is not None
    ids = [row[0], jobd.enqueue(conn, "h", priority=None),
           *jobd.enqueue_many(conn, [jobd.JobSpec("h", priority=None)])]  # type: ignore[arg-type]
    assert conn.execute("SELECT array_agg(DISTINCT priority), count(*) FROM jobs"
                        " WHERE id = ANY(%s)", (ids,)).fetchone() == ([0], 3)


def test_the_payload_size_limit_is_the_databases_for_every_entry_point(
    conn: psycopg.Connection, db_url: str
) -> None:
    conn.execute("UPDATE settings SET value = '64' WHERE name = 'max_payload_bytes'")
    fits, too_big = {"s": "x" * 55}, {"s": "x" * 56}
    assert len(json.dumps(fits)) == 64
    case = Case(payload=too_big)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="65 bytes"):
        via_sql(conn, case)
    for enqueue in (via_python, via_bulk):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="65 bytes"):
            enqueue(conn, case)
    line = assert_one_line_error(cli(*case.cli_args(db_url)), 2)
    assert "65 bytes" in line
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    for enqueue in (via_sql, via_python, via_bulk):
        enqueue(conn, Case(payload=fits))
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (3,)


def test_a_payload_is_measured_as_the_database_prints_it(
    conn: psycopg.Connection, db_url: str
) -> None:
    """jsonb prints numbers without an exponent: [1e-07, ...] of 70 characters as Python
    writes it is 110 as the database measures it, and every entry point refuses it."""
    conn.execute("UPDATE settings SET value = '100' WHERE name = 'max_payload_bytes'")
    case = Case(payload=[1e-7] * 10)
    assert len(json.dumps(case.payload)) == 70
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="110 bytes"):
        via_sql(conn, case)
    for enqueue in (via_python, via_bulk):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="110 bytes"):
            enqueue(conn, case)
    assert "110 bytes" in assert_one_line_error(cli(*case.cli_args(db_url)), 2)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    fits = [1e-7] * 9  # 99 bytes as the database prints it
    for enqueue in (via_sql, via_python, via_bulk):
        enqueue(conn, Case(payload=fits))
    assert conn.execute("SELECT DISTINCT octet_length(payload::text) FROM jobs").fetchall() == [
        (99,)]


def test_keys_that_are_not_unicode_are_refused_with_a_message(
    conn: psycopg.Connection, db_url: str
) -> None:
    """A lone surrogate: what Python makes of bytes that are not UTF-8 (a shell's $'\\xff'
    argument) or of a "\\ud800" escape. No database text can hold it."""
    for kind, key in (("idempotency_key", "k\udcff"), ("fairness_key", "\ud800")):
        with pytest.raises(ValueError, match=f"{kind} is not valid Unicode"):
            jobd.enqueue(conn, "h", **{kind: key})
        with pytest.raises(ValueError, match=f"{kind} is not valid Unicode"):
            jobd.enqueue_many(conn, [jobd.JobSpec("h", **{kind: key})])
    for option, name in (("--idempotency-key", "idempotency-key"),
                         ("--fairness-key", "fairness-key")):
        result = cli("enqueue", "h", option, "k\udcff", "--database-url", db_url)
        assert assert_one_line_error(result, 2) == f"jobd: {name}: not valid UTF-8 text"
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_python_refuses_arguments_of_the_wrong_type(conn: psycopg.Connection) -> None:
    for arguments, message in (
        ({"priority": True}, "priority must be a 32-bit integer"),
        ({"max_attempts": True}, "max_attempts must be a positive integer"),
        ({"run_at": "2030-01-01T00:00:00Z"}, "run_at must be a timezone-aware datetime"),
        ({"delay": "30"}, "delay must be a non-negative number"),
        ({"delay": True}, "delay must be a non-negative number"),
    ):
        with pytest.raises(ValueError, match=message):
            jobd.enqueue(conn, "h", **arguments)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def _stand_in(module: str, name: str) -> object:
    """An object of a class from ``module``: the connections of libraries jobd does not
    depend on (SQLAlchemy, Django, psycopg2), as far as the check can tell."""
    return type(name, (), {"__module__": module})()


# Each Python entry point that takes the application's connection, called with one.
CONNECTION_CALLS: dict[str, Callable[[Any], object]] = {
    "jobd.enqueue": lambda c: jobd.enqueue(c, "h"),
    "jobd.enqueue_many": lambda c: jobd.enqueue_many(c, [jobd.JobSpec("h")]),
    "jobd.cancel": lambda c: jobd.cancel(c, [1]),
    "jobd.pause": lambda c: jobd.pause(c, "default"),
    "jobd.resume": lambda c: jobd.resume(c, "default"),
}


def test_python_refuses_a_connection_it_cannot_use_and_says_what_to_pass(
        conn: psycopg.Connection, db_url: str) -> None:
    async def async_connection() -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(db_url)

    aconn = asyncio.run(async_connection())
    try:
        for wrong, advice in (
            (aconn, r"not psycopg\.AsyncConnection: jobd's Python API is synchronous.*"
                    r"SELECT jobd\.enqueue\("),
            (conn.cursor(), r"not psycopg\.Cursor: pass the cursor's connection"),
            (_stand_in("sqlalchemy.engine.base", "Connection"),
             r"not sqlalchemy\.engine\.base\.Connection: .*driver_connection"),
            (_stand_in("django.utils.connection", "ConnectionProxy"),
             r"not django\.utils\.connection\.ConnectionProxy: .*django\.db\.connection"),
            (_stand_in("psycopg2.extensions", "connection"),
             r"not psycopg2\.extensions\.connection: psycopg2 is not supported"),
            (None, "not None: connect with psycopg.connect"),
            (db_url, r"not builtins\.str: connect with psycopg\.connect"),
        ):
            for name, call in CONNECTION_CALLS.items():
                with pytest.raises(TypeError, match=re.escape(name) + " takes a psycopg"
                                   r"\.Connection \(psycopg 3\), " + advice):
                    call(wrong)
    finally:
        asyncio.run(aconn.close())
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM lane_pauses").fetchone() == (0,)


def test_the_cli_and_python_take_the_same_delays(conn: psycopg.Connection, db_url: str) -> None:
    # The CLI's --delay took the config's duration cap (3650d) where jobd.enqueue and a
    # run_at of the same day took the job.
    four_thousand_days = 4000 * 86400
    jobd.enqueue(conn, "h", delay=four_thousand_days)
    result = cli("enqueue", "h", "--delay", "4000d", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    # And past the rule (below 10**9 seconds, about 11,574 days), both refuse it, alike.
    with pytest.raises(ValueError, match="below 10\\*\\*9") as refused:
        jobd.enqueue(conn, "h", delay=11575 * 86400)
    line = assert_one_line_error(cli("enqueue", "h", "--delay", "11575d",
                                     "--database-url", db_url), 2)
    assert str(refused.value) in line
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (2,)


@pytest.mark.parametrize("payload", [{1: "a"}, {True: 1}, {None: 2}, {"a": [{2.5: 0}]},
                                     {1: "a", "1": "b"}])
def test_object_keys_that_are_not_strings_are_refused(conn: psycopg.Connection,
                                                      payload: Any) -> None:
    # JSON writes them as strings: the handler would get {"1": "a"} for {1: "a"}, and
    # {1: "a", "1": "b"} would lose a member, where the payload must arrive as enqueued.
    with pytest.raises(ValueError, match="keys must be strings"):
        jobd.enqueue(conn, "h", payload)
    with pytest.raises(ValueError, match="keys must be strings"):
        jobd.enqueue_many(conn, [jobd.JobSpec("h", payload)])
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_a_sql_null_payload_is_refused_and_a_json_null_kept(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="SQL NULL"):
        conn.execute("SELECT jobd.enqueue('h', NULL)")
    job_id = conn.execute("SELECT jobd.enqueue('h', 'null')").fetchone()
    assert conn.execute("SELECT payload IS NULL, jsonb_typeof(payload) FROM jobs WHERE id = %s",
                        job_id).fetchone() == (False, "null")
    # Left out, the payload is {} in every entry point.
    assert [jobd.enqueue(conn, "h")] and conn.execute(
        "SELECT payload FROM jobs ORDER BY id DESC LIMIT 1").fetchone() == ({},)


def test_the_python_rules_are_pure() -> None:
    """validation.py needs no database: the rules, checked directly."""
    assert validation.encode_payload({"é": [1, None]}) == '{"é": [1, null]}'
    for bad in (float("nan"), float("inf"), nested(DEEP), {"k": "\x00"}, HUGE, object()):
        with pytest.raises(ValueError):
            validation.encode_payload(bad)
    # A backslash followed by "u0000" is text, not a NUL.
    assert validation.encode_payload("\\u0000") == '"\\\\u0000"'


def test_a_negative_zero_is_measured_as_the_database_stores_it(conn: psycopg.Connection) -> None:
    """numeric has no negative zero: -0.0 is stored as 0.0. The bulk path measured Python's
    "-0.0", so at the limit it refused a payload that jobd.enqueue took."""
    conn.execute("UPDATE settings SET value = '64' WHERE name = 'max_payload_bytes'")
    payload = {"s": "", "z": [-0.0] * 9}
    assert len(json.dumps(payload)) == 70  # 61 bytes as stored
    ids = [jobd.enqueue(conn, "h", payload), *jobd.enqueue_many(conn, [jobd.JobSpec("h", payload)])]
    assert conn.execute("SELECT DISTINCT octet_length(payload::text) FROM jobs"
                        " WHERE id = ANY(%s)", (ids,)).fetchall() == [(61,)]


LONG = "1" + "0" * 4300  # 4301 digits
BEYOND_FLOAT_FRACTION = BEYOND_FLOAT + ".5"

# jsonb parses every member, then keeps the last of a repeated name: what its parser refuses
# is refused wherever it stands, and check_job's rules apply to the value kept.
REPEATED_NAMES_REFUSED = {
    "NUL in a replaced member": '{"a": "\\u0000", "a": 1}',
    "NUL in a key inside a replaced member": '{"a": [{"\\u0000": 1}], "a": 1}',
    "a lone surrogate in a replaced member": '{"a": "\\ud800", "a": 1}',
    "a number numeric cannot hold in a replaced member": '{"a": 1e-16384, "a": 1}',
    "a long integer kept": '{"a": 1, "a": ' + LONG + "}",
}
REPEATED_NAMES_ACCEPTED = {
    "a long integer replaced": '{"a": ' + LONG + ', "a": 1}',
    "a long exponent replaced": '{"a": 1e4300, "a": 1}',
    "a fraction beyond a float's range replaced": '{"a": ' + BEYOND_FLOAT_FRACTION
                                                 + ', "a": 1}',
    # A zero is 0 whatever its exponent.
    "a zero with a long exponent": '{"a": 0e5000, "b": -0E99999}',
}


@pytest.mark.parametrize("name", sorted(REPEATED_NAMES_REFUSED))
def test_json_text_is_refused_as_jsonb_refuses_it(
    name: str, conn: psycopg.Connection, db_url: str
) -> None:
    """Python's json keeps the last member of a repeated name and never looked at the
    others: the Python API and the CLI took a NUL or a lone surrogate there, which SQL's
    jobd.enqueue refuses with the text."""
    case = Case(payload_sql=REPEATED_NAMES_REFUSED[name])
    with pytest.raises(psycopg.DataError):
        via_sql(conn, case)
    for enqueue in (via_python_text, via_bulk_text):
        with pytest.raises(ValueError):
            enqueue(conn, case)
    assert_one_line_error(cli(*case.cli_args(db_url)), 2)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


@pytest.mark.parametrize("name", sorted(REPEATED_NAMES_ACCEPTED))
def test_json_text_is_accepted_as_jsonb_accepts_it(
    name: str, conn: psycopg.Connection, db_url: str
) -> None:
    """The rules on what is stored apply to the value kept: a number a handler could not
    read, in a member that a later one replaces, is not stored (jobd.enqueue takes it), and
    0e5000 is 0. The Python API and the CLI refused both."""
    case = Case(payload_sql=REPEATED_NAMES_ACCEPTED[name])
    ids = [via_sql(conn, case), via_python_text(conn, case), via_bulk_text(conn, case)]
    result = cli(*case.cli_args(db_url))
    assert result.returncode == 0, result.stderr
    ids.append(int(result.stdout))
    stored = conn.execute("SELECT DISTINCT payload::text FROM jobs WHERE id = ANY(%s)",
                          (ids,)).fetchall()
    assert len(stored) == 1, stored


# JSON texts with what tells parsers apart: repeated names, escapes, exponents, zeros.
_NUMBERS = st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][-+]?[0-9]{1,5})?",
                         fullmatch=True)
_STRINGS = st.sampled_from(['"a"', '"\\u0000"', '"\\\\u0000"', '"\\ud800"', '"\\udc00"',
                            '"\\ud83d\\ude00"', '"\\u00e9"', '"é"', '"\\/"', '"\\u001f"', '""'])
_SCALARS = _NUMBERS | _STRINGS | st.sampled_from(["true", "false", "null", "NaN", "-0"])
_TEXTS = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4).map(lambda items: "[" + ", ".join(items) + "]")
        | st.lists(st.tuples(_STRINGS, children), max_size=4).map(
            lambda members: "{" + ",".join(f"{k}: {v}" for k, v in members) + "}")),
    max_leaves=12)
_FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@given(text=_TEXTS)
@_FUZZ
def test_json_text_and_sql_agree_on_every_text(conn: psycopg.Connection, text: str) -> None:
    """A JSON text is refused by jobd.JsonText exactly when SQL's jobd.enqueue refuses it,
    and accepted as the value jsonb stores, of its size (what the bulk path measures)."""
    try:
        encoded: str | None = validation.encode_payload(validation.JsonText(text))
    except ValueError:
        encoded = None
    try:
        with conn.transaction():
            row = conn.execute("SELECT jobd.enqueue('h', %s::jsonb)", (text,)).fetchone()
            assert row is not None
            stored = conn.execute("SELECT payload::text FROM jobs WHERE id = %s",
                                  row).fetchone()
    except psycopg.DataError:
        stored = None
    assert (encoded is None) == (stored is None), (text, encoded, stored)
    if encoded is not None and stored is not None:
        # The same value (jsonb orders an object's keys its own way) and the same size.
        assert conn.execute("SELECT %s::jsonb::text", (encoded,)).fetchone() == stored, text
        assert len(encoded.encode("utf-8")) == len(stored[0].encode("utf-8")), text


@given(payload=st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=16))
@_FUZZ
def test_a_python_payload_is_measured_as_the_database_stores_it(
    conn: psycopg.Connection, payload: Any
) -> None:
    """The bulk path checks the size of the text it sends against max_payload_bytes: that
    size must be what jsonb stores, as jobd.enqueue measures it."""
    try:
        encoded = validation.encode_payload(payload)
    except ValueError:  # a NUL or a lone surrogate: refused, as the SQL side refuses them
        return
    row = conn.execute("SELECT octet_length(%s::jsonb::text)", (encoded,)).fetchone()
    assert row == (len(encoded.encode("utf-8")),), encoded
