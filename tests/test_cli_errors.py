"""The CLI never prints a traceback for a user's mistake: input errors exit 2 with one line on
stderr, runtime failures exit 1. Run against a real database."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from cli_support import TIMEOUT, assert_one_line_error, clean_env, cli

import jobd
from jobd import cli as jobd_cli

DEEP = "[" * 5000 + "]" * 5000
LONG_INTEGER = "1" * 5000
TOO_BIG_ID = "99999999999999999999"  # > 2**63 - 1


def count_jobs(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM all_jobs").fetchone()
    assert row is not None
    return int(row[0])


# --- payloads json.loads cannot decode, or PostgreSQL cannot store -------------------------


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (DEEP, "nested too deeply"),
        ('{"a": ' + DEEP + "}", "nested too deeply"),
        (LONG_INTEGER, "more than 4300 digits"),
        ('{"n": -' + LONG_INTEGER + "}", "more than 4300 digits"),
        ('{"x": NaN}', "NaN is not JSON"),
        ("[Infinity]", "Infinity is not JSON"),
        ("-Infinity", "Infinity is not JSON"),
        ('{"x": 1e4300}', "more than 4300 digits"),
        ('{"x": -2.5e4300}', "more than 4300 digits"),
        ('{"x": "a\\u0000b"}', "NUL"),
        ('{"a\\u0000": 1}', "NUL"),
        ('["ok", ["\\u0000"]]', "NUL"),
    ],
)
def test_undecodable_or_unstorable_payloads_exit_2(
    db_url: str, conn: psycopg.Connection, payload: str, fragment: str
) -> None:
    result = cli("enqueue", "h", f"--payload={payload}", "--database-url", db_url)
    line = assert_one_line_error(result, 2)
    assert fragment in line and "--payload" in line
    assert count_jobs(conn) == 0


def test_a_payload_too_long_for_the_command_line_comes_from_a_file_or_a_pipe(
    db_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """Linux refuses a single argument over 128 KiB (E2BIG): a large payload is read from
    @FILE or from standard input (-) instead."""
    big = {"rows": ["r" * 100 for _ in range(2000)], "name": "caf\u00e9"}
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(big), "utf-8")
    assert path.stat().st_size > 128 * 1024
    from_file = cli("enqueue", "h", "--payload", f"@{path}", "--database-url", db_url)
    assert from_file.returncode == 0, from_file.stderr
    from_pipe = subprocess.run(
        [sys.executable, "-m", "jobd", "enqueue", "h", "--payload", "-", "--database-url", db_url],
        input=json.dumps(big).encode(), capture_output=True, env=clean_env(), timeout=TIMEOUT)
    assert from_pipe.returncode == 0, from_pipe.stderr
    rows = conn.execute("SELECT payload FROM jobs ORDER BY id").fetchall()
    assert [row[0] for row in rows] == [big, big]


@pytest.mark.parametrize(
    ("content", "argument", "fragment"),
    [
        (None, "@{missing}", "No such file"),
        (None, "@", "needs a file name"),
        (b"\xff{}", "@{path}", "not UTF-8"),
        (b"{oops", "@{path}", "not valid JSON"),
        (b'{"x": NaN}', "@{path}", "NaN is not JSON"),
    ],
)
def test_a_payload_file_that_cannot_be_used_is_a_usage_error(
    db_url: str, conn: psycopg.Connection, tmp_path: Path, content: bytes | None,
    argument: str, fragment: str,
) -> None:
    path = tmp_path / "payload.json"
    if content is not None:
        path.write_bytes(content)
    value = argument.format(path=path, missing=tmp_path / "missing.json")
    line = assert_one_line_error(cli("enqueue", "h", "--payload", value, "--database-url", db_url))
    assert fragment in line and "--payload" in line
    assert count_jobs(conn) == 0


def test_a_number_beyond_a_floats_range_is_stored_as_sql_stores_it(
        db_url: str, conn: psycopg.Connection) -> None:
    """1e400 is no float, but jsonb holds it (and a handler gets the whole number it prints
    as): the command line takes what `SELECT jobd.enqueue('h', '{"x": 1e400}')` takes."""
    result = cli("enqueue", "h", "--payload", '{"x": 1e400, "y": 9.9e4299}',
                 "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    conn.execute("""SELECT jobd.enqueue('h', '{"x": 1e400, "y": 9.9e4299}')""")
    rows = conn.execute("SELECT payload::text FROM jobs ORDER BY id").fetchall()
    assert rows[0] == rows[1]
    assert jobd.jobs.decode_stored_payload(rows[0][0]) == {"x": 10**400, "y": 99 * 10**4298}


@pytest.mark.parametrize("value", ["1_000", "\u0663", "0x10", "1.0", ""])
def test_integers_are_what_sql_reads_as_integers(db_url: str, conn: psycopg.Connection,
                                                 value: str) -> None:
    for option in ("--priority", "--max-attempts"):
        result = cli("enqueue", "h", option, value, "--database-url", db_url)
        assert "not an integer" in assert_one_line_error(result, 2)
    assert count_jobs(conn) == 0
    result = cli("enqueue", "h", "--priority", " -3 ", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    assert conn.execute("SELECT priority FROM jobs").fetchone() == (-3,)


@pytest.mark.parametrize(("args", "name"), [
    (["schedules", "disable", "r\udcff"], "id"),
    (["dlq", "quarantine", "--handler", "h", "--where", "k=\udcff"], "where"),
    (["enqueue", "h", "--idempotency-key", "k\udcff"], "idempotency"),
])
def test_arguments_that_are_not_utf8_exit_2(db_url: str, args: list[str], name: str) -> None:
    """Bytes that are not UTF-8 (a shell's $'\\xff'), which no database text can hold: one
    line naming the argument, not a traceback from the driver."""
    line = assert_one_line_error(cli(*args, "--database-url", db_url), 2)
    assert name in line and "UTF-8" in line
    line = assert_one_line_error(cli("status", "--database-url", db_url + "\udcff"), 2)
    assert "database-url: not valid UTF-8 text" in line


def test_an_escaped_backslash_before_u0000_is_not_a_nul(db_url: str,
                                                         conn: psycopg.Connection) -> None:
    # The JSON text \\u0000 is a backslash followed by "u0000", which jsonb stores fine.
    result = cli("enqueue", "h", "--payload", '{"path": "C:\\\\u0000"}', "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    row = conn.execute("SELECT payload FROM jobs").fetchone()
    assert row == ({"path": "C:\\u0000"},)


def test_a_payload_from_a_closed_standard_input_is_a_usage_error(
    db_url: str, conn: psycopg.Connection
) -> None:
    result = subprocess.run(
        ["sh", "-c", 'exec "$0" -m jobd enqueue h --payload - --database-url "$1" <&-',
         sys.executable, db_url], capture_output=True, text=True, env=clean_env(),
        timeout=TIMEOUT)
    assert "standard input, which is closed" in assert_one_line_error(result, 2)
    assert count_jobs(conn) == 0


class InterruptedStdin:
    """Standard input whose read Ctrl-C interrupts (SIGINT raises KeyboardInterrupt)."""

    @property
    def buffer(self) -> InterruptedStdin:
        return self

    def read(self, _size: int = -1) -> bytes:
        raise KeyboardInterrupt


def test_ctrl_c_while_the_payload_is_read_ends_quietly(
    db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", InterruptedStdin())
    try:
        code = jobd_cli.main(["enqueue", "h", "--payload", "-", "--database-url", db_url])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left main() (a traceback at the terminal)")
    assert code == 130
    assert capsys.readouterr() == ("", "")
    assert count_jobs(conn) == 0


def test_output_in_an_encoding_without_the_texts_characters(
    db_url: str, conn: psycopg.Connection
) -> None:
    """PYTHONIOENCODING=ascii (or a Latin-1 terminal): what the encoding lacks is written as
    its escape, as on stderr, not a traceback halfway through the output."""
    job_id = jobd.enqueue(conn, "h", {"k": "\U0001f600"})
    ascii_only = clean_env(PYTHONIOENCODING="ascii")
    shown = cli("jobs", "show", str(job_id), "--database-url", db_url, env=ascii_only)
    assert shown.returncode == 0, shown.stderr
    assert '{"k": "\\U0001f600"}' in shown.stdout
    moved = cli("dlq", "quarantine", "--handler", "h", "--where", "k=\U0001f600",
                "--database-url", db_url, env=ascii_only)
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.startswith("quarantined 1 job(s) of handler h with payload "
                                   "k='\\U0001f600'")


# --- NUL characters in any argument --------------------------------------------------------
# A process's argv cannot hold NUL, so these go through main() in this process.


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["enqueue", "h", "--idempotency-key", "order\x007"], "idempotency-key"),
        (["enqueue", "h\x00", "--lane", "default"], "handler"),
        (["enqueue", "h", "--lane", "mail\x00"], "lane"),
        (["jobs", "list", "--lane", "mail\x00"], "lane"),
        (["dlq", "list", "--lane", "\x00"], "lane"),
    ],
)
def test_nul_in_an_argument_exits_2(
    db_url: str, conn: psycopg.Connection, capsys: pytest.CaptureFixture[str],
    args: list[str], name: str
) -> None:
    assert jobd_cli.main([*args, "--database-url", db_url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"jobd: {name}: NUL characters are not allowed\n"
    assert count_jobs(conn) == 0


# --- ids and limits beyond bigint ----------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["jobs", "show", TOO_BIG_ID], ["dlq", "replay", "1", TOO_BIG_ID],
     ["jobs", "list", "--limit", TOO_BIG_ID], ["dlq", "list", "--limit", TOO_BIG_ID]],
)
def test_numbers_beyond_bigint_are_refused_at_parsing(db_url: str, args: list[str]) -> None:
    line = assert_one_line_error(cli(*args, "--database-url", db_url), 2)
    assert "too large" in line and str(2**63 - 1) in line


@pytest.mark.parametrize(
    "args",
    [["jobs", "list", "--lane", "x y"], ["dlq", "list", "--lane", ""],
     ["dlq", "replay", "--handler", "fail", "--lane", "bad lane"]],
)
def test_a_lane_filter_no_lane_can_match_is_refused(db_url: str, args: list[str]) -> None:
    # The name rule of every entry point: an empty listing would hide the typo.
    line = assert_one_line_error(cli(*args, "--database-url", db_url), 2)
    assert "argument --lane: invalid lane name" in line


def test_a_lane_filter_the_config_lacks_still_lists(db_url: str,
                                                     conn: psycopg.Connection) -> None:
    # The jobs of a lane since removed from the config stay in the history.
    jobd.enqueue(conn, "echo", {}, lane="retired")
    result = cli("jobs", "list", "--lane", "retired", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    assert "retired" in result.stdout


def test_the_largest_bigint_is_a_valid_id(db_url: str) -> None:
    line = assert_one_line_error(cli("jobs", "show", str(2**63 - 1), "--database-url", db_url))
    assert f"no job {2**63 - 1}" in line


# --- a missing job is the same input error everywhere --------------------------------------


def test_show_and_replay_agree_on_a_missing_job(db_url: str) -> None:
    show = assert_one_line_error(cli("jobs", "show", "999", "--database-url", db_url), 2)
    replay = assert_one_line_error(cli("dlq", "replay", "999", "--database-url", db_url), 2)
    assert "999" in show and "999" in replay


# --- what the database refuses -------------------------------------------------------------


def test_an_oversize_idempotency_key_exits_2(db_url: str, conn: psycopg.Connection) -> None:
    result = cli("enqueue", "h", "--idempotency-key", "k" * 10_000, "--database-url", db_url)
    assert_one_line_error(result, 2)
    assert count_jobs(conn) == 0


def _refuse_inserts(conn: psycopg.Connection, sqlstate: str, message: str) -> None:
    """A trigger that makes the server refuse every new job with ``sqlstate``: the way a
    check inside the database (jobd.enqueue's own, or the user's) answers."""
    conn.execute(f"""
        CREATE FUNCTION public.refuse_job() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION '{message}' USING ERRCODE = '{sqlstate}',
                  DETAIL = 'a second line that must not be printed';
        END $$""")
    conn.execute("CREATE TRIGGER refuse_job BEFORE INSERT ON jobs "
                 "FOR EACH ROW EXECUTE FUNCTION public.refuse_job()")


@pytest.mark.parametrize(
    ("sqlstate", "code"),
    [
        ("22023", 2),  # invalid_parameter_value: what jobd.enqueue raises for bad input
        ("22003", 2),  # numeric_value_out_of_range: any data exception
        ("23514", 2),  # check_violation
        ("P0001", 1),  # raise_exception: not about the input, a runtime failure
        ("53100", 1),  # disk_full
    ],
)
def test_database_refusals_map_to_exit_codes(
    db_url: str, conn: psycopg.Connection, sqlstate: str, code: int
) -> None:
    _refuse_inserts(conn, sqlstate, "lane mail is over its quota")
    line = assert_one_line_error(cli("enqueue", "h", "--database-url", db_url), code)
    if code == 2:
        assert line == "jobd: lane mail is over its quota"
    else:
        assert line == "jobd: database error: lane mail is over its quota"
    assert count_jobs(conn) == 0


# --- database URLs that do not parse -------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("postgresql://app:s3cretPW@[::1/appdb", 'matching "]" in IPv6 host address'),
        ("postgresql://app:s3cret%PW@db.internal/appdb", "its password cannot be read"),
        ("postgresql://app:s3c@retPW@db/appdb", "more than one @ before its host"),
        ("postgresql://app@db/appdb?password=s3cret%PW", "its password cannot be read"),
        ("postgresql://app:s3cretPW@db/appdb?x", 'URI query parameter: "x"'),
        ("host=db password='s3cretPW", "its password cannot be read"),
    ],
)
def test_a_url_that_does_not_parse_is_named_without_its_password(url: str,
                                                                 fragment: str) -> None:
    line = assert_one_line_error(cli("status", "--database-url", url), 2)
    assert line.startswith("jobd: invalid database URL: ") and fragment in line
    assert "s3c" not in line and "PW" not in line


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        (":notaport/db", 'invalid integer value "notaport" for connection option "port"'),
        (":99999/db", 'invalid port number: "99999"'),
        ("/db?sslmode=bogus", 'invalid sslmode value: "bogus"'),
        ("/db?target_session_attrs=bogus", 'invalid target_session_attrs value: "bogus"'),
        ("/db?keepalives=abc", 'invalid integer value "abc" for connection option'),
        ("/db?foo=bar", 'invalid URI query parameter: "foo"'),
    ],
)
def test_an_invalid_connection_option_is_an_input_error(query: str, fragment: str) -> None:
    """libpq refuses these before it connects: the URL is wrong (2), not the server away
    (1)."""
    url = f"postgresql://app:s3cretPW@127.0.0.1{query}"
    line = assert_one_line_error(cli("status", "--database-url", url), 2)
    assert line.startswith("jobd: invalid database URL: ") and fragment in line, line
    assert "s3cretPW" not in line


# --- config files that cannot be read ------------------------------------------------------


def test_a_config_that_is_not_utf8_exits_2(tmp_path: Path, db_url: str) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("node:\n  name: café\n".encode("latin-1"))
    line = assert_one_line_error(cli("status", "-c", str(config), "--database-url", db_url), 2)
    assert f"{config}:2:" in line and "UTF-8" in line


def test_a_config_that_is_a_directory_exits_2(tmp_path: Path, db_url: str) -> None:
    line = assert_one_line_error(cli("status", "-c", str(tmp_path), "--database-url", db_url), 2)
    assert str(tmp_path) in line


def test_a_config_from_the_environment_that_is_not_utf8_exits_2(tmp_path: Path,
                                                               db_url: str) -> None:
    config = tmp_path / "binary.yaml"
    config.write_bytes(b"\xff\xfe\x00lanes: {}\n")
    result = cli("status", "--database-url", db_url, env=clean_env(JOBD_CONFIG=str(config)))
    assert str(config) in assert_one_line_error(result, 2)


def test_a_schedule_with_catchup_all_and_overlap_skip_stops_the_daemon_before_it_starts(
    tmp_path: Path, db_url: str, conn: psycopg.Connection
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text("handlers: {echo: 'jobd.examples:echo'}\nlanes: {default: {}}\n"
                      "schedules:\n  - {id: hourly, cron: '0 * * * *', handler: echo,\n"
                      "     catchup: all, overlap: skip}\n")
    for command in (["run"], ["schedules", "list"]):
        line = assert_one_line_error(
            cli(*command, "-c", str(config), "--database-url", db_url), 2)
        assert line.startswith(f"jobd: {config}:4: schedules[0]: catchup: all and overlap: "
                               "skip cannot both hold"), line
    assert conn.execute("SELECT count(*) FROM schedules").fetchone() == (0,)


# --- output into a closed pipe -------------------------------------------------------------


def test_output_piped_into_head_ends_quietly(db_url: str, conn: psycopg.Connection) -> None:
    # Far more output than a pipe buffers, so jobd is still writing when head exits.
    jobd.enqueue_many(conn, [jobd.JobSpec("h", {"n": n}) for n in range(3000)])
    jobs = subprocess.Popen(
        [sys.executable, "-m", "jobd", "jobs", "list", "--limit", "3000",
         "--database-url", db_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    assert jobs.stdout is not None
    head = subprocess.Popen(["head", "-1"], stdin=jobs.stdout, stdout=subprocess.PIPE)
    jobs.stdout.close()  # head alone holds the read end: its exit closes the pipe
    first, _ = head.communicate(timeout=TIMEOUT)
    _, err = jobs.communicate(timeout=TIMEOUT)
    assert first.decode().split()[:2] == ["id", "lane"]
    assert err.decode() == ""
    assert jobs.returncode == 1


@pytest.mark.parametrize("option", ["--database-url", "--schema", "-c"])
def test_an_option_given_empty_is_refused_not_taken_for_its_default(option: str) -> None:
    """`--database-url "$UNSET"` must not run the command on the default database, nor
    `-c "$UNSET"` without the config's lane and handler checks."""
    line = assert_one_line_error(cli("enqueue", "ecko", option, ""), 2)
    assert "must not be empty" in line


@pytest.mark.parametrize("args", [["--delay", "-5s"], ["--delay=-5s"], ["--delay", "-0.5m"]])
def test_a_negative_delay_is_refused_as_negative_however_it_is_written(args: list[str]) -> None:
    """argparse reads `-5s` after an option as another option ("expected one argument"):
    the value reaches the duration's own check instead."""
    line = assert_one_line_error(cli("enqueue", "h", *args), 2)
    assert "--delay: a duration cannot be negative" in line


@pytest.mark.parametrize(("args", "says"), [
    (["dlq", "purge", "--before", "-5d"], "--before: a duration cannot be negative"),
    (["top", "--once", "--interval", "-1s"], "--interval: a duration cannot be negative"),
    (["jobs", "list", "--before", "-5"], "--before: must be at least 1"),
])
def test_other_negative_durations_are_refused_as_negative(args: list[str], says: str) -> None:
    line = assert_one_line_error(cli(*args), 2)
    assert says in line


@pytest.mark.parametrize("variable", ["JOBD_DATABASE_URL", "JOBD_CONFIG"])
def test_a_variable_set_empty_is_refused_not_taken_for_unset(variable: str) -> None:
    """`JOBD_DATABASE_URL=$PROD_URL jobd ...` with PROD_URL unset must not run on the
    config's database or the local default."""
    line = assert_one_line_error(cli("enqueue", "ecko", env=clean_env(**{variable: ""})), 2)
    assert f"${variable} is set but empty" in line


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["dlq", "replay", "--help"],
                                  ["schedules", "next", "--cron", "* * * * *", "--json"]])
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_output_to_a_full_disk_is_one_line_not_a_traceback(args: list[str],
                                                           unbuffered: str) -> None:
    # Unbuffered (PYTHONUNBUFFERED=1, as under some service managers), the write itself
    # fails, not the flush at the end.
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "jobd", *args], stdout=full,
                                stderr=subprocess.PIPE, text=True,
                                env=clean_env(PYTHONUNBUFFERED=unbuffered), timeout=TIMEOUT)
    assert result.returncode == 1
    assert result.stderr == "jobd: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args, command", [
    (["status", "--bogus"], "jobd status"),
    (["jobs", "list", "--verbose"], "jobd jobs list"),
    (["dlq", "purge", "--before", "30d", "extra"], "jobd dlq purge"),
    (["enqueue", "ok", "--priorty", "3"], "jobd enqueue"),
])
def test_an_unknown_option_names_the_command_whose_help_lists_the_right_ones(
        args: list[str], command: str) -> None:
    # Before: "jobd: unrecognized arguments: --bogus (see jobd --help)", whose help lists
    # the commands, not their options.
    line = assert_one_line_error(cli(*args), 2)
    assert line.startswith(f"{command}: unrecognized arguments: "), line
    assert line.endswith(f"(see {command} --help)"), line
