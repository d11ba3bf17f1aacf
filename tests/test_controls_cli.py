"""The lane controls' commands (`jobd lanes`, `jobd jobs cancel`, `jobd dlq quarantine`,
`jobd dlq replay --handler`) run as subprocesses against a real database: their output,
text and --json, and their refusals (exit code 2, one line)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cli_support import assert_one_line_error, clean_env, cli, ok
from readme_support import ROOT, section, shell_blocks

import jobd
from jobd import pauses, queue

EXAMPLE = str(Path(__file__).resolve().parent.parent / "config" / "jobd.example.yaml")
JOBD = Path(sys.executable).parent / "jobd"


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json"))


def test_pause_and_resume_print_what_changed(db_url: str, conn: psycopg.Connection) -> None:
    text = ok("lanes", "pause", "default", "--database-url", db_url)
    assert text.startswith("paused lane default: no node starts its jobs until "
                           "`jobd lanes resume default`")
    assert "was paused already (since " in ok("lanes", "pause", "default",
                                              "--database-url", db_url)
    shown = ok_json("lanes", "pause", "default", "--handler", "send_email",
                    "--database-url", db_url)
    assert (shown["changed"], [(p["lane"], p["handler"]) for p in shown["pauses"]]) == (
        True, [("default", None), ("default", "send_email")])
    text = ok("lanes", "resume", "default", "--database-url", db_url)
    assert text.splitlines() == ["resumed lane default",
                                 "still paused in lane default: handler send_email"]
    assert ok_json("lanes", "resume", "default", "--database-url", db_url)["changed"] is False
    assert pauses.lane_controls(conn, "default") == (False, frozenset({"send_email"}))


def test_a_pause_without_a_config_of_a_lane_nothing_knows_says_so(
    db_url: str, conn: psycopg.Connection
) -> None:
    """Without a config nothing checks the lane's name: a typo during an incident paused a
    lane no node runs, said "paused", and the lane meant kept running. The pause is still
    made (a lane may be paused before its first node starts), with a note on stderr."""
    typo = cli("lanes", "pause", "defualt", "--database-url", db_url)
    assert typo.returncode == 0, typo.stderr
    assert typo.stdout.startswith("paused lane defualt")
    assert typo.stderr.startswith("note: no node runs lane 'defualt' and it has no jobs or "
                                  "schedules: is the name right?"), typo.stderr
    assert ok_json("lanes", "pause", "defualt", "--database-url", db_url)["lane_known"] is False
    assert pauses.pauses(conn, "defualt") != []
    # A lane with jobs, one a node runs and one a schedule feeds are known.
    jobd.enqueue(conn, "h", lane="busy")
    conn.execute("INSERT INTO jobd.nodes (instance, node, pid, lane_settings)"
                 " VALUES ('i-1', 'n-1', 1, '{\"served\": {}}')")
    conn.execute("INSERT INTO jobd.schedules (id, cron, handler, lane)"
                 " VALUES ('nightly', '0 3 * * *', 'h', 'scheduled')")
    for lane in ("busy", "served", "scheduled"):
        known = cli("lanes", "pause", lane, "--database-url", db_url)
        assert (known.returncode, known.stderr) == (0, ""), lane


def test_a_pause_outside_the_config_can_be_lifted_with_it(db_url: str,
                                                           conn: psycopg.Connection) -> None:
    """A lane paused without a config, or since removed from it: `resume -c` lifts it (the
    config's names tell a typo only from a lane that is not paused)."""
    pauses.pause(conn, "retired", "zzz")
    text = ok("lanes", "resume", "retired", "--handler", "zzz", "-c", EXAMPLE,
              "--database-url", db_url)
    assert text.splitlines() == ["resumed handler zzz in lane retired"]
    assert pauses.pauses(conn, "retired") == []
    line = assert_one_line_error(cli("lanes", "resume", "retired", "-c", EXAMPLE,
                                     "--database-url", db_url), 2)
    assert "unknown lane 'retired'" in line


def test_jobs_of_a_handler_no_config_has_can_be_quarantined_with_one(
        db_url: str, conn: psycopg.Connection) -> None:
    # A producer's typo: no node has the handler, its jobs stay pending, and the operations
    # guide says to quarantine them. With a config, the name check refused it.
    typo = jobd.enqueue(conn, "resize_imgae")
    moved = ok_json("dlq", "quarantine", "--handler", "resize_imgae", "--lane", "default",
                    "-c", EXAMPLE, "--database-url", db_url)
    assert (moved["quarantined"], moved["by_lane"]) == (1, {"default": 1})
    assert [row["id"] for row in ok_json("dlq", "list", "--database-url", db_url)] == [typo]
    # Nothing to move: the config's names tell the typo.
    line = assert_one_line_error(cli("dlq", "quarantine", "--handler", "resize_imgae", "-c",
                                     EXAMPLE, "--database-url", db_url), 2)
    assert "unknown handler 'resize_imgae'" in line


def test_what_quarantine_moved_with_a_config_replay_brings_back_with_it(
        db_url: str, conn: psycopg.Connection) -> None:
    # Quarantine with -c takes a handler the config lacks and prints the replay command to
    # undo it; that command, with the same config, refused the handler as unknown.
    typo = jobd.enqueue(conn, "resize_imgae")
    ok("dlq", "quarantine", "--handler", "resize_imgae", "-c", EXAMPLE, "--database-url", db_url)
    replayed = ok_json("dlq", "replay", "--handler", "resize_imgae", "--lane", "default",
                       "-c", EXAMPLE, "--database-url", db_url)
    assert replayed == {"replayed": [typo]}
    row = conn.execute("SELECT state, attempts FROM jobs WHERE id = %s", (typo,)).fetchone()
    assert row == ("pending", 0)
    # Nothing to replay: the config's names tell the typo, of a handler or of a lane.
    line = assert_one_line_error(cli("dlq", "replay", "--handler", "resize_imgae", "-c",
                                     EXAMPLE, "--database-url", db_url), 2)
    assert "unknown handler 'resize_imgae'" in line
    line = assert_one_line_error(cli("dlq", "replay", "--handler", "echo", "--lane", "defualt",
                                     "-c", EXAMPLE, "--database-url", db_url), 2)
    assert "unknown lane 'defualt'" in line
    line = assert_one_line_error(cli("dlq", "replay", "--handler", "a/b", "-c", EXAMPLE,
                                     "--database-url", db_url), 2)
    assert "invalid handler name 'a/b'" in line


def test_status_lists_the_pauses(db_url: str, conn: psycopg.Connection) -> None:
    pauses.pause(conn, "reports")
    pauses.pause(conn, "default", "fail")
    text = ok("status", "-c", EXAMPLE, "--database-url", db_url)
    assert "paused (on every node, until `jobd lanes resume`):" in text
    assert "  lane reports: the whole lane, since " in text
    assert "  lane default: handler fail, since " in text
    lanes = {s["lane"]: s for s in ok_json("status", "-c", EXAMPLE, "--database-url", db_url)
             ["lanes"]}
    assert (lanes["reports"]["paused"], lanes["default"]["paused_handlers"]) == (True, ["fail"])
    assert (lanes["critical"]["paused"], lanes["critical"]["paused_handlers"]) == (False, [])


@pytest.mark.parametrize(("args", "expected"), [
    (["lanes", "pause", "nope"], "unknown lane 'nope'; the config has: critical, default"),
    (["lanes", "resume", "default", "--handler", "ecko"], "unknown handler 'ecko'"),
    (["dlq", "quarantine", "--handler", "ecko"], "unknown handler 'ecko'"),
    (["dlq", "replay", "--handler", "echo", "--lane", "nope"], "unknown lane 'nope'"),
])
def test_with_a_config_unknown_lanes_and_handlers_are_refused(
    db_url: str, args: list[str], expected: str
) -> None:
    line = assert_one_line_error(cli(*args, "-c", EXAMPLE, "--database-url", db_url), 2)
    assert expected in line


@pytest.mark.parametrize(("args", "expected"), [
    (["lanes", "pause", "a lane"], "invalid lane name 'a lane'"),
    (["lanes", "pause", "default", "--handler", "x/y"], "invalid handler name 'x/y'"),
    (["dlq", "quarantine", "--handler", "h", "--where", "nokey"], "expected KEY=VALUE"),
    (["dlq", "quarantine", "--handler", "h", "--where", "a=1", "--where", "a=2"],
     "--where a: given twice"),
    (["dlq", "replay"], "give the ids of dead jobs, or --handler H"),
    (["dlq", "replay", "1", "--handler", "h"], "not both"),
    (["dlq", "replay", "1", "--lane", "l"], "--lane goes with --handler"),
    (["jobs", "cancel"], "the following arguments are required: ID"),
])
def test_malformed_controls_are_refused(db_url: str, args: list[str], expected: str) -> None:
    line = assert_one_line_error(cli(*args, "--database-url", db_url), 2)
    assert expected in line


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "[NaN]"])
def test_quarantine_takes_a_value_that_is_not_json_as_text(
    db_url: str, conn: psycopg.Connection, value: str
) -> None:
    """Python's json reads NaN and Infinity; JSON has no such words, so --where takes them
    as text, as it does any value that is not JSON."""
    matched = jobd.enqueue(conn, "h", {"status": value})
    jobd.enqueue(conn, "h", {"status": "ok"})
    moved = ok_json("dlq", "quarantine", "--handler", "h", "--where", f"status={value}",
                    "--database-url", db_url)
    assert (moved["where"], moved["quarantined"]) == ({"status": value}, 1)
    assert [row["id"] for row in ok_json("dlq", "list", "--database-url", db_url)] == [matched]


