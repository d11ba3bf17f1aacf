"""Property-based fuzzing (hypothesis) of jobd's inputs: payloads, names, priorities and
delays through the Python API and the SQL function jobd.enqueue, config documents,
durations and command lines.

Each property says what must hold for every input, not for hand-picked ones: the Python API
and SQL accept and refuse the same jobs (a ValueError, SQLSTATE 22023) and store what they
accept exactly; a config is parsed or refused with a one-line ConfigError; a duration is a
finite number of seconds or a ValueError; the CLI exits 0, 1 or 2 without a traceback. The
runs are derandomized with modest example counts, so they are the same on every machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import yaml
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

import jobd
from jobd import cli, config, validation, yamlcheck
from jobd.cron import CronError, CronSchedule
from jobd.errors import ConfigError

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
SLOWER = settings(FUZZ, max_examples=60)

# --- strategies ------------------------------------------------------------------------

# Text with what breaks naive code: NUL, newlines, lone surrogates, wide characters.
awkward_text = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(
        ["\x00", "\n", "\r", "\t", " ", "\ud800", "\udfff", "\u2028", "\\", "'", '"', "%"])),
    max_size=20)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), awkward_text)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(awkward_text, children, max_size=4)),
    max_leaves=12)


@st.composite
def nested(draw: st.DrawFn) -> Any:
    """Lists and objects nested around the 256-level limit."""
    depth = draw(st.integers(min_value=250, max_value=262))
    value: Any = draw(json_scalars)
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


payloads = st.one_of(json_values, nested())
names = st.one_of(
    st.from_regex(validation.NAME_RULE, fullmatch=True),  # valid ones, to the 128 limit
    awkward_text,
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,8}[\n ]", fullmatch=True))
keys = st.one_of(st.none(), awkward_text, st.text(min_size=500, max_size=520),
                 st.just("jobd:reserved"))
priorities = st.integers(min_value=-(2**33), max_value=2**33)
attempt_budgets = st.one_of(st.none(), st.integers(min_value=-3, max_value=2**33))
delays = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                   st.integers(min_value=-10, max_value=10**10))


def same_json(stored: Any, given: Any) -> bool:
    """Whether ``stored`` is ``given`` exactly: the same types (a float stays a float, even
    one jsonb prints without its exponent) and the same values."""
    if isinstance(given, list) and isinstance(stored, list):
        return len(given) == len(stored) and all(map(same_json, stored, given))
    if isinstance(given, dict) and isinstance(stored, dict):
        return given.keys() == stored.keys() and all(
            same_json(stored[k], v) for k, v in given.items())
    return type(stored) is type(given) and stored == given


@contextlib.contextmanager
def rolled_back(conn: psycopg.Connection) -> Iterator[None]:
    with conn.transaction(force_rollback=True):
        yield


# --- the Python API and the SQL function agree ----------------------------------------

SQL_ENQUEUE = """
SELECT jobd.enqueue(%(handler)s, %(payload)s, %(lane)s, now() + make_interval(secs => %(delay)s),
                    %(priority)s, %(idempotency_key)s, %(max_attempts)s)
