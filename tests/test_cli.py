"""The `jobd` command line, run as a subprocess against a real database."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from cli_support import TIMEOUT, UNREACHABLE, assert_one_line_error, clean_env, cli, ok
from daemon_support import enqueued_when_due
from psycopg.types.json import Jsonb

import jobd
from jobd import queue
from jobd.cli import build_parser
from jobd.duties.metrics_sampler import take_sample
from jobd.queries import query
from jobd.queue import Failure

if TYPE_CHECKING:
    from conftest import Databases

EXAMPLE = str(Path(__file__).resolve().parent.parent / "config" / "jobd.example.yaml")
TOP = 2**31 - 1


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def count_jobs(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM all_jobs").fetchone()
    assert row is not None
    return int(row[0])


def make_dead(conn: psycopg.Connection, lane: str = "default", key: str | None = None) -> int:
    # The highest priority, so the claim takes this job whatever else is queued.
    job_id = jobd.enqueue(conn, "send_email", {"to": "a@example.com"}, lane=lane,
                          priority=TOP, max_attempts=1, idempotency_key=key)
    [job] = queue.claim(conn, lane, "node-1:1", 1, 30)
    assert queue.fail(conn, [Failure(job.lease, "smtp refused", 0, 8)]).dead == [job_id]
    return job_id


def make_done(conn: psycopg.Connection, lane: str = "default") -> int:
    job_id = jobd.enqueue(conn, "send_email", lane=lane, priority=TOP)
    [job] = queue.claim(conn, lane, "node-1:1", 1, 30)
    assert queue.complete(conn, [job.lease]).applied == [job_id]
    return job_id


# --- enqueue -------------------------------------------------------------------------------


def test_enqueue_prints_the_id_of_a_committed_job(db_url: str, conn: psycopg.Connection) -> None:
    out = ok("enqueue", "send_email", "--payload", '{"to": "a@example.com"}', "--lane", "mail",
             "--priority", "5", "--max-attempts", "3", "--database-url", db_url)
    assert re.fullmatch(r"\d+\n", out)
    row = conn.execute(
        "SELECT handler, payload, lane, priority, max_attempts, state, run_at <= now() "
        "FROM jobs WHERE id = %s", (int(out),)).fetchone()
    assert row == ("send_email", {"to": "a@example.com"}, "mail", 5, 3, "pending", True)


def test_enqueue_json_output(db_url: str, conn: psycopg.Connection) -> None:
    data = ok_json("enqueue", "h", "--database-url", db_url)
    assert conn.execute("SELECT handler FROM jobs WHERE id = %s", (data["id"],)
                        ).fetchone() == ("h",)


def test_delay_is_measured_by_the_database_clock(db_url: str, conn: psycopg.Connection) -> None:
    job_id = int(ok("enqueue", "h", "--delay", "30s", "--database-url", db_url))
    row = conn.execute("SELECT run_at - created_at, run_at > now() FROM jobs WHERE id = %s",
                       (job_id,)).fetchone()
    assert row == (timedelta(seconds=30), True)


def test_run_at_is_the_given_instant(db_url: str, conn: psycopg.Connection) -> None:
    job_id = int(ok("enqueue", "h", "--run-at", "2031-06-01T09:30:00+02:00",
                    "--database-url", db_url))
    row = conn.execute("SELECT run_at FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    assert row[0] == datetime.fromisoformat("2031-06-01T07:30:00+00:00")


def test_idempotency_key_twice_prints_the_same_id(db_url: str, conn: psycopg.Connection) -> None:
    args = ("enqueue", "charge", "--idempotency-key", "order-17", "--database-url", db_url)
    first, second = ok(*args), ok(*args)
    assert first == second
    assert count_jobs(conn) == 1


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["h", "--payload", "{not json"], "JSON"),
        (["h", "--payload", "{\"a\": 1"], "JSON"),
        (["h", "--lane", "bad lane"], "lane"),
        (["h", "--lane", ""], "lane"),
        (["bad/handler"], "handler"),
        (["h", "--priority", "high"], "integer"),
        (["h", "--priority", str(2**31)], "32-bit"),
        (["h", "--max-attempts", "0"], "at least 1"),
        (["h", "--run-at", "2030-01-01T00:00:00"], "UTC offset"),
        (["h", "--run-at", "tomorrow"], "ISO 8601"),
        (["h", "--delay", "soon"], "duration"),
        (["h", "--delay", "5s", "--run-at", "2030-01-01T00:00:00Z"], "not allowed"),
        (["h", "--idempotency-key", ""], "idempotency_key"),
    ],
)
def test_bad_enqueue_input_is_a_one_line_usage_error(
    db_url: str, conn: psycopg.Connection, args: list[str], fragment: str
) -> None:
    line = assert_one_line_error(cli("enqueue", *args, "--database-url", db_url), 2)
    assert fragment in line
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["nope"], "unknown handler 'nope'"), (["echo", "--lane", "nope"], "unknown lane 'nope'")],
)
def test_handlers_and_lanes_must_be_in_the_config(
    db_url: str, conn: psycopg.Connection, args: list[str], fragment: str
) -> None:
    line = assert_one_line_error(
        cli("enqueue", *args, "-c", EXAMPLE, "--database-url", db_url), 2)
    assert fragment in line
    assert count_jobs(conn) == 0
    assert ok("enqueue", "echo", "--lane", "critical", "-c", EXAMPLE, "--database-url", db_url)
    assert count_jobs(conn) == 1


def test_migrate_shows_each_flip_of_the_fleets_payload_limit(tmp_path: Path, db_url: str
                                                               ) -> None:
    """Nodes whose files give different limits set the database's back and forth as each
    migrates before it starts: every change is one line with the value it replaced, and a
    migrate that changes nothing says nothing of the limit."""
    small, large, none = (tmp_path / "small.yaml", tmp_path / "large.yaml",
                          tmp_path / "none.yaml")
    small.write_text("limits:\n  max_payload_bytes: 2000\n", "utf-8")
    large.write_text("limits:\n  max_payload_bytes: 5000\n", "utf-8")
    none.write_text("lanes:\n  default: {}\n", "utf-8")

    def limit_lines(config: Path) -> list[str]:
        out = ok("migrate", "-c", str(config), "--database-url", db_url)
        return [line for line in out.splitlines() if "max_payload_bytes" in line]

    def change(was: str, new: str, config: Path) -> list[str]:
        return [f"max_payload_bytes changed from {was} to {new} (limits.max_payload_bytes in "
                f"{config}; one limit for every node)"]

    assert limit_lines(small) == change("1,048,576", "2,000", small)
    assert limit_lines(small) == []
    assert limit_lines(large) == change("2,000", "5,000", large)
    assert limit_lines(none) == []  # a file without the limit leaves it as it is
    assert limit_lines(small) == change("5,000", "2,000", small)
    flip = json.loads(ok("migrate", "-c", str(large), "--database-url", db_url, "--json"))
    assert (flip["max_payload_bytes_set"], flip["max_payload_bytes_was"]) == (5000, 2000)
    same = json.loads(ok("migrate", "-c", str(large), "--database-url", db_url, "--json"))
    assert (same["max_payload_bytes_set"], same["max_payload_bytes_was"]) == (None, None)


def test_payload_over_the_configured_limit(
    tmp_path: Path, db_url: str, conn: psycopg.Connection
) -> None:
    config = tmp_path / "small.yaml"
    config.write_text("limits:\n  max_payload_bytes: 32\n", "utf-8")
    # The limit is the database's: `jobd migrate -c` writes it there for every entry point.
    out = ok("migrate", "-c", str(config), "--database-url", db_url)
    assert out.splitlines()[-1] == (
        f"max_payload_bytes changed from 1,048,576 to 32 (limits.max_payload_bytes in {config};"
        " one limit for every node)")
    again = ok("migrate", "-c", str(config), "--database-url", db_url, "--json")
    assert json.loads(again)["max_payload_bytes_set"] is None  # it was set already
    exact = json.dumps({"to": "x" * 22})
    assert len(exact.encode()) == 32
    too_big = json.dumps({"to": "x" * 23})
    line = assert_one_line_error(cli("enqueue", "h", "--payload", too_big, "-c", str(config),
                                     "--database-url", db_url), 2)
    assert "33 bytes" in line and "max_payload_bytes" in line
    assert count_jobs(conn) == 0
    ok("enqueue", "h", "--payload", exact, "-c", str(config), "--database-url", db_url)
    assert count_jobs(conn) == 1


def test_an_invalid_config_file_is_a_usage_error(tmp_path: Path, db_url: str) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("lanes:\n  default:\n    workers: many\n", "utf-8")
    line = assert_one_line_error(cli("status", "-c", str(config), "--database-url", db_url), 2)
    assert f"{config}:3:" in line and "lanes.default.workers" in line


@pytest.mark.parametrize("command", [["enqueue", "h"], ["status"], ["migrate"], ["top"]])
def test_unreachable_database(command: list[str]) -> None:
    """A runtime failure (exit code 1), not a usage error: the same command may work once
    the server is back."""
    line = assert_one_line_error(cli(*command, "--database-url", UNREACHABLE), 1)
    assert "cannot connect" in line


@pytest.mark.parametrize(
    "command",
    [["status"], ["jobs", "list"], ["jobs", "show", "1"], ["dlq", "list"],
     ["dlq", "replay", "1"], ["dlq", "purge", "--before", "1d"], ["top"]],
)
def test_missing_tables_ask_for_migrate(databases: Databases, command: list[str]) -> None:
    line = assert_one_line_error(cli(*command, "--database-url", databases.empty()), 1)
    assert "jobd migrate" in line


def test_enqueue_into_an_unmigrated_database_asks_for_migrate(databases: Databases) -> None:
    line = assert_one_line_error(cli("enqueue", "h", "--database-url", databases.empty()), 1)
    assert "jobd migrate" in line


def test_a_schema_that_is_not_there_is_named(db_url: str) -> None:
    line = assert_one_line_error(cli("status", "--schema", "nosuch", "--database-url", db_url),
                                 1)
    assert line.startswith("jobd: schema nosuch is missing or incomplete in this database")


def test_a_schema_of_an_older_jobd_asks_for_migrate(db_url: str, conn: psycopg.Connection
                                                   ) -> None:
    # An older jobd's tables lack columns this one reads: "database error: column ... does
    # not exist" said nothing of the cure.
    conn.execute("ALTER TABLE jobd.nodes DROP COLUMN heartbeat_interval")
    line = assert_one_line_error(cli("status", "--database-url", db_url), 1)
    assert line.startswith("jobd: schema jobd is missing or incomplete in this database; run "
                           "`jobd migrate` first")


# --- status --------------------------------------------------------------------------------


def test_status_shows_counts_per_lane_and_dlq_depth(db_url: str, conn: psycopg.Connection
                                                    ) -> None:
    dead = [make_dead(conn, "mail") for _ in range(2)]
    make_done(conn)
    jobd.enqueue(conn, "h")
    jobd.enqueue(conn, "h")
    jobd.enqueue(conn, "h", lane="mail", priority=9)
    assert len(queue.claim(conn, "mail", "node-1:1", 1, 30)) == 1
    jobd.enqueue(conn, "h", lane="mail")
    [failing] = queue.claim(conn, "mail", "node-1:1", 1, 30)
    assert queue.fail(conn, [Failure(failing.lease, "x", 60, 8)]).retried == [failing.id]

    lanes = {s["lane"]: s for s in ok_json("status", "--database-url", db_url)["lanes"]}
    assert set(lanes) == {"default", "mail"}
    assert {k: lanes["default"][k] for k in ("pending", "claimed", "failed", "dead")} == {
        "pending": 2, "claimed": 0, "failed": 0, "dead": 0}
    assert {k: lanes["mail"][k] for k in ("pending", "claimed", "failed", "dead")} == {
        "pending": 0, "claimed": 1, "failed": 1, "dead": len(dead)}
    assert lanes["default"]["oldest_unclaimed_age"] >= 0

    text = ok("status", "--database-url", db_url).splitlines()
    assert text[0].split()[:4] == ["lane", "pending", "claimed", "failed"]
    assert "dead (DLQ)" in text[0]
    # The lane table runs to the first blank line (other sections may follow).
    table = text[1:text.index("")] if "" in text else text[1:]
    rows = {line.split()[0]: line.split()[1:5] for line in table}
    assert rows == {"default": ["2", "0", "0", "0"], "mail": ["0", "1", "1", "2"]}


def test_status_lists_configured_lanes_without_jobs(db_url: str) -> None:
    lanes = ok_json("status", "-c", EXAMPLE, "--database-url", db_url)["lanes"]
    assert [s["lane"] for s in lanes] == ["critical", "default", "outbox"]
    assert all(s["pending"] == s["dead"] == 0 for s in lanes)


def test_status_of_an_empty_queue(db_url: str) -> None:
    assert "no jobs" in ok("status", "--database-url", db_url)


def report_node(conn: psycopg.Connection, instance: str, workers: dict[str, int]) -> None:
    """A live node's heartbeat, as a running supervisor writes it."""
    conn.execute(query("node_heartbeat"), {"instance": instance, "node": "web-1", "pid": 4242,
                                           "workers": Jsonb(workers), "counters": Jsonb({}),
                                           "interval": 10.0, "listening": True,
                                           "archive_retention": None, "lane_settings": None})