def test_cancel_reports_each_job_and_refuses_unknown_ids_entirely(
    db_url: str, conn: psycopg.Connection
) -> None:
    later, running, done = (jobd.enqueue(conn, "h", delay=d) for d in (60, 0, 0))
    jobs = {job.id: job for job in queue.claim(conn, "default", "w", 10, 30)}
    queue.complete(conn, [jobs[done].lease])
    line = assert_one_line_error(cli("jobs", "cancel", str(later), "424242",
                                     "--database-url", db_url), 2)
    assert line == "jobd: no job 424242 (live, finished or dead); nothing cancelled"
    assert conn.execute("SELECT state FROM jobs WHERE id = %s", (later,)).fetchone() == (
        "pending",)
    text = ok("jobs", "cancel", str(later), str(running), str(done), "--database-url", db_url)
    assert text.splitlines() == [
        f"cancelled 1 job(s): {later}",
        f"asked 1 running job(s) to stop: {running} (recorded cancelled when their run ends)",
        f"finished already, left as they are: {done} (done)"]
    again = ok_json("jobs", "cancel", str(later), "--database-url", db_url)
    assert again == {"cancelled": [], "requested": [],
                     "finished": [{"id": later, "state": "cancelled"}]}
    shown = ok("jobs", "show", str(later), "--database-url", db_url)
    assert "state: cancelled" in shown and "  cancelled at " in shown
    assert "cancel_requested_at" not in shown  # not kept in the archive: no misleading '-'
    listed = ok_json("jobs", "list", "--state", "cancelled", "--database-url", db_url)
    assert [row["id"] for row in listed] == [later]
    asked = ok_json("jobs", "show", str(running), "--database-url", db_url)
    assert (asked["state"], asked["cancel_requested_at"] is not None) == ("claimed", True)