"""


def through_python(conn: psycopg.Connection, job: dict[str, Any]) -> int | str:
    """The new job's id, or the ValueError's message."""
    try:
        with conn.transaction():
            return jobd.enqueue(conn, job["handler"], job["payload"], lane=job["lane"],
                                delay=job["delay"], priority=job["priority"],
                                idempotency_key=job["idempotency_key"],
                                max_attempts=job["max_attempts"])
    except ValueError as exc:
        return str(exc)


def through_batch(conn: psycopg.Connection, job: dict[str, Any]) -> int | str:
    """The new job's id through enqueue_many (ids reserved, rows copied in), or the
    ValueError's message."""
    if job["delay"] is not None:
        return through_python(conn, job)  # a JobSpec has run_at, not delay
    spec = jobd.JobSpec(job["handler"], job["payload"], job["lane"], None, job["priority"],
                        job["idempotency_key"], job["max_attempts"])
    try:
        with conn.transaction():
            [job_id] = jobd.enqueue_many(conn, [spec])
    except ValueError as exc:
        return str(exc)
    row = conn.execute("SELECT payload FROM jobd.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None and same_json(row[0], job["payload"]), row
    return job_id


def through_sql(conn: psycopg.Connection, job: dict[str, Any]) -> int | str:
    """The new job's id, or the server's message for SQLSTATE 22023 (or another data
    exception of class 22)."""
    try:
        with conn.transaction():
            row = conn.execute(SQL_ENQUEUE, {
                **job, "payload": Jsonb(job["payload"]), "delay": job["delay"] or 0}
                               ).fetchone()
            assert row is not None
            return int(row[0])
    except psycopg.errors.InvalidParameterValue as exc:  # jobd.enqueue's own checks
        return exc.diag.message_primary or str(exc)
    except psycopg.DataError as exc:  # refused by a type before the function: jsonb's \u0000
        return exc.diag.message_primary or str(exc)


def sql_can_carry(job: dict[str, Any]) -> bool:
    """Whether the job's values can be sent to the SQL function at all: psycopg must be able
    to encode them (UTF-8 text, JSON, 32-bit integers, a finite interval)."""
    try:
        text = json.dumps(job["payload"], allow_nan=False, ensure_ascii=False)
        for value in (text, job["handler"], job["lane"], job["idempotency_key"] or ""):
            value.encode("utf-8")
    except (ValueError, TypeError, RecursionError, UnicodeEncodeError):
        return False
    ints = (job["priority"], job["max_attempts"] or 1)
    delay = job["delay"] or 0
    return (all(-(2**31) <= i < 2**31 for i in ints)
            and isinstance(delay, int | float) and math.isfinite(delay)
            and 0 <= delay < 10**9 and "\x00" not in "".join(
                (job["handler"], job["lane"], job["idempotency_key"] or "")))


@example(job={"handler": "h", "payload": {}, "lane": "0\n", "delay": None, "priority": 0,
               "idempotency_key": None, "max_attempts": None})  # `$` matched before "\n"
@example(job={"handler": "h", "payload": [7.061036108043807e16, 1e16], "lane": "default",
              "delay": None, "priority": 0, "idempotency_key": None, "max_attempts": None})
@given(job=st.fixed_dictionaries({
    "handler": names, "payload": payloads, "lane": names, "delay": delays,
    "priority": priorities, "idempotency_key": keys, "max_attempts": attempt_budgets}))
@FUZZ
def test_python_and_sql_accept_and_refuse_the_same_jobs_and_store_them_exactly(
    conn: psycopg.Connection, job: dict[str, Any]
) -> None:
    with rolled_back(conn):
        by_python = through_python(conn, job)
        if isinstance(by_python, int):
            row = conn.execute("SELECT handler, lane, payload, priority, idempotency_key,"
                               " max_attempts FROM jobd.jobs WHERE id = %s",
                               (by_python,)).fetchone()
            assert row is not None and same_json(row[2], job["payload"]), row
            assert row[:2] + row[3:] == (job["handler"], job["lane"], job["priority"],
                                         job["idempotency_key"], job["max_attempts"])
    with rolled_back(conn):
        by_batch = through_batch(conn, job)
    assert isinstance(by_python, int) == isinstance(by_batch, int), (by_python, by_batch)
    if not sql_can_carry(job):
        # Refused before reaching SQL (non-UTF-8 text, NaN, a 64-bit integer...).
        assert isinstance(by_python, str)
        return
    with rolled_back(conn):
        by_sql = through_sql(conn, job)
    assert isinstance(by_python, int) == isinstance(by_sql, int), (by_python, by_sql)


@given(payload=payloads, run_at=st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
    timezones=st.sampled_from([UTC, None])))
@SLOWER
def test_run_at_and_payloads_are_either_stored_as_given_or_refused_with_a_value_error(
    conn: psycopg.Connection, payload: Any, run_at: datetime
) -> None:
    with rolled_back(conn):
        try:
            job_id = jobd.enqueue(conn, "fuzz", payload, run_at=run_at)
        except ValueError:
            return
        row = conn.execute("SELECT payload, run_at FROM jobd.jobs WHERE id = %s",
                           (job_id,)).fetchone()
        assert row is not None and same_json(row[0], payload) and row[1] == run_at, row


# --- configs ---------------------------------------------------------------------------

durations = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**12), st.booleans(),
    awkward_text,
    st.builds(lambda n, unit, space: f"{n}{space}{unit}",
              st.one_of(st.integers(-2, 10**9), st.floats(0, 1e6)),
              st.sampled_from(["", "ms", "s", "m", "h", "d", "w", "S"]),
              st.sampled_from(["", " "])))
# The config's own keys, top-level sections first, so documents get past the first check.
KEYS = ["lanes", "handlers", "supervisor", "schedules", "node", "database", "limits",
        "metrics", "outbox", "workers", "concurrency", "poll_interval", "visibility_timeout",
        "heartbeat", "backoff", "base", "cap", "cron", "timezone", "handler", "id", "lane",
        "url", "schema", "duty_interval", "max_attempts", "prefetch", "rate", "max_running",
        "timeout", "listen", "senders", "name", "restart_backoff", "log_level"]
