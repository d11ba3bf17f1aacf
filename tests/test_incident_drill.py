"""The incident drill (bench/incident.py) at a tiny scale: its clock jump, and one whole run.

The drill itself is a benchmark (minutes, tens of thousands of jobs); these check that its
building blocks do what the drill relies on: the database server's clock moves under
libfaketime while connections stay open, delayed jobs become due by it, and one command
runs the incident end to end, with the poison dead-lettered, the alerts recorded from a real
Prometheus, every herd job done, and the timeline and chart written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from daemon_support import wait_until

import jobd
from jobd.localpg import LocalPgError, find_bindir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the drill lives in bench/, outside the installed package

from bench.incident_prom import available as prometheus_available  # noqa: E402
from bench.incident_run import (  # noqa: E402
    HERD,
    JUMP,
    LIBFAKETIME,
    clock_cluster,
    create_database,
    db_offset,
    enqueue_herd,
)

pytestmark = [
    pytest.mark.skipif(not LIBFAKETIME.exists(),
                       reason="needs libfaketime (Debian package faketime)"),
]


def _server_binaries() -> None:
    try:
        find_bindir()
    except LocalPgError:
        pytest.skip("needs the PostgreSQL server binaries (Debian package postgresql)")


# The server's processes read the clock's offset file at most a second late
# (FAKETIME_CACHE_DURATION in bench/incident_run.py): a bound for seeing a jump, not a pause.
JUMP_SEEN_S = 5.0


def _due(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM jobd.jobs WHERE handler = %s AND run_at <= now()",
                       (HERD,)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_server_clock_jumps_and_the_delayed_jobs_become_due() -> None:
    _server_binaries()
    with clock_cluster(keep=False) as (cluster, clock):
        _admin, url = create_database(cluster)
        assert abs(db_offset(url)) < 5
        enqueue_herd(url, 50)
        with psycopg.connect(url, autocommit=True) as conn:  # open across the jump
            assert _due(conn) == 0
            clock.set("+1h")
            jumped = JUMP.total_seconds()
            wait_until(lambda: abs(db_offset(url) - jumped) < 5, JUMP_SEEN_S,
                       message="a new connection to see the jump")
            wait_until(lambda: _due(conn) == 50, JUMP_SEEN_S,
                       message=lambda: f"the herd due, not {_due(conn)}")
            # An ordinary enqueue now is due at the new time: the herd is ahead of it.
            new_id = jobd.enqueue(conn, "email", {})
            row = conn.execute("SELECT count(*) FROM jobd.jobs WHERE handler = %s AND "
                               "run_at < (SELECT run_at FROM jobd.jobs WHERE id = %s)",
                               (HERD, new_id)).fetchone()
            assert row is not None and row[0] == 50
            clock.set("+0")
            wait_until(lambda: _due(conn) == 0, JUMP_SEEN_S,
                       message=lambda: f"no herd job due, not {_due(conn)}")


def test_one_command_runs_the_incident_and_writes_its_timeline(tmp_path: Path) -> None:
    _server_binaries()
    if not prometheus_available():
        pytest.skip("needs prometheus (Debian package prometheus)")
    pytest.importorskip("matplotlib", reason="needs matplotlib (pip install -e '.[test]')")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "incident.py"), "--fairness", "off",
         "--herd", "300", "--baseline", "10", "--tail", "2", "--mitigate-by", "45",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "timeline.json").read_text())
    summary = record["summary"]
    # The poison killed workers and crash attribution dead-lettered it on its own.
    assert summary["crashes"] >= record["settings"]["max_attempts"]
    assert record["poison"]["dead_by_crashes"], record["poison"]
    settings = record["settings"]
    for job in record["poison"]["dead_by_crashes"]:
        # Each crash it caused alone spent an attempt; one among other jobs gave it back. Its
        # max_crashes-th crash alone dead-letters it, attempts left or not.
        assert job["attempts"] == min(settings["max_attempts"], settings["max_crashes"])
        assert job["crashes"] >= job["attempts"]
    # Prometheus saw the DLQ grow, and the mitigation ran on that alert.
    assert summary["alerts_firing_s"].get("JobdDeadLetterQueueGrowing") is not None
    assert record["notes"]["mitigation_trigger"] == "JobdDeadLetterQueueGrowing firing"
    assert [m["command"].split()[1:3] for m in record["mitigation"]] == [
        ["lanes", "pause"], ["dlq", "quarantine"]]
    # Every herd job ran once and nothing of the steady traffic was lost.
    archived = {(r["handler"], r["state"]): r["jobs"]
                for r in record["completeness"]["archived"]}
    assert archived[(HERD, "done")] == 300
    assert summary["herd_drain_s"] is not None and not summary["drain_timed_out"]
    for handler, sent in record["completeness"]["steady_sent"].items():
        assert archived[(handler, "done")] == sent, handler
    # The timeline is in order and names the cause; the series came from Prometheus.
    times = [item["t_s"] for item in record["timeline"]]
    assert times == sorted(times)
    assert any(item["event"].startswith("cause:") for item in record["timeline"])
    assert any(series["values"] for series in record["series"]["dlq_depth"])
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Timeline" in (out / "timeline.md").read_text()