def test_quarantine_matches_payload_fields_and_replay_brings_them_back(
    db_url: str, conn: psycopg.Connection
) -> None:
    bad = [jobd.enqueue(conn, "echo", {"customer": 7, "email": "a@example.com", "code": "42"})
           for _ in range(3)]
    spared = [jobd.enqueue(conn, "echo", {"customer": 7, "email": "a@example.com", "code": 42}),
              jobd.enqueue(conn, "echo", {"customer": 8}, lane="critical")]
    moved = ok_json("dlq", "quarantine", "--handler", "echo", "--where", "customer=7",
                    "--where", "email=a@example.com", "--where", 'code="42"',
                    "-c", EXAMPLE, "--database-url", db_url)
    assert moved == {"handler": "echo", "lane": None,
                     "where": {"customer": 7, "email": "a@example.com", "code": "42"},
                     "quarantined": 3, "by_lane": {"default": 3}}
    dead = ok_json("dlq", "list", "--database-url", db_url)
    assert sorted(row["id"] for row in dead) == bad
    shown = ok("jobs", "show", str(bad[0]), "--database-url", db_url)
    assert "  quarantined at " in shown
    text = ok("dlq", "quarantine", "--handler", "echo", "--lane", "critical",
              "--database-url", db_url)
    assert text.splitlines()[0] == ("quarantined 1 job(s) of handler echo in lane critical "
                                    "into the dead-letter queue: critical 1")
    assert ok("dlq", "quarantine", "--handler", "echo", "--lane", "critical",
              "--database-url", db_url) == (
        "no pending or failed job of handler echo in lane critical; nothing quarantined\n")
    replayed = ok_json("dlq", "replay", "--handler", "echo", "--lane", "default",
                       "--database-url", db_url)
    assert sorted(replayed["replayed"]) == bad
    assert ok("dlq", "replay", "--handler", "echo", "--database-url", db_url) == (
        f"replayed 1 job(s): {spared[1]}\n")
    assert ok("dlq", "replay", "--handler", "echo", "--database-url", db_url) == (
        "no dead job of handler echo; nothing replayed\n")


def test_the_readmes_incident_steps_run_as_written(db_url: str) -> None:
    [block] = shell_blocks(section("During an incident: pause, cancel, quarantine"))
    script = block.replace(".venv/bin/jobd", shlex.quote(str(JOBD)))
    result = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=clean_env(JOBD_DATABASE_URL=db_url, JOBD_CONFIG="config/jobd.example.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("paused handler order in lane default")
    assert any(line.startswith("quarantined 1 job(s) of handler order") for line in lines)
    assert "resumed handler order in lane default" in lines
    assert any(line.startswith("cancelled 1 job(s): ") for line in lines)
    assert lines[-1].startswith("replayed 1 job(s): ")