config_values = st.recursive(
    st.one_of(json_scalars, durations, names),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(names, st.sampled_from(KEYS)), children, max_size=4)),
    max_leaves=16)


@st.composite
def config_documents(draw: st.DrawFn) -> str:
    """A YAML document: a structure of jobd's keys and wild values, sometimes cut short or
    with a byte of noise, as a hand-edited file can be."""
    document = draw(st.dictionaries(st.sampled_from(KEYS[:8]), config_values, max_size=5))
    try:
        text = yaml.safe_dump(document, allow_unicode=True)
    except yaml.YAMLError:
        text = repr(document)
    cut = draw(st.integers(0, len(text)))
    noise = draw(st.sampled_from(["", "\t", ":", "- ", "{", "&a *a", "!!python/object:os.system"]))
    return text[:cut] + noise + text[cut:] if draw(st.booleans()) else text


@example(text="\x1f")  # PyYAML's reader error spans two lines
@example(text="!")  # composes, then fails to construct
@example(text="lanes:\n  a: !!python/object:os.system x\n")
@example(text="handlers:\n  x: null\n")
@example(text="handlers:\n  x: 'mod:func\n'\n")
@example(text="lanes:\n  ? '\n\n    '\n  : null\n")  # the key path echoed a newline
@given(text=st.one_of(config_documents(), awkward_text))
@FUZZ
def test_a_config_document_is_parsed_or_refused_with_a_one_line_config_error(
    text: str
) -> None:
    try:
        parsed = config.parse(text, "fuzz.yaml")
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("fuzz.yaml")
        assert "\n" not in message.strip(), message
        return
    assert isinstance(parsed, config.Config)


@given(value=durations)
@FUZZ
def test_a_duration_is_a_finite_number_of_seconds_or_a_value_error(value: Any) -> None:
    try:
        seconds = yamlcheck.parse_duration(value)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert math.isfinite(seconds) and 0 <= seconds <= yamlcheck.MAX_DURATION_SECONDS
    assert isinstance(value, int | float | str) and not isinstance(value, bool)


@given(n=st.integers(0, 10**6), unit=st.sampled_from(["ms", "s", "m", "h", "d"]))
@FUZZ
def test_a_duration_with_a_unit_is_its_number_of_units(n: int, unit: str) -> None:
    seconds = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit] * n
    assume(seconds <= yamlcheck.MAX_DURATION_SECONDS)
    assert yamlcheck.parse_duration(f"{n}{unit}") == pytest.approx(seconds)
    assert timedelta(seconds=yamlcheck.parse_duration(f"{n} {unit}")) == timedelta(
        seconds=seconds)


# --- command lines ---------------------------------------------------------------------

COMMANDS = [
    ["enqueue"], ["status"], ["jobs", "show"], ["jobs", "list"], ["jobs", "cancel"],
    ["dlq", "list"], ["dlq", "replay"], ["dlq", "quarantine"], ["dlq", "purge"],
    ["lanes", "pause"], ["lanes", "resume"], ["schedules", "list"], ["schedules", "enable"],
    ["schedules", "disable"], ["schedules", "next"], ["top", "--once"], ["--version"], [],
    ["nonsense"],
]
OPTIONS = ["--payload", "--lane", "--priority", "--run-at", "--delay", "--idempotency-key",
           "--max-attempts", "--state", "--limit", "--handler", "--where", "--before",
           "--cron", "--tz", "--from", "--count", "--json", "--full-errors", "--interval",
           "--schema", "-c", "--help", "--"]
values = st.one_of(
    awkward_text, names, st.integers(-(2**40), 2**40).map(str),
    st.sampled_from(["{}", "[1, 2]", '{"a": NaN}', "1e999", "null", "30s", "-1s", "0",
                     "2026-13-01T00:00:00Z", "2026-12-01T00:00:00+25:00", "* * * * *",
                     "61 * * * *", "Europe/Nowhere", "a=b", "payload.x=1", "3650d", "1h",
                     "config/jobd.example.yaml", "/nonexistent.yaml", "9" * 400]))
argvs = st.builds(lambda command, rest: command + rest, st.sampled_from(COMMANDS),
                  st.lists(st.one_of(st.sampled_from(OPTIONS), values), max_size=6))


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse: --help, --version and usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def cli_env(db_url: str) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("JOBD_")}
    for name in saved:
        del os.environ[name]
    os.environ["JOBD_DATABASE_URL"] = db_url
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("JOBD_")]:
            del os.environ[name]
        os.environ.update(saved)


