"""The YAML configuration: the example file, durations, and errors that point at the mistake."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from jobd import validation, workerpool
from jobd.backoff import Backoff
from jobd.config import MAX_CONFIG_BYTES, MIN_WORKER_TIMEOUT, load, parse, parse_duration
from jobd.errors import ConfigError, UsageError
from jobd.worker_status import REPORT_INTERVAL

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "jobd.example.yaml"

HANDLERS = "handlers:\n  echo: jobd.examples:echo\n"


def config_error(tmp_path: Path, text: str) -> tuple[Path, int, str]:
    """Load ``text`` from a file; return the file, the line the error names and the message."""
    path = tmp_path / "jobd.yaml"
    path.write_text(text, "utf-8")
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    match = re.match(rf"^{re.escape(str(path))}:(\d+):", message)
    assert match, f"the message does not start with FILE:LINE: {message!r}"
    assert "\n" not in message
    return path, int(match[1]), message


# --- the example file ----------------------------------------------------------------------


def test_the_example_config_loads() -> None:
    config = load(EXAMPLE)
    assert config.path == str(EXAMPLE)
    assert config.database_url == "postgresql://postgres@127.0.0.1:5432/postgres"
    assert config.schema == "jobd"
    assert config.node_name == "example-1"
    assert config.metrics_listen == "127.0.0.1:9464"
    assert config.max_payload_bytes == 1_048_576
    assert config.worker_timeout == config.shutdown_timeout == 30.0
    assert config.handlers == {
        "echo": "jobd.examples:echo", "sleep": "jobd.examples:sleep", "fail": "jobd.examples:fail",
        "order": "jobd.examples:record_order"}
    assert (config.outbox_lane, config.outbox_senders) == (
        "outbox", {"mail": "jobd.examples:log_mail"})
    assert set(config.lanes) == {"default", "critical", "outbox"}
    default = config.lanes["default"]
    assert (default.workers, default.concurrency, default.visibility_timeout, default.heartbeat,
            default.timeout, default.max_attempts) == (2, 8, 30.0, 10.0, 300.0, 8)
    assert default.backoff == Backoff(1.0, 300.0)
    critical = config.lanes["critical"]
    assert critical.backoff == Backoff(0.5, 60.0)
    assert critical.retry_policy.max_attempts == 5
    assert (default.max_crashes, critical.max_crashes) == (2, 2)
    assert (default.slo_pickup, critical.slo_pickup, config.lanes["outbox"].slo_pickup) == (
        5.0, 1.0, None)
    [schedule] = config.schedules
    assert (schedule.id, schedule.cron, schedule.timezone, schedule.handler, schedule.lane) == (
        "heartbeat-log", "*/5 * * * *", "UTC", "echo", "default")
    assert schedule.payload == {"message": "five minutes passed"}


def test_a_lane_the_node_does_not_configure_gets_the_default_policy() -> None:
    config = load(EXAMPLE)
    assert config.retry_policy("critical").backoff == Backoff(0.5, 60.0)
    policy = config.retry_policy("not-configured-here")
    assert (policy.backoff, policy.max_attempts) == (Backoff(1.0, 300.0), 8)


@pytest.mark.parametrize("text", ["", "\n  \n", "# nothing yet\n", "---\n"])
def test_an_empty_file_is_refused(text: str) -> None:
    """Taken as a config of no lanes, a file truncated mid-deploy would stop every worker of
    a node that reloads it."""
    with pytest.raises(ConfigError, match=r"empty\.yaml: the configuration is empty"):
        parse(text, "empty.yaml")


def test_a_config_of_lanes_alone_gives_the_defaults_for_the_rest() -> None:
    config = parse("lanes: {}\n", "lanes.yaml")
    assert config.lanes == {} and config.handlers == {} and config.schedules == ()
    assert config.schema == "jobd"
    assert config.max_payload_bytes is None  # the database's limit stays as it is


# --- durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("2d", 172_800.0),
        ("1.5s", 1.5), (" 10s ", 10.0), ("45", 45.0), ("0.5", 0.5), (7, 7.0), (2.5, 2.5),
        ("0s", 0.0),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    ["30 sec", "5 minutes", "-5s", "abc", "", "1e3s", "s", True, -1, float("nan"), float("inf")],
)
def test_malformed_durations_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_durations_in_the_file_accept_units_and_bare_numbers() -> None:
    config = parse("lanes:\n  fast: {visibility_timeout: 250ms, heartbeat: 100ms}\n"
                   "  slow: {visibility_timeout: 1h, heartbeat: 5m, timeout: 90, "
                   "backoff: {base: 2, cap: 10m}}\n")
    assert (config.lanes["fast"].visibility_timeout, config.lanes["fast"].heartbeat) == (
        0.25, pytest.approx(0.1))
    slow = config.lanes["slow"]
    assert (slow.visibility_timeout, slow.heartbeat, slow.timeout) == (3600.0, 300.0, 90.0)
    assert slow.backoff == Backoff(2.0, 600.0)


# --- errors name the file, the line and the key --------------------------------------------


def test_unknown_key(tmp_path: Path) -> None:
    _, line, message = config_error(
        tmp_path, "lanes:\n  default:\n    workers: 2\n    wrokers: 3\n")
    assert line == 4
    assert "lanes.default.wrokers: unknown key" in message


def test_unknown_top_level_key(tmp_path: Path) -> None:
    _, line, message = config_error(tmp_path, "database:\n  schema: jobd\nlane: fast\n")
    assert line == 3
    assert "lane: unknown key" in message


def test_wrong_type(tmp_path: Path) -> None:
    path, line, message = config_error(
        tmp_path, "# comment\nlanes:\n  default:\n    concurrency: 4\n    workers: two\n")
    assert line == 5
    assert "lanes.default.workers:" in message
    assert "'two'" in message
    assert message.startswith(str(path))


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("lanes:\n  default:\n    visibility_timeout: soon\n", 3,
         "lanes.default.visibility_timeout"),
        ("limits:\n  max_payload_bytes: lots\n", 2, "limits.max_payload_bytes"),
        ("metrics:\n  listen: 9464\n", 2, "metrics.listen"),
        ("lanes:\n  default:\n    max_crashes: 0\n", 3, "lanes.default.max_crashes"),
        ("supervisor:\n  worker_timeout: 0s\n", 2, "supervisor.worker_timeout"),
        (HANDLERS + "schedules:\n  - id: a\n    cron: '* * * * *'\n    handler: echo\n"
         "    catchup: maybe\n", 7, "schedules[0].catchup"),
        # The outbox's delivery handlers: 'jobd.outbox' and 'jobd.outbox:<sender>'.
        ("handlers:\n  jobd.outbox:mail: myapp.tasks:mail\n", 2, "handlers.jobd.outbox:mail"),
        # A sender's deliveries are of handler jobd.outbox:<sender>, at most 128 bytes.
        ("outbox:\n  senders:\n    " + "s" * 117 + ": myapp.mail:send\nlanes: {outbox: {}}\n",
         3, "outbox.senders." + "s" * 117),
    ],
)
def test_wrong_values_name_their_key(tmp_path: Path, text: str, line: int, key: str) -> None:
    _, reported, message = config_error(tmp_path, text)
    assert reported == line
    assert f"{key}:" in message


@pytest.mark.parametrize("timeout", ["500ms", "1s", "1.5"])
def test_a_worker_timeout_shorter_than_two_liveness_reports_is_refused(
    tmp_path: Path, timeout: str
) -> None:
    _, line, message = config_error(tmp_path, f"supervisor:\n  worker_timeout: {timeout}\n")
    assert line == 2
    assert "supervisor.worker_timeout: must be at least 2s" in message


def test_the_shortest_worker_timeout_outlasts_two_liveness_reports() -> None:
    assert MIN_WORKER_TIMEOUT >= 2 * REPORT_INTERVAL
    assert parse("supervisor:\n  worker_timeout: 2s\nlanes: {default: {}}\n"
                 ).worker_timeout == 2.0


def test_heartbeat_must_be_shorter_than_the_visibility_timeout(tmp_path: Path) -> None:
    _, line, message = config_error(
        tmp_path,
        "lanes:\n  default: {workers: 1}\n  mail: {visibility_timeout: 10s, heartbeat: 10s}\n")
    assert line == 3
    assert "lanes.mail:" in message
    assert "heartbeat" in message and "visibility_timeout" in message


def test_bad_handler_import_path(tmp_path: Path) -> None:
    _, line, message = config_error(
        tmp_path, "handlers:\n  echo: jobd.examples:echo\n  report: myapp.tasks.report\n")
    assert line == 3
    assert "handlers.report:" in message
    assert "module:function" in message


@pytest.mark.parametrize("zone", ["Europe/Atlantis", "Europe", "Etc"])
def test_unknown_timezone(tmp_path: Path, zone: str) -> None:
    # Europe and Etc are folders of the zone database, not zones.
    _, line, message = config_error(
        tmp_path,
        HANDLERS + "schedules:\n  - id: nightly\n    cron: '30 2 * * *'\n"
        f"    timezone: {zone}\n    handler: echo\n")
    assert line == 6
    assert "schedules[0].timezone:" in message
    assert f"unknown time zone {zone!r}" in message


def test_a_reversed_cron_range_names_the_file_and_line(tmp_path: Path) -> None:
    path, line, message = config_error(
        tmp_path,
        HANDLERS + "schedules:\n  - id: nightly\n    cron: '0 22-2 * * *'\n    handler: echo\n")
    assert line == 5
    assert message == (f"{path}:5: schedules[0].cron: invalid cron expression '0 22-2 * * *': "
                       "hour range 22-2 is reversed; write 22-23,0-2")


def test_the_hosts_own_zone_is_refused(tmp_path: Path) -> None:
    # /usr/share/zoneinfo/localtime loads as a zone: each node's own, so nodes in different
    # zones would each fire one occurrence at another instant.
    _, line, message = config_error(
        tmp_path,
        HANDLERS + "schedules:\n  - id: nightly\n    cron: '30 2 * * *'\n"
        "    timezone: localtime\n    handler: echo\n")
    assert line == 6
    assert "schedules[0].timezone: time zone 'localtime' is this host's own zone" in message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("lanes:\n  default:\n    workers: 2\n   concurrency: 3\n", 4),
        ("database:\n  url: 'postgresql://x\nnode:\n  name: a\n", 5),
        ("lanes:\n  default: {workers: 2\nhandlers: {}\n", 3),
        ("handlers:\n\techo: a:b\n", 2),
    ],
)
def test_invalid_yaml(tmp_path: Path, text: str, line: int) -> None:
    _, reported, message = config_error(tmp_path, text)
    assert reported == line
    assert "invalid YAML" in message


def test_a_key_left_empty_takes_its_default(tmp_path: Path) -> None:
    # An empty value is YAML's null, as ~ is: the key's default, as if it were left out.
    path = tmp_path / "jobd.yaml"
    path.write_text("node:\n  name:\nmetrics:\nschedules:\n  # none yet\nlanes:\n"
                    "  default:\n    workers:\n    prefetch:\n    settle_connection:\n"
                    "  other:\n", "utf-8")
    config = load(path)
    default, other = config.lanes["default"], config.lanes["other"]
    assert (default.workers, default.prefetch, default.settle_connection) == (
        other.workers, other.prefetch, other.settle_connection)
    assert not config.schedules and config.metrics_listen is None


@pytest.mark.parametrize(("written", "read_as"), [("010", "8"), ("0x10", "16"), ("1:30", "90"),
                                                  ("0b11", "3")])
def test_an_integer_written_other_than_in_decimal_is_refused(
        tmp_path: Path, written: str, read_as: str) -> None:
    _, line, message = config_error(
        tmp_path, f"lanes:\n  default:\n    workers: 1\n    concurrency: {written}\n")
    assert line == 4
    assert message.endswith(f"lanes.default.concurrency: write integers in decimal, not "
                            f"'{written}' (YAML 1.1 would read it as {read_as})")


@pytest.mark.parametrize(("text", "shown"), [
    ("lanes:\n  default:\n    settle_connection: [true]\n", "not [True]"),
    ("lanes:\n  default:\n    rate: {limit: 5, per: [1]}\n", "not [1]"),
    ("lanes:\n  default:\n    fair_by: {a: b}\n", "not {'a': 'b'}"),
])
def test_a_wrong_value_is_shown_as_written_in_the_error(
        tmp_path: Path, text: str, shown: str) -> None:
    _, _, message = config_error(tmp_path, text)
    assert shown in message and "Located" not in message


def test_a_payloads_integers_keep_yamls_reading(tmp_path: Path) -> None:
    # The decimal rule is for jobd's own settings; a payload is the user's data.
    path = tmp_path / "jobd.yaml"
    path.write_text(HANDLERS + "schedules:\n  - id: chmod\n    cron: '@daily'\n"
                    "    handler: echo\n    payload: {mode: 0644}\n", "utf-8")
    assert load(path).schedules[0].payload == {"mode": 0o644}


@pytest.mark.parametrize("key", ["url", "listen_url"])
def test_an_empty_database_url_is_refused_not_replaced_by_the_default(
        tmp_path: Path, key: str) -> None:
    _, line, message = config_error(tmp_path, f"database:\n  {key}:\n")
    assert line == 2 and f"database.{key}: is empty" in message


@pytest.mark.parametrize("key", ["url", "listen_url"])
@pytest.mark.parametrize("value", ["[postgresql://jobd:Hunter2@db/app]",
                                   "{postgresql://jobd:Hunter2@db/app: 1}"])
def test_a_database_url_that_is_not_a_string_is_refused_without_its_password(
        tmp_path: Path, key: str, value: str) -> None:
    # The message goes to the terminal, or into the daemon's log when a reload is refused.
    _, line, message = config_error(tmp_path, f"database:\n  {key}: {value}\n")
    assert line == 2 and f"database.{key}: must be a non-empty string" in message
    assert "Hunter2" not in message


@pytest.mark.parametrize(("text", "line"), [
    ("lanes:\n  default:\n    workers: !!int abc\n", 3),
    ("lanes:\n  default:\n    workers: !!timestamp x\n", 3),
    ("lanes:\n  default:\n    workers: 0b_\n", 3),
    ("? !!int [1]\n: x\n", 1),
])
def test_a_value_its_tag_cannot_read_is_a_config_error(
        tmp_path: Path, text: str, line: int) -> None:
    assert config_error(tmp_path, text)[1] == line


def test_duplicate_schedule_id(tmp_path: Path) -> None:
    _, _, message = config_error(
        tmp_path,
        HANDLERS + "schedules:\n"
        "  - {id: nightly, cron: '0 1 * * *', handler: echo}\n"
        "  - {id: hourly, cron: '0 * * * *', handler: echo}\n"
        "  - {id: nightly, cron: '0 2 * * *', handler: echo}\n")
    assert "schedules" in message
    assert "duplicate" in message and "nightly" in message
    assert "hourly" not in message


def test_schedule_naming_an_unknown_handler(tmp_path: Path) -> None:
    _, _, message = config_error(
        tmp_path, HANDLERS + "schedules:\n  - {id: s, cron: '* * * * *', handler: missing}\n")
    assert "schedules" in message
    assert "'missing'" in message and "not in handlers" in message


def test_catchup_all_with_overlap_skip_is_refused_naming_what_to_write_instead(
    tmp_path: Path,
) -> None:
    # Missed occurrences are all due at once after a downtime, so skip would run one of
    # them and drop the rest, where all promises each.
    _, line, message = config_error(
        tmp_path, HANDLERS + "schedules:\n  - id: hourly\n    cron: '0 * * * *'\n"
        "    handler: echo\n    catchup: all\n    overlap: skip\n")
    assert line == 4
    assert "schedules[0]: catchup: all and overlap: skip cannot both hold" in message
    assert "catchup: all with overlap: allow" in message
    assert "max_running: 1" in message
    assert "catchup: latest with overlap: skip" in message
    assert "\n" not in message
    # Each of the other combinations loads.
    for catchup, overlap in (("all", "allow"), ("latest", "skip"), ("none", "skip")):
        [schedule] = parse(HANDLERS + "schedules:\n  - {id: s, cron: '0 * * * *', handler: "
                           f"echo, catchup: {catchup}, overlap: {overlap}}}\n").schedules
        assert (schedule.catchup, schedule.overlap) == (catchup, overlap)


def test_duplicate_key(tmp_path: Path) -> None:
    _, line, message = config_error(
        tmp_path, "lanes:\n  default:\n    workers: 2\n    workers: 3\n")
    assert line == 4
    assert "duplicate key" in message


def test_missing_required_schedule_key(tmp_path: Path) -> None:
    _, line, message = config_error(
        tmp_path, HANDLERS + "schedules:\n  - {id: s, handler: echo}\n")
    assert line == 4
    assert "schedules[0]:" in message and "'cron'" in message


def test_sections_of_the_wrong_shape(tmp_path: Path) -> None:
    assert "lanes: must be a mapping" in config_error(tmp_path, "lanes:\n  - default\n")[2]
    assert "schedules: must be a list" in config_error(tmp_path, "schedules: {a: 1}\n")[2]


def test_invalid_schema_name(tmp_path: Path) -> None:
    _, line, message = config_error(tmp_path, "database:\n  schema: Jobd-Prod\n")
    assert line == 2
    assert "database.schema:" in message


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        load(missing)


def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("lanes:\n  default: {}\nnode:\n  name: café\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}:4: the configuration is not UTF-8")
    assert "0xe9" in str(caught.value)


def test_a_directory_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read")):
        load(tmp_path)


def test_a_path_with_nul_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load("jobd\x00.yaml")


def test_yaml_nested_beyond_the_parser_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("lanes: " + "[" * 20_000 + "]" * 20_000 + "\n", "utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*nested too deeply"):
        load(path)


@pytest.mark.parametrize(("text", "where"), [
    ("lanes: &x\n  default: *x\n", "c.yaml:1: lanes.default: "),
    ("handlers: {}\nx: &a [*a]\n", "c.yaml:2: x[0]: "),
])
def test_a_yaml_alias_cycle_is_one_short_line(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(text, "c.yaml")
    assert str(caught.value) == (f"{where}a YAML alias here refers to a collection that "
                                 "contains it (a cycle)")


def laughs(levels: int) -> str:
    """A schedule whose payload is aliases of aliases: nine of each per level, 9**levels
    strings from a few hundred bytes ("billion laughs")."""
    lines = ['x-anchors:\n  l0: &l0 "lol"\n']
    for level in range(1, levels + 1):
        lines.append(f"  l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9)}]\n")
    return ("".join(lines) + HANDLERS + "schedules:\n  - {id: laugh, cron: '* * * * *', "
            f"handler: echo, payload: *l{levels}}}\n")


def test_yaml_aliases_that_expand_without_bound_are_refused() -> None:
    # Six levels are 531,441 strings: parsed in seconds, they are still refused by their
    # expansion, before any key is looked at. Nine levels held a command (or a daemon's
    # reload) for minutes while it took the machine's memory.
    with pytest.raises(ConfigError) as caught:
        parse(laughs(6), "c.yaml")
    message = str(caught.value)
    assert message.startswith("c.yaml:")
    assert "YAML aliases here expand to more than 100,000 repeated values" in message


def test_an_alias_used_a_few_times_is_fine() -> None:
    text = (HANDLERS + "schedules:\n"
            "  - {id: a, cron: '* * * * *', handler: echo, payload: &p {to: ops, n: [1, 2]}}\n"
            "  - {id: b, cron: '0 * * * *', handler: echo, payload: *p}\n")
    config = parse(text, "c.yaml")
    assert [s.payload for s in config.schedules] == [{"to": "ops", "n": [1, 2]}] * 2


def test_a_file_larger_than_any_configuration_is_refused_unparsed(tmp_path: Path) -> None:
    # -c naming a data file or a device (/dev/zero, /dev/urandom: read without end until
    # memory ran out) is refused after 8 MiB, without parsing it.
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"lanes: {default: {}}\n" + b"#" * (MAX_CONFIG_BYTES + 1) + b"\n")
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == (f"{path}: the configuration is larger than 8 MiB: not a "
                                 "jobd configuration")


def test_a_configuration_read_from_a_pipe_loads(tmp_path: Path) -> None:
    # -c <(render-config): process substitution gives a pipe, read like a file.
    read, write = os.pipe()
    with os.fdopen(write, "wb") as writer:
        writer.write(b"lanes: {default: {workers: 1}}\n")
    try:
        assert load(f"/dev/fd/{read}").lanes["default"].workers == 1
    finally:
        os.close(read)


@pytest.mark.parametrize("schema", ["pg_catalog", "pg_toast", "pg_temp", "pg_jobd",
                                    "information_schema"])
def test_postgresqls_own_schemas_are_refused(tmp_path: Path, schema: str) -> None:
    # jobd migrate went on into information_schema, which pg_dump leaves out; pg_catalog
    # failed with advice to run it as the schema's owner.
    _, line, message = config_error(tmp_path, f"database:\n  schema: {schema}\n")
    assert line == 2
    assert f"database.schema: invalid schema name {schema!r}: it is PostgreSQL's own" in message


def test_config_errors_are_usage_errors() -> None:
    # The CLI maps usage errors to exit code 2.
    assert issubclass(ConfigError, UsageError)


# --- errors in nested sections point at the offending key --------------------------------


def test_duplicate_key_names_its_full_path(tmp_path: Path) -> None:
    _, _, message = config_error(tmp_path, "lanes:\n  default:\n    workers: 2\n    workers: 3\n")
    assert "lanes.default.workers:" in message


def test_unknown_handler_error_points_at_the_schedule(tmp_path: Path) -> None:
    text = ("# jobd\n\ndatabase:\n  schema: jobd\n" + HANDLERS +
            "schedules:\n  - id: s\n    cron: '* * * * *'\n    handler: missing\n")
    _, line, message = config_error(tmp_path, text)
    assert line == 10
    assert "schedules[0].handler:" in message


def test_duplicate_schedule_id_points_at_the_repeat(tmp_path: Path) -> None:
    _, line, _ = config_error(
        tmp_path,
        HANDLERS + "schedules:\n"
        "  - {id: hourly, cron: '0 * * * *', handler: echo}\n"
        "  - {id: nightly, cron: '0 1 * * *', handler: echo}\n"
        "  - {id: nightly, cron: '0 2 * * *', handler: echo}\n")
    assert line == 6


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("lanes:\n  default:\n    workers: 2\n    bakoff:\n      base: 1s\n",
         "lanes.default.bakoff: unknown key", {4}),
        ("lanes:\n  'bad lane':\n    workers: 1\n", "lanes.bad lane: invalid lane name", {2}),
        ("lanes:\n  default:\n    workers: 2\n    visibility_timeout: 10s\n    heartbeat: 10s\n",
         "lanes.default: heartbeat", {2, 5}),
        ("lanes:\n  default:\n    backoff:\n      base: 10s\n      cap: 1s\n",
         "lanes.default.backoff: cap must not be below base", {3, 5}),
    ],
)
def test_block_mapping_errors_point_at_the_key(
    tmp_path: Path, text: str, key: str, lines: set[int]
) -> None:
    _, line, message = config_error(tmp_path, text)
    assert key in message
    assert line in lines


@pytest.mark.parametrize(
    "text",
    [
        "lanes:\n  default: {backoff: {base: 1s, cap: .nan}}\n",
        "lanes:\n  default: {visibility_timeout: .inf}\n",
    ],
)
def test_non_finite_durations_are_refused(tmp_path: Path, text: str) -> None:
    config_error(tmp_path, text)


@pytest.mark.parametrize(
    "text",
    [
        "lanes:\n  default: {visibility_timeout: 99999999999999d}\n",
        "lanes:\n  default: {backoff: {base: 1s, cap: 99999999999999d}}\n",
        # An integer too large for a float.
        "lanes:\n  default: {visibility_timeout: 1" + "0" * 400 + "}\n",
        "lanes:\n  default: {visibility_timeout: -1" + "0" * 400 + "}\n",
    ],
)
def test_durations_beyond_the_timestamp_range_are_refused(tmp_path: Path, text: str) -> None:
    config_error(tmp_path, text)


# --- the pickup SLO ------------------------------------------------------------------------


def test_a_lane_may_declare_a_pickup_slo() -> None:
    config = parse("lanes:\n  fast:\n    slo:\n      pickup: 250ms\n"
                   "  slow: {slo: {pickup: 2m}}\n  plain: {}\n  empty: {slo: {}}\n")
    assert {name: lane.slo_pickup for name, lane in config.lanes.items()} == {
        "fast": 0.25, "slow": 120.0, "plain": None, "empty": None}


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("lanes:\n  default:\n    slo:\n      pickup: soon\n", 4,
         "lanes.default.slo.pickup: expected a duration"),
        ("lanes:\n  default:\n    slo:\n      pickup: 0s\n", 4,
         "lanes.default.slo.pickup: must be longer than zero"),
        ("lanes:\n  default:\n    slo:\n      pickup: 5s\n      pikup: 5s\n", 5,
         "lanes.default.slo.pikup: unknown key"),
        ("lanes:\n  default:\n    slo: 5s\n", 3, "lanes.default.slo: must be a mapping"),
        ("lanes:\n  default:\n    slo:\n      pickup: -1s\n", 4,
         "lanes.default.slo.pickup: a duration cannot be negative"),
    ],
)
def test_a_bad_slo_names_its_key(tmp_path: Path, text: str, line: int, expected: str) -> None:
    _, found_line, message = config_error(tmp_path, text)
    assert expected in message
    assert found_line == line


def test_the_slo_does_not_count_as_a_worker_setting() -> None:
    # A reload that changes only the SLO must not replace the lane's workers: the worker
    # pool compares lane configs, and the SLO is not part of what a worker runs with.
    before = parse("lanes:\n  default: {concurrency: 4, slo: {pickup: 5s}}\n").lanes["default"]
    after = parse("lanes:\n  default: {concurrency: 4, slo: {pickup: 1s}}\n").lanes["default"]
    other = parse("lanes:\n  default: {concurrency: 5, slo: {pickup: 5s}}\n").lanes["default"]
    assert before.slo_pickup != after.slo_pickup
    assert not workerpool._settings_differ(after, before)
    assert workerpool._settings_differ(other, before)
    # Nor max_crashes, which the supervisor's crash attribution applies.
    crashes = parse("lanes:\n  default: {concurrency: 4, max_crashes: 5}\n").lanes["default"]
    assert crashes.max_crashes == 5 and crashes.retry_policy.max_crashes == 5
    assert not workerpool._settings_differ(crashes, before)


@pytest.mark.parametrize(("payload", "message"), [
    ("{since: 2026-01-01}", "quote it to keep it as text"),
    ("{at: 2026-01-01 09:00:00}", "quote it to keep it as text"),
    ("!!binary aGVsbG8=", "quote it to keep it as text"),
    ("{x: .nan}", "cannot be stored as JSON"),
    ("{x: .inf}", "cannot be stored as JSON"),
    ('{x: "a\\0b"}', "NUL"),
])
def test_a_schedule_payload_that_no_job_could_carry_is_refused_at_load(
    payload: str, message: str
) -> None:
    """Accepted, it failed every declaration of the file's schedules (the good ones too) or
    the daemon's start and reload."""
    text = ("handlers: {echo: 'jobd.examples:echo'}\n"
            "schedules:\n"
            "  - {id: good, cron: '* * * * *', handler: echo, payload: {ok: 1}}\n"
            f"  - {{id: bad, cron: '* * * * *', handler: echo, payload: {payload}}}\n")
    with pytest.raises(ConfigError, match=r"s.yaml:4: schedules\[1\]\.payload: ") as caught:
        parse(text, "s.yaml")
    assert message in str(caught.value)
    quoted = parse(text.replace(payload, "{since: '2026-01-01'}"), "s.yaml")
    assert quoted.schedules[1].payload == {"since": "2026-01-01"}


def test_a_schedule_payload_over_the_configs_payload_limit_is_refused_at_load() -> None:
    # A fire stores its job without the size check of the other entry points: a payload
    # that jobd enqueue refuses was enqueued at every occurrence.
    text = ("handlers: {echo: 'jobd.examples:echo'}\n"
            "limits: {max_payload_bytes: 1000}\n"
            "schedules:\n"
            f"  - {{id: big, cron: '* * * * *', handler: echo, payload: {{s: {'x' * 993}}}}}\n")
    with pytest.raises(ConfigError, match=r"s.yaml:4: schedules\[0\]\.payload: payload is "
                                          r"1,002 bytes, over the limit of 1,000"):
        parse(text, "s.yaml")
    assert parse(text.replace("1000}", "1002}"), "s.yaml").schedules[0].payload["s"]
    # Without limits, the database's own default applies (migration 0006).
    huge = text.replace("limits: {max_payload_bytes: 1000}\n", "").replace(
        "x" * 993, "x" * validation.DEFAULT_MAX_PAYLOAD_BYTES)
    with pytest.raises(ConfigError, match="over the limit of 1,048,576"):
        parse(huge, "s.yaml")