def test_status_marks_lanes_no_live_worker_serves(db_url: str, conn: psycopg.Connection
                                                  ) -> None:
    jobd.enqueue(conn, "h", lane="mail")
    report_node(conn, "web-1:1", {"default": 2, "outbox": 0})
    report_node(conn, "web-2:1", {"default": 1})
    lanes = {s["lane"]: s for s in ok_json("status", "-c", EXAMPLE,
                                           "--database-url", db_url)["lanes"]}
    served = {lane: (s["served"], s["live_workers"]) for lane, s in lanes.items()}
    assert served == {"default": (True, 3), "critical": (False, 0), "outbox": (False, 0),
                      "mail": (False, 0)}
    text = ok("status", "-c", EXAMPLE, "--database-url", db_url).splitlines()
    assert text[0].endswith("live workers")
    rows = {line.split()[0]: line for line in text[1:text.index("")]}
    assert rows["default"].endswith("  3")
    for lane in ("critical", "outbox", "mail"):
        assert rows[lane].endswith("0 (no live worker)"), rows[lane]


def test_status_counts_no_live_worker_on_a_gone_node(db_url: str, conn: psycopg.Connection
                                                     ) -> None:
    """A node judged gone listed its last worker counts under "lanes (live workers)" (`bonly:
    1` next to `gone`) while the lane table said no live worker served that lane: its lanes
    stay listed, at 0, in the text and in --json."""
    jobd.enqueue(conn, "h", lane="bonly")
    report_node(conn, "web-1:1", {"default": 2})
    report_node(conn, "old-1:1", {"default": 1, "bonly": 1})
    conn.execute("UPDATE nodes SET node = 'old-1', seen_at = now() - interval '5 minutes'"
                 " WHERE instance = 'old-1:1'")
    data = ok_json("status", "--database-url", db_url)
    lanes = {s["lane"]: (s["served"], s["live_workers"]) for s in data["lanes"]}
    assert lanes == {"default": (True, 2), "bonly": (False, 0)}
    nodes = {n["instance"]: n for n in data["nodes"]}
    assert (nodes["old-1:1"]["gone"], nodes["old-1:1"]["lanes"], nodes["old-1:1"]["workers"]
            ) == (True, ["bonly", "default"], {"bonly": 0, "default": 0})
    assert nodes["web-1:1"]["workers"] == {"default": 2}
    assert set(nodes["old-1:1"]) == set(nodes["web-1:1"])  # the same keys, gone or live
    text = ok("status", "--database-url", db_url).splitlines()
    [gone] = [line for line in text if line.startswith("old-1 ")]
    assert "bonly: 0, default: 0" in gone and "gone" in gone, gone
    [live] = [line for line in text if line.startswith("web-1 ")]
    assert "default: 2" in live and "live" in live, live