@example(argv=["status", "\r\r\x85"])  # argparse echoed the line breaks
@given(argv=argvs)
@SLOWER
def test_any_command_line_exits_0_1_or_2_without_a_traceback(
    cli_env: None, argv: list[str]
) -> None:
    code, out, err = run_cli(argv)
    event(f"exit code {code}")  # pytest --hypothesis-show-statistics shows the mix
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    if code:
        assert err.strip(), f"exit code {code} without a word: {argv}"
        assert len(err.strip().splitlines()) == 1, (argv, err)


def json_text(value: Any) -> str:
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


ENQUEUE_OPTIONS: dict[str, st.SearchStrategy[str]] = {
    "--payload": st.one_of(json_values.map(json_text), awkward_text,
                           nested().map(json_text)),
    "--lane": names,
    "--priority": st.one_of(priorities.map(str), awkward_text),
    "--delay": durations.map(str),
    "--run-at": st.one_of(
        st.datetimes(timezones=st.sampled_from([UTC, None])).map(datetime.isoformat),
        awkward_text),
    "--idempotency-key": st.one_of(awkward_text, st.text(min_size=500, max_size=520)),
    "--max-attempts": st.one_of(attempt_budgets.map(str), awkward_text),
}


@st.composite
def enqueue_argvs(draw: st.DrawFn) -> list[str]:
    argv = ["enqueue", draw(names)]
    for option in draw(st.lists(st.sampled_from(sorted(ENQUEUE_OPTIONS)), max_size=4,
                                unique=True)):
        argv += [option, draw(ENQUEUE_OPTIONS[option])]
    return argv


@given(argv=enqueue_argvs())
@SLOWER
def test_jobd_enqueue_enqueues_or_refuses_with_exit_code_2_never_anything_else(
    cli_env: None, conn: psycopg.Connection, argv: list[str]
) -> None:
    code, out, err = run_cli(argv)
    event(f"exit code {code}")
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 0:
        job_id = int(out.strip())
        row = conn.execute("SELECT handler, idempotency_key FROM jobd.jobs WHERE id = %s",
                           (job_id,)).fetchone()
        assert row is not None, argv
        if "--idempotency-key" in argv:  # a key used before returns its first job
            assert row[1] == argv[argv.index("--idempotency-key") + 1], (argv, row)
        else:
            assert row[0] == argv[1], (argv, row)
    else:
        assert len(err.strip().splitlines()) == 1, (argv, err)


# --- cron expressions and time zones ---------------------------------------------------

CRON_TOKENS = ["*", "*/15", "*/0", "0", "5", "59", "60", "23", "24", "1-5", "5-1", "1,15",
               "29", "30", "31", "2", "12", "13", "0-59/7", "MON", "sun", "jan", "7", "L",
               "?", "H", "-", ",", "1-", "@daily", "@reboot"]
ZONES = ["UTC", "Europe/Berlin", "America/Sao_Paulo", "Australia/Lord_Howe", "Asia/Kathmandu",
         "Pacific/Apia", "America/Nowhere", "", "../etc/passwd", "EST5EDT"]


# Mostly valid values per field (minute hour day-of-month month day-of-week), so that most
# expressions parse and their occurrences get searched, around DST changes too.
FIELDS = [["*", "*/15", "0", "30", "59", "0-59/7"], ["*", "2", "0", "23", "1-3", "*/5"],
          ["*", "1", "29", "30", "31", "1,15", "L"], ["*", "2", "3,10", "jan", "*/6", "11"],
          ["*", "0", "7", "MON", "1-5", "sun", "6"]]


@given(expression=st.one_of(
           st.tuples(*(st.sampled_from(f) for f in FIELDS)).map(" ".join),
           st.lists(st.sampled_from(CRON_TOKENS), max_size=6).map(" ".join)),
       zone=st.sampled_from(ZONES),
       after=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1),
                          timezones=st.just(UTC)))
@settings(FUZZ, max_examples=400)
def test_a_cron_expression_is_refused_or_gives_its_next_occurrences_in_order(
    expression: str, zone: str, after: datetime
) -> None:
    try:
        schedule = CronSchedule.parse(expression, zone)
    except CronError as exc:
        event("refused")
        assert "\n" not in str(exc)
        return
    event("parsed")
    occurrences = schedule.next_after(after, 3)
    instants = [o.fire_at for o in occurrences]
    assert instants == sorted(set(instants)), occurrences
    assert all(i > after and i.utcoffset() == timedelta(0) for i in instants), occurrences