def test_status_names_handlers_the_config_does_not_list(db_url: str, conn: psycopg.Connection
                                                        ) -> None:
    # sendmail and resize: handlers no node with this config has.
    jobd.enqueue(conn, "sendmail")
    [claimed] = queue.claim(conn, "default", "node-1:1", 1, 30)  # another node runs it
    assert claimed.handler == "sendmail"
    jobd.enqueue(conn, "echo")
    for _ in range(3):
        jobd.enqueue(conn, "sendmail")
    jobd.enqueue(conn, "resize", lane="mail", delay=3600)  # waiting too, due or not
    lanes = {s["lane"]: s for s in ok_json("status", "-c", EXAMPLE,
                                           "--database-url", db_url)["lanes"]}
    assert {lane: s["handlers_not_in_config"] for lane, s in lanes.items()} == {
        "default": {"sendmail": 3},
        "mail": {"resize": 1}, "critical": {}, "outbox": {}}
    text = ok("status", "-c", EXAMPLE, "--database-url", db_url)
    assert "jobs of handlers this config does not list" in text
    assert "  mail: resize (1 waiting)" in text.splitlines()
    # Without a config there is no list to compare with.
    without = ok_json("status", "--database-url", db_url)["lanes"]
    assert {s["handlers_not_in_config"] for s in without} == {None}
    assert "does not list" not in ok("status", "--database-url", db_url)


def test_status_shows_each_lanes_pickup_slo_and_whether_it_is_met(
    db_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text("lanes:\n  slow: {slo: {pickup: 5s}}\n  fast: {slo: {pickup: 1m}}\n"
                      "  plain: {}\n  idle: {slo: {pickup: 1s}}\n", "utf-8")
    row = conn.execute("SELECT now() - interval '30 seconds'").fetchone()
    assert row is not None
    for lane in ("slow", "fast", "plain"):
        jobd.enqueue(conn, "h", lane=lane, run_at=row[0])
    enqueued_when_due(conn)
    lanes = {s["lane"]: s for s in ok_json("status", "-c", str(config),
                                           "--database-url", db_url)["lanes"]}
    assert {lane: (s["slo_pickup_seconds"], s["over_slo"]) for lane, s in lanes.items()} == {
        "slow": (5.0, True), "fast": (60.0, False), "plain": (None, None),
        "idle": (1.0, False)}
    assert lanes["slow"]["oldest_unclaimed_age"] >= 30

    text = ok("status", "-c", str(config), "--database-url", db_url).splitlines()
    assert "pickup SLO" in text[0]
    rows = {line.split()[0]: line for line in text[1:text.index("")]}
    assert "OVER SLO" in rows["slow"]
    assert [lane for lane, line in rows.items() if "OVER SLO" in line] == ["slow"]
    assert " 1m " not in rows["fast"] and " 60s " in rows["fast"]


def test_paused_jobs_leave_the_oldest_age_and_the_slo_of_status_as_of_the_gauge(
    db_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    # The incident runbook pauses the poison handler: its jobs wait by the operator's choice.
    # The gauge and JobdPickupSLOBreached leave them out (migration 0039); status and top
    # flagged the lane OVER SLO for as long as the pause lasted.
    config = tmp_path / "jobd.yaml"
    config.write_text("lanes:\n  a: {slo: {pickup: 5s}}\n", "utf-8")
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    jobd.enqueue(conn, "poison", lane="a", run_at=row[0] - timedelta(seconds=300))
    jobd.enqueue(conn, "h", lane="a", run_at=row[0] - timedelta(seconds=30))
    enqueued_when_due(conn)

    def status_of_a() -> tuple[float, bool, int]:
        [lane] = ok_json("status", "-c", str(config), "--database-url", db_url)["lanes"]
        return lane["oldest_unclaimed_age"], lane["over_slo"], lane["due"]

    def gauge_of_a() -> float:
        return take_sample(conn, ["a"]).lanes["a"].oldest_unclaimed_age

    age, over, due = status_of_a()
    assert (age >= 300, over, due) == (True, True, 2)
    jobd.pause(conn, "a", "poison")
    age, over, due = status_of_a()
    assert (30 <= age < 300, over, due) == (True, True, 2)  # h still waits
    assert gauge_of_a() == pytest.approx(age, abs=5.0)
    queue.claim(conn, "a", "node-1:1", 1, 30)  # h is taken: only the paused job waits
    age, over, due = status_of_a()
    assert (age, over, due) == (0.0, False, 1)
    assert gauge_of_a() == 0.0
    top = json.loads(ok("top", "--json", "-c", str(config), "--database-url", db_url))
    assert [(lane["lane"], lane["over_slo"]) for lane in top["lanes"]] == [("a", False)]
    [row] = ok("status", "-c", str(config), "--database-url", db_url).splitlines()[1:2]
    assert row.split()[:6] == ["a", "1", "1", "0", "0", "-"] and "OVER SLO" not in row
    top_rows = ok("top", "-c", str(config), "--database-url", db_url).splitlines()
    [top_row] = [line for line in top_rows if line.startswith("a ")]
    assert top_row.split()[:7] == ["a", "2", "1", "0", "1", "0", "-"], top_row
    jobd.resume(conn, "a", "poison")
    jobd.pause(conn, "a")
    assert status_of_a()[:2] == (0.0, False)


# --- jobs ----------------------------------------------------------------------------------


def shown_state(db_url: str, job_id: int) -> str:
    out = ok("jobs", "show", str(job_id), "--database-url", db_url)
    match = re.search(r"^\s*state: (\w+)$", out, re.MULTILINE)
    assert match, out
    # One column of labels, the longest (cancel_requested_at, shown for live jobs) included.
    fields = [line for line in out.splitlines() if not line.startswith(("errors", "  "))]
    assert len({line.index(": ") for line in fields}) == 1, out
    assert ok_json("jobs", "show", str(job_id), "--database-url", db_url)["state"] == match[1]
    return match[1]


def test_jobs_show_live_archived_and_dead(db_url: str, conn: psycopg.Connection) -> None:
    pending = jobd.enqueue(conn, "h", {"n": 1})
    done = make_done(conn)
    dead = make_dead(conn)
    assert shown_state(db_url, pending) == "pending"
    assert shown_state(db_url, done) == "done"
    assert shown_state(db_url, dead) == "dead"
    shown = ok_json("jobs", "show", str(dead), "--database-url", db_url)
    assert shown["id"] == dead
    assert shown["payload"] == {"to": "a@example.com"}
    assert [e["error"] for e in shown["errors"]] == ["smtp refused"]
    assert "smtp refused" in ok("jobs", "show", str(dead), "--database-url", db_url)


def test_jobs_show_unknown_id(db_url: str) -> None:
    # A wrong id is an input error (exit 2), as for dlq replay.
    line = assert_one_line_error(cli("jobs", "show", "424242", "--database-url", db_url), 2)
    assert "424242" in line


TRACEBACK = ('RuntimeError: smtp refused\nTraceback (most recent call last):\n'
             '  File "app.py", line 3, in send\nRuntimeError: smtp refused')


def fail_attempts(conn: psycopg.Connection, job_id: int, errors: list[str]) -> None:
    """Claim and fail ``job_id`` once per error (due again at once: retry delay 0)."""
    for error in errors:
        [job] = queue.claim(conn, "default", "node-1:1", 1, 30)
        assert job.id == job_id
        queue.fail(conn, [Failure(job.lease, error, 0, 8)])


def show_fields(out: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^\s*(\w+): (.*)$", out, re.MULTILINE)}


def test_jobs_show_labels_the_error_history(db_url: str, conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "send_email", priority=TOP, max_attempts=2)
    fail_attempts(conn, job_id, [TRACEBACK, "TimeoutError: no answer"])
    out = ok("jobs", "show", str(job_id), "--database-url", db_url)
    lines = out.splitlines()
    history = lines[lines.index("errors (2 attempts):") + 1:]
    assert len(history) == 2
    assert re.fullmatch(r"  attempt 1 at \S+ \S+Z on worker node-1:1: "
                        r"RuntimeError: smtp refused \.\.\.", history[0]), history[0]
    assert history[1].endswith("on worker node-1:1: TimeoutError: no answer")
    assert "Traceback" not in out
    assert show_fields(out)["last_error"] == "TimeoutError: no answer"
    full = ok("jobs", "show", str(job_id), "--full-errors", "--database-url", db_url)
    assert '    Traceback (most recent call last):' in full.splitlines()
    shown = ok_json("jobs", "show", str(job_id), "--database-url", db_url)
    assert [e["error"] for e in shown["errors"]] == [TRACEBACK, "TimeoutError: no answer"]

    ok("dlq", "replay", str(job_id), "--database-url", db_url)
    replayed = ok("jobs", "show", str(job_id), "--database-url", db_url).splitlines()
    assert "errors (2 attempts):" in replayed
    assert re.fullmatch(r"  replayed at \S+ \S+Z with a fresh attempt budget", replayed[-1])


def test_jobs_show_without_errors(db_url: str, conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    assert ok("jobs", "show", str(job_id), "--database-url", db_url).splitlines()[-1] == (
        "errors: none")


@pytest.mark.parametrize(
    ("lane", "own", "config", "shown", "effective", "source"),
    [
        ("default", 3, [], "3", 3, "job"),
        # Where the number comes from, with the lane named as such: "8 (lane default)" read
        # as "from lane 'default'", and another node's config may give the lane another value.
        ("default", None, ["-c", EXAMPLE],
         f"8 (the max_attempts of lane 'default' in {EXAMPLE}; a node with another config "
         "runs the job with its own)", 8, "lane"),
        ("critical", None, ["-c", EXAMPLE],
         f"5 (the max_attempts of lane 'critical' in {EXAMPLE}; a node with another config "
         "runs the job with its own)", 5, "lane"),
        ("critical", 2, ["-c", EXAMPLE], "2", 2, "job"),
        ("mail", None, ["-c", EXAMPLE],
         f"not set on the job: lane 'mail' is not in {EXAMPLE}, so the config of the nodes "
         "that run it decides", None, "daemon"),
        ("default", None, [],
         "not set on the job: the config of the nodes that run lane 'default' decides "
         "(pass -c FILE to see one)", None, "daemon"),
    ],
)
def test_jobs_show_gives_the_effective_max_attempts(
    db_url: str, conn: psycopg.Connection, lane: str, own: int | None, config: list[str],
    shown: str, effective: int | None, source: str
) -> None:
    job_id = jobd.enqueue(conn, "echo", lane=lane, max_attempts=own)
    out = ok("jobs", "show", str(job_id), *config, "--database-url", db_url)
    assert show_fields(out)["max_attempts"] == shown
    data = ok_json("jobs", "show", str(job_id), *config, "--database-url", db_url)
    assert (data["max_attempts"], data["effective_max_attempts"],
            data["max_attempts_source"]) == (own, effective, source)


def test_jobs_show_prints_a_long_payload_only_when_asked(
    db_url: str, conn: psycopg.Connection
) -> None:
    short = jobd.enqueue(conn, "h", {"to": "a@example.com"})
    assert show_fields(ok("jobs", "show", str(short), "--database-url", db_url))[
        "payload"] == '{"to": "a@example.com"}'
    big = {"blob": "x" * 900_000}
    long = jobd.enqueue(conn, "h", big)
    out = ok("jobs", "show", str(long), "--database-url", db_url)
    assert len(out) < 2000
    assert show_fields(out)["payload"] == (
        f"{len(json.dumps(big))} bytes of JSON; use --payload to show it")
    whole = show_fields(ok("jobs", "show", str(long), "--payload", "--database-url", db_url))
    assert json.loads(whole["payload"]) == big
    assert ok_json("jobs", "show", str(long), "--database-url", db_url)["payload"] == big


def test_jobs_show_a_payload_python_cannot_decode(db_url: str, conn: psycopg.Connection
                                                  ) -> None:
    # Written before the entry points refused such payloads: it must still be shown.
    row = conn.execute("INSERT INTO jobs (handler, payload) VALUES ('h', %s::jsonb) "
                       "RETURNING id", ('{"n": ' + "7" * 5000 + "}",)).fetchone()
    assert row is not None
    out = ok("jobs", "show", str(row[0]), "--payload", "--database-url", db_url)
    assert show_fields(out)["payload"].startswith('{"n": 777')
    assert "cannot be decoded" in show_fields(out)["payload"]
    data = ok_json("jobs", "show", str(row[0]), "--database-url", db_url)
    assert data["payload"] is None and "cannot be decoded" in data["payload_problem"]
    assert data["payload_text"].startswith('{"n": 777')


def test_jobs_list_filters_by_state_and_lane(db_url: str, conn: psycopg.Connection) -> None:
    done = [make_done(conn), make_done(conn, "mail")]
    pending = jobd.enqueue(conn, "h")
    dead = make_dead(conn)
    listed = ok_json("jobs", "list", "--state", "done", "--database-url", db_url)
    assert sorted(row["id"] for row in listed) == sorted(done)
    assert {row["state"] for row in listed} == {"done"}
    mail = ok_json("jobs", "list", "--state", "done", "--lane", "mail", "--database-url", db_url)
    assert [row["id"] for row in mail] == [done[1]]
    every = ok_json("jobs", "list", "--database-url", db_url)
    assert [row["id"] for row in every] == sorted([*done, pending, dead], reverse=True)
    assert len(ok_json("jobs", "list", "--limit", "2", "--database-url", db_url)) == 2
    text = ok("jobs", "list", "--state", "done", "--database-url", db_url)
    assert {int(line.split()[0]) for line in text.splitlines()[1:]} == set(done)
    assert_one_line_error(cli("jobs", "list", "--state", "finished", "--database-url", db_url), 2)


def test_jobs_list_pages_with_before(db_url: str, conn: psycopg.Connection) -> None:
    # Without a cursor, a page beyond --limit could not be reached at all.
    ids = [jobd.enqueue(conn, "h") for _ in range(5)] + [make_done(conn)]
    first = ok_json("jobs", "list", "--limit", "4", "--database-url", db_url)
    assert [row["id"] for row in first] == sorted(ids, reverse=True)[:4]
    rest = ok_json("jobs", "list", "--limit", "4", "--before", str(first[-1]["id"]),
                   "--database-url", db_url)
    assert [row["id"] for row in rest] == sorted(ids, reverse=True)[4:]
    assert_one_line_error(cli("jobs", "list", "--before", "x", "--database-url", db_url), 2)


def test_listings_keep_one_row_per_line(db_url: str, conn: psycopg.Connection) -> None:
    dead = jobd.enqueue(conn, "send_email", priority=TOP, max_attempts=1)
    fail_attempts(conn, dead, [TRACEBACK])
    failing = jobd.enqueue(conn, "send_email", priority=TOP)
    fail_attempts(conn, failing, [TRACEBACK])
    jobs_text = ok("jobs", "list", "--database-url", db_url).splitlines()
    dlq_text = ok("dlq", "list", "--database-url", db_url).splitlines()
    assert len(jobs_text) == 3 and len(dlq_text) == 2
    for row in [*jobs_text[1:], *dlq_text[1:]]:
        assert row.endswith("RuntimeError: smtp refused ..."), row
    assert {int(row.split()[0]) for row in jobs_text[1:]} == {failing, dead}
    assert ok_json("dlq", "list", "--database-url", db_url)[0]["last_error"] == TRACEBACK


# Text producers control, written with terminal controls: clear the screen, retitle the
# window, overwrite the line (CR), a C1 CSI and DEL.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07X\rY\x9b31m\x7f"
HOSTILE_SHOWN = "\\x1b[2J\\x1b]0;pwned\\x07X\\rY\\x9b31m\\x7f"


def assert_no_controls(out: str) -> None:
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", out), repr(out)


def test_text_producers_control_cannot_drive_the_terminal(
    db_url: str, conn: psycopg.Connection
) -> None:
    job_id = jobd.enqueue(conn, "send_email", {"to": HOSTILE}, priority=TOP, max_attempts=1,
                          idempotency_key=f"k{HOSTILE}", fairness_key=f"f{HOSTILE}")
    error = f"ValueError: bad order {HOSTILE}\nTraceback (most recent call last):\n  {HOSTILE}"
    fail_attempts(conn, job_id, [error])
    out = ok("jobs", "show", str(job_id), "--database-url", db_url)
    assert_no_controls(out)
    fields = show_fields(out)
    assert fields["idempotency_key"] == f"k{HOSTILE_SHOWN}"
    assert fields["fairness_key"] == f"f{HOSTILE_SHOWN}"
    assert fields["last_error"] == f"ValueError: bad order {HOSTILE_SHOWN} ..."
    # The payload stays JSON, with the same value: C1 and DEL as JSON escapes.
    assert json.loads(fields["payload"]) == {"to": HOSTILE}
    assert out.splitlines()[-1].endswith(f"ValueError: bad order {HOSTILE_SHOWN} ...")
    full = ok("jobs", "show", str(job_id), "--full-errors", "--database-url", db_url)
    assert_no_controls(full)
    assert full.splitlines()[-3:] == [f"    ValueError: bad order {HOSTILE_SHOWN}",
                                      "    Traceback (most recent call last):",
                                      f"      {HOSTILE_SHOWN}"]
    for listing in (["jobs", "list"], ["dlq", "list"]):
        text = ok(*listing, "--database-url", db_url)
        assert_no_controls(text)
        assert len(text.splitlines()) == 2 and "\\x1b[2J" in text, text
    # --json is exact: JSON escapes the controls itself.
    shown = ok_json("jobs", "show", str(job_id), "--database-url", db_url)
    assert (shown["idempotency_key"], shown["payload"]) == (f"k{HOSTILE}", {"to": HOSTILE})
    assert shown["last_error"] == error


# --- dead-letter queue ---------------------------------------------------------------------


def test_dlq_list_and_replay(db_url: str, conn: psycopg.Connection) -> None:
    dead = make_dead(conn)
    listed = ok_json("dlq", "list", "--database-url", db_url)
    assert [(row["id"], row["last_error"]) for row in listed] == [(dead, "smtp refused")]
    assert str(dead) in ok("dlq", "list", "--database-url", db_url)

    out = ok("dlq", "replay", str(dead), "--database-url", db_url)
    assert str(dead) in out
    row = conn.execute("SELECT state, attempts FROM jobs WHERE id = %s", (dead,)).fetchone()
    assert row == ("pending", 0)
    assert conn.execute("SELECT count(*) FROM dead_letter").fetchone() == (0,)
    assert "empty" in ok("dlq", "list", "--database-url", db_url)


def test_replay_is_all_or_nothing(db_url: str, conn: psycopg.Connection) -> None:
    dead = make_dead(conn)
    live = jobd.enqueue(conn, "h")
    line = assert_one_line_error(
        cli("dlq", "replay", str(dead), str(live), "999999", "--database-url", db_url), 2)
    assert str(live) in line and "999999" in line
    assert conn.execute("SELECT id FROM dead_letter").fetchall() == [(dead,)]
    row = conn.execute("SELECT state FROM all_jobs WHERE id = %s", (dead,)).fetchone()
    assert row == ("dead",)


def test_dlq_purge_removes_dead_jobs_and_frees_their_keys(
    db_url: str, conn: psycopg.Connection
) -> None:
    dead = make_dead(conn, key="once")
    assert jobd.enqueue(conn, "send_email", idempotency_key="once") == dead
    assert "purged 0" in ok("dlq", "purge", "--before", "1h", "--database-url", db_url)
    data = ok_json("dlq", "purge", "--before", "0s", "--database-url", db_url)
    assert data["purged"] == 1
    assert conn.execute("SELECT count(*) FROM dead_letter").fetchone() == (0,)
    assert jobd.enqueue(conn, "send_email", idempotency_key="once") != dead


def test_dlq_purge_refuses_an_age_without_a_unit_and_names_the_cap(
    db_url: str, conn: psycopg.Connection
) -> None:
    """A bare number was taken for seconds: `--before 20240101` (ISO 8601's basic form of a
    date, without its offset) purged what died in the last 234 days but one, 2025 included,
    instead of being refused; an age beyond the cap was called "not an ISO 8601 timestamp"."""
    dead = make_dead(conn)
    conn.execute("UPDATE dead_letter SET died_at = '2025-06-01T00:00:00Z' WHERE id = %s",
                 (dead,))
    for before in ("20240101", "2024", "86400"):
        line = assert_one_line_error(
            cli("dlq", "purge", "--before", before, "--database-url", db_url), 2)
        assert f"'{before}' has no unit" in line
    line = assert_one_line_error(
        cli("dlq", "purge", "--before", "4000d", "--database-url", db_url), 2)
    assert "cannot exceed 3650d" in line
    assert conn.execute("SELECT id FROM dead_letter").fetchall() == [(dead,)]
    assert ok_json("dlq", "purge", "--before", "2024-01-01T00:00:00Z",
                   "--database-url", db_url)["purged"] == 0
    assert ok_json("dlq", "purge", "--before", "1d", "--database-url", db_url)["purged"] == 1


# --- options and help ----------------------------------------------------------------------


def test_version() -> None:
    assert ok("--version") == f"jobd {metadata.version('jobd')}\n"
    assert json.loads(ok("--json", "--version")) == {"version": metadata.version("jobd")}


def _parsers(parser: argparse.ArgumentParser, path: str = "jobd"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_has_help_that_states_its_default() -> None:
    problems = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = f"{path} {action.dest}"
            if isinstance(action, argparse._SubParsersAction):
                # Its choices are listed with their own help.
                problems += [f"{path} {choice.dest}" for choice in action._choices_actions
                             if not choice.help]
                continue
            if not action.help:
                problems.append(f"{name}: no help")
            elif (action.option_strings and not action.required
                  and action.dest != "version"  # prints, and exits
                  and "default" not in action.help):
                # An option left out does something too (None included: "any", "now"):
                # the README promises that --help says what.
                problems.append(f"{name}: the help does not state the default")
    assert problems == []

HELP_COMMANDS = [
    [], ["migrate"], ["enqueue"], ["status"], ["top"], ["jobs"], ["jobs", "show"],
    ["jobs", "list"], ["jobs", "cancel"], ["dlq"], ["dlq", "list"], ["dlq", "replay"],
    ["dlq", "purge"], ["dlq", "quarantine"], ["lanes"], ["lanes", "pause"],
    ["lanes", "resume"], ["schedules", "list"], ["schedules", "next"], ["run"],
]


def test_every_subcommand_has_help() -> None:
    processes = [
        subprocess.Popen([sys.executable, "-m", "jobd", *command, "--help"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env())
        for command in HELP_COMMANDS
    ]
    for command, process in zip(HELP_COMMANDS, processes, strict=True):
        out, err = process.communicate(timeout=TIMEOUT)
        assert (command, process.returncode, err) == (command, 0, "")
        assert out.startswith("usage: jobd")
        # Each explains itself and how it connects, not only its parent's list.
        assert "exit codes:" in out, command


def test_every_command_and_action_describes_itself() -> None:
    assert [path for path, parser in _parsers(build_parser()) if not parser.description] == []


def test_missing_subcommand_is_a_usage_error() -> None:
    assert_one_line_error(cli(), 2)
    assert_one_line_error(cli("dlq"), 2)


def test_options_work_before_and_after_the_subcommand(
    db_url: str, conn: psycopg.Connection
) -> None:
    jobd.enqueue(conn, "h", lane="mail")
    outputs = [
        ok("--database-url", db_url, "--json", "status"),
        ok("status", "--database-url", db_url, "--json"),
        ok("--json", "status", "--database-url", db_url),
        ok("--database-url", UNREACHABLE, "status", "--database-url", db_url, "--json"),
        ok("-c", EXAMPLE, "status", "--json", "--database-url", db_url),
    ]
    lanes = [[s["lane"] for s in json.loads(out)["lanes"]] for out in outputs]
    assert lanes[:4] == [["mail"]] * 4
    assert lanes[4] == ["critical", "default", "mail", "outbox"]
    shown = ok("jobs", "--database-url", db_url, "list", "--json")
    assert [row["lane"] for row in json.loads(shown)] == ["mail"]


def test_database_url_from_the_environment(db_url: str, conn: psycopg.Connection) -> None:
    result = cli("enqueue", "h", env=clean_env(JOBD_DATABASE_URL=db_url))
    assert result.returncode == 0, result.stderr
    assert conn.execute("SELECT id FROM jobs").fetchall() == [(int(result.stdout),)]


def test_run_prints_no_data_so_json_is_a_usage_error() -> None:
    """`jobd run` is the daemon: --json did nothing there, yet its help offered it."""
    assert "--json" not in ok("run", "--help")
    base = ["-c", EXAMPLE, "--database-url", UNREACHABLE]
    for args in (["run", *base, "--json"], ["--json", "run", *base]):
        line = assert_one_line_error(cli(*args), 2)
        assert line == "jobd run: unrecognized arguments: --json (see jobd run --help)", args
    # Without it, the same command is the daemon, which finds no database there (exit 1).
    assert_one_line_error(cli("run", *base), 1)


def test_every_command_but_run_offers_json() -> None:
    offering = {path: any("--json" in action.option_strings for action in parser._actions)
                for path, parser in _parsers(build_parser())}
    assert [path for path, offers in offering.items() if not offers] == ["jobd run"]
