"""`jobd top`: rendering without I/O, the snapshot read from a real database, the latency
query's bounds and plan, and the plain snapshot through the real command line."""

from __future__ import annotations

import json
import os
import pty
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from cli_support import assert_one_line_error, clean_env, cli, ok
from daemon_support import db_now, enqueued_when_due
from psycopg import sql
from psycopg.types.json import Jsonb

import jobd
from jobd import cli_output, queue, top, top_screen, views
from jobd.config import Config, parse
from jobd.db import connect
from jobd.queries import query

if TYPE_CHECKING:
    from conftest import Databases

AT = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


def lane(name: str, *, due: int = 0, scheduled: int = 0, claimed: int = 0, retrying: int = 0,
         dead: int = 0, oldest: float = 0.0, slo: float | None = None, workers: int = 1,
         rates: dict[str, float] | None = None,
         latency: views.LaneLatency | None = None) -> top.LaneRow:
    status = views.LaneStatus(name, due + scheduled, claimed, retrying, dead, oldest, due,
                              scheduled, retrying)
    return top.LaneRow(status, latency, rates, workers, slo)


def snapshot(*lanes: top.LaneRow, nodes: tuple[top.NodeRow, ...] = ()) -> top.Snapshot:
    return top.Snapshot(AT, lanes, nodes)


def row_of(lines: list[top.Line], name: str) -> top.Line:
    [found] = [line for line in lines if line.text.split()[:1] == [name]]
    return found


# --- formatting and rendering, no database -------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0.0004, "400us"), (0.012, "12ms"), (0.9994, "999ms"), (4.24, "4.2s"),
     (192, "3m12s"), (7500, "2h05m"), (3 * 86400 + 4 * 3600 + 5, "3d04h")],
)
def test_durations_fit_a_column(value: float | None, text: str) -> None:
    assert cli_output.seconds(value) == text


def test_a_lane_over_its_slo_is_highlighted_and_marked() -> None:
    shot = snapshot(lane("slow", due=3, oldest=42.0, slo=5.0),
                    lane("fast", due=3, oldest=2.0, slo=5.0),
                    lane("plain", due=3, oldest=42.0))
    for lines in (top.render(shot, 160, 40, interval=1.0), top.lane_table(shot)):
        assert row_of(lines, "slow").style == "alert"
        assert "OVER SLO" in row_of(lines, "slow").text
        for other in ("fast", "plain"):
            assert row_of(lines, other).style == "normal"
            assert "OVER SLO" not in row_of(lines, other).text


def test_a_lane_with_due_work_and_no_worker_is_flagged() -> None:
    shot = snapshot(lane("orphan", due=2, workers=0), lane("idle", workers=0),
                    lane("served", due=2, workers=3))
    lines = top.lane_table(shot)
    assert row_of(lines, "orphan").style == "warn"
    assert row_of(lines, "orphan").text.endswith("no worker")
    assert [row_of(lines, n).style for n in ("idle", "served")] == ["normal", "normal"]


def test_figures_sit_under_their_headers() -> None:
    latency = views.LaneLatency("default", 10, 0.012, 0.25, 0.003, 1.5)
    shot = snapshot(lane("default", due=12, scheduled=3, claimed=4, retrying=1, dead=7,
                         oldest=4.2, slo=5.0, workers=2, latency=latency,
                         rates={"claimed": 120.0, "completed": 118.5, "failed": 1.0,
                                "dead": 0.5}),
                    lane("a-much-longer-lane-name", due=1))
    header, default = top.lane_table(shot)[0], row_of(top.lane_table(shot), "default")
    expected = {"DEPTH": "20", "DUE": "12", "SCHED": "3", "CLAIMED": "4", "RETRY": "1",
                "OLDEST": "4.2s", "SLO": "5.0s", "DLQ": "7", "CLAIM/s": "120.0",
                "DONE/s": "118.5", "FAIL/s": "1.5", "RUN p50": "12ms", "RUN p99": "250ms",
                "PICK p50": "3ms", "PICK p99": "1.5s", "WORKERS": "2"}
    for column, value in expected.items():
        # Right-aligned: the value ends where its header ends.
        end = header.text.index(column) + len(column)
        assert default.text[end - len(value):end] == value, column
        assert default.text[end:end + 1] in ("", " "), column


def test_unknown_figures_show_as_dashes() -> None:
    # No rates before two heartbeats, no percentiles without finished jobs, no oldest age
    # without due jobs, no SLO when the lane declares none.
    text = row_of(top.lane_table(snapshot(lane("quiet", scheduled=4))), "quiet").text
    assert text.split()[1:] == ["4", "0", "4", "0", "0", "-", "-", "0", "-", "-", "-", "-",
                                "-", "-", "-", "1"]


def test_the_screen_is_never_overfilled() -> None:
    many = tuple(lane(f"lane-{i:02d}", due=i) for i in range(30))
    nodes = tuple(top.NodeRow(f"web-{i}", f"web-{i}:1", 100 + i, {"lane-00": 2}, 1.5)
                  for i in range(5))
    shot = top.Snapshot(AT, many, nodes)
    for width, height in [(160, 40), (80, 12), (40, 6), (20, 3), (160, 1)]:
        lines = top.render(shot, width, height, interval=1.0, note="database error: gone")
        assert len(lines) <= height
        assert all(len(line.text) <= width for line in lines)
    lines = top.render(shot, 160, 20, interval=1.0)
    more = [line.text for line in lines if "more lanes" in line.text]
    shown = [line for line in lines if line.text.startswith("lane-")]
    assert more == [f"... {len(many) - len(shown)} more lanes (enlarge the window)"]
    assert lines[2].style == "header"  # the lanes' header is kept
    assert any(line.text.startswith("NODE") for line in lines)


def test_everything_fits_a_large_screen() -> None:
    nodes = (top.NodeRow("web-1", "web-1:1", 4242, {"default": 2, "critical": 1}, 3.0),)
    shot = top.Snapshot(AT, (lane("critical"), lane("default")), nodes)
    texts = [line.text for line in top.render(shot, 160, 40, interval=1.0)]
    assert texts[0].startswith("jobd top  2026-06-01 12:00:00Z")
    assert texts[0].endswith("every 1.0s  q quits")
    assert [t.split()[0] for t in texts if t.startswith(("critical", "default"))] == [
        "critical", "default"]
    node_line = next(t for t in texts if t.startswith("web-1"))
    assert node_line.split() == ["web-1", "4242", "3.0s", "ago", "critical", "1,", "default",
                                 "2"]
    assert "more" not in " ".join(texts)


def test_an_error_note_shows_under_the_title() -> None:
    lines = top.render(snapshot(lane("default")), 160, 40, interval=2.0,
                       note="database error: connection refused")
    assert lines[1] == top.Line("database error: connection refused", "error")


def test_the_plain_snapshot_has_every_lane_and_node_and_no_keys() -> None:
    nodes = tuple(top.NodeRow(f"web-{i}", f"web-{i}:1", i, {"default": 1}, 0.5)
                  for i in range(50))
    shot = top.Snapshot(AT, tuple(lane(f"lane-{i:02d}") for i in range(50)), nodes)
    text = top.plain(shot)
    assert "q quits" not in text and "more lanes" not in text
    rows = [line.split()[0] for line in text.splitlines() if line]
    assert [r for r in rows if r.startswith("lane-")] == [f"lane-{i:02d}" for i in range(50)]
    assert [r for r in rows if r.startswith("web-")] == [f"web-{i}" for i in range(50)]


# --- the snapshot from the database --------------------------------------------------------


def finish(conn: psycopg.Connection, lane_name: str, run_at: datetime, claimed_at: datetime,
           finished_at: datetime) -> None:
    """One job through the real claim and completion, at the given database instants (it
    was enqueued when it fell due: a job enqueued due in the past waits from its enqueue)."""
    job_id = jobd.enqueue(conn, "h", lane=lane_name, run_at=run_at)
    conn.execute("UPDATE jobd.jobs SET created_at = run_at WHERE id = %s", [job_id])
    [job] = queue.claim(conn, lane_name, "node-1:1", 1, 3600, now=claimed_at)
    assert queue.complete(conn, [job.lease], now=finished_at).applied == [job.id]


def inclusive(values: list[float], q: float) -> float:
    """percentile_cont's linear interpolation between the closest ranks."""
    cut = statistics.quantiles(values, n=100, method="inclusive")
    return cut[round(q * 100) - 1]


def test_claim_time_travels_into_the_archive(conn: psycopg.Connection) -> None:
    start = db_now(conn)
    finish(conn, "default", start - timedelta(seconds=3), start, start + timedelta(seconds=2))
    row = conn.execute("SELECT run_at, claimed_at, finished_at FROM jobs_archive").fetchone()
    assert row == (start - timedelta(seconds=3), start, start + timedelta(seconds=2))


def test_percentiles_over_the_window_of_finished_jobs(conn: psycopg.Connection) -> None:
    start = db_now(conn) - timedelta(minutes=10)
    runs, pickups = [], []
    for i in range(40):
        pickup, run = 0.05 * (i % 7), 0.01 * (i % 13) + 0.002 * i
        claimed = start + timedelta(seconds=i)
        finish(conn, "default", claimed - timedelta(seconds=pickup), claimed,
               claimed + timedelta(seconds=run))
        runs.append(run)
        pickups.append(pickup)
    # Outside the window: finished long before its start, or in another lane.
    finish(conn, "default", start - timedelta(hours=2), start - timedelta(hours=2),
           start - timedelta(hours=1))
    finish(conn, "other", start, start + timedelta(seconds=1), start + timedelta(seconds=30))
    window_end = start + timedelta(seconds=60)

    latency = views.lane_latency(conn, ["default", "other", "empty"], 120.0, 1000, window_end)
    default = latency["default"]
    assert default.finished == len(runs)
    assert default.run_p50 == pytest.approx(inclusive(runs, 0.5), abs=1e-6)
    assert default.run_p99 == pytest.approx(inclusive(runs, 0.99), abs=1e-6)
    assert default.pickup_p50 == pytest.approx(inclusive(pickups, 0.5), abs=1e-6)
    assert default.pickup_p99 == pytest.approx(inclusive(pickups, 0.99), abs=1e-6)
    assert latency["other"].finished == 1
    assert latency["empty"] == views.LaneLatency("empty", 0, None, None, None, None)

    # The sample: only the newest jobs count.
    newest = views.lane_latency(conn, ["default"], 120.0, 10, window_end)["default"]
    assert newest.finished == 10
    assert newest.run_p99 == pytest.approx(inclusive(runs[-10:], 0.99), abs=1e-6)
    # The window: the last 30 s before window_end hold the jobs finished after start + 30 s.
    recent = sum(1 for i, run in enumerate(runs) if i + run > 30)
    assert 0 < recent < len(runs)
    assert views.lane_latency(conn, ["default"], 30.0, 1000, window_end)[
        "default"].finished == recent


def test_jobs_without_a_claim_time_count_in_no_percentile(conn: psycopg.Connection) -> None:
    start = db_now(conn)
    # A job archived before migration 0010, which had no claimed_at.
    conn.execute("""INSERT INTO jobs_archive (id, lane, handler, payload, state, priority,
                        run_at, attempts, created_at, errors, finished_at)
                    VALUES (nextval('job_id_seq'), 'default', 'h', '{}', 'done', 0, %(at)s, 1,
                            %(at)s, '[]', %(at)s)""", {"at": start})
    before = views.lane_latency(conn, ["default"], 60.0, 100, start)["default"]
    assert (before.finished, before.run_p50, before.pickup_p99) == (1, None, None)
    finish(conn, "default", start, start, start + timedelta(seconds=1))
    after = views.lane_latency(conn, ["default"], 60.0, 100, start + timedelta(seconds=1))
    assert (after["default"].run_p50, after["default"].pickup_p50) == (1.0, 0.0)


def report_node(conn: psycopg.Connection, instance: str, workers: dict[str, int],
                counters: dict[str, dict[str, int]]) -> None:
    conn.execute(query("node_heartbeat"), {"instance": instance, "node": "web-1", "pid": 4242,
                                           "workers": Jsonb(workers), "counters": Jsonb(counters),
                                           "interval": 10.0, "listening": True,
                                           "archive_retention": None, "lane_settings": None})


def test_collect_reads_depth_by_state_rates_and_nodes(conn: psycopg.Connection) -> None:
    now = db_now(conn)
    for _ in range(3):
        jobd.enqueue(conn, "h", lane="default", run_at=now - timedelta(seconds=30))
    for _ in range(2):
        jobd.enqueue(conn, "h", lane="default", run_at=now + timedelta(hours=1))
    enqueued_when_due(conn)
    jobd.enqueue(conn, "h", lane="mail", priority=5)
    jobd.enqueue(conn, "h", lane="mail")
    assert len(queue.claim(conn, "mail", "node-1:1", 1, 30)) == 1
    [failing] = queue.claim(conn, "mail", "node-1:1", 1, 30)
    assert queue.fail(conn, [queue.Failure(failing.lease, "x", 600, 8)]).retried == [failing.id]
    report_node(conn, "web-1:1", {"default": 2}, {"default": {"claimed": 10, "completed": 8}})
    report_node(conn, "web-1:1", {"default": 2}, {"default": {"claimed": 50, "completed": 28,
                                                              "failed": 2}})
    config = parse("lanes:\n  default: {slo: {pickup: 5s}}\n  critical: {}\n")

    shot = top.collect(conn, config)
    rows = {row.status.lane: row for row in shot.lanes}
    assert list(rows) == ["critical", "default", "mail"]
    counts = {name: (r.status.depth, r.status.due, r.status.scheduled, r.status.claimed,
                     r.status.retrying) for name, r in rows.items()}
    assert counts == {"critical": (0, 0, 0, 0, 0), "default": (5, 3, 2, 0, 0),
                      "mail": (2, 0, 0, 1, 1)}
    assert rows["default"].over_slo is True and rows["mail"].over_slo is None
    assert rows["default"].status.oldest_unclaimed_age >= 30
    assert (rows["default"].workers, rows["mail"].workers) == (2, 0)
    claim_rate, done_rate = rows["default"].rate("claimed"), rows["default"].rate("completed")
    assert claim_rate is not None and done_rate is not None
    assert claim_rate / done_rate == pytest.approx((50 - 10) / (28 - 8))
    assert rows["mail"].rates is None
    [node] = shot.nodes
    assert (node.node, node.pid, node.workers) == ("web-1", 4242, {"default": 2})
    assert 0 <= node.seen_ago < 60
    data = shot.as_dict()
    assert json.loads(json.dumps(data, default=str))["lanes"][1]["over_slo"] is True


# --- the latency query's plan on a large archive -------------------------------------------

ARCHIVED = 300_000


@pytest.fixture(scope="module")
def big_archive(databases: Databases) -> Iterator[tuple[psycopg.Connection, datetime]]:
    url = databases.migrated()
    with connect(url) as conn:
        # Three lanes finishing jobs over the hour before `end`, one every 12 ms.
        end = db_now(conn)
        conn.execute(
            """INSERT INTO jobs_archive (id, lane, handler, payload, state, priority, run_at,
                                         attempts, created_at, errors, finished_at, claimed_at)
               SELECT i, (ARRAY['default', 'bulk', 'reports'])[1 + i %% 3], 'h', '{}', 'done',
                      0, t - interval '20 ms', 1, t - interval '1 s', '[]', t,
                      t - interval '10 ms'
                 FROM generate_series(1, %(n)s) AS i,
                      LATERAL (SELECT %(end)s - make_interval(secs => 3600.0 * i / %(n)s)) AS s(t)
            """, {"n": ARCHIVED, "end": end})
        conn.execute("ANALYZE jobs_archive")
        yield conn, end
    with databases.server.admin() as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(psycopg.conninfo.conninfo_to_dict(url)["dbname"])))


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += plan_nodes(child)
    return found


def test_the_latency_query_reads_a_bounded_slice_of_the_archive(
    big_archive: tuple[psycopg.Connection, datetime],
) -> None:
    conn, end = big_archive
    params = {"lanes": ["default", "bulk", "reports"], "window": 60.0, "sample": 1000,
              "now": end}
    row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query('lane_latency')}",
                       params).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    nodes = plan_nodes(plan)
    assert [n for n in nodes if n["Node Type"] == "Seq Scan"] == []
    indexes = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert indexes and all("lane_finished" in name for name in indexes), indexes
    sizes = conn.execute("""SELECT sum(pg_relation_size(inhrelid)) / 8192
                              FROM pg_inherits WHERE inhparent = 'jobs_archive'::regclass"""
                         ).fetchone()
    assert sizes is not None
    touched = int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    # Three lanes x at most 1000 rows: a small fraction of the archive's pages.
    assert touched < int(sizes[0]) / 5, (touched, sizes[0])
    result = views.lane_latency(conn, ["default", "bulk", "reports"], 60.0, 1000, end)
    # One job every 12 ms: a minute of one lane is about 1,700 jobs, capped by the sample.
    assert {lane: r.finished for lane, r in result.items()} == {
        "default": 1000, "bulk": 1000, "reports": 1000}


# --- through the command line --------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "jobd.yaml"
    path.write_text("lanes:\n  slow: {slo: {pickup: 5s}}\n  fast: {slo: {pickup: 1h}}\n"
                    "  spare: {}\n", "utf-8")
    return path


def fill(conn: psycopg.Connection) -> dict[str, int]:
    """A due job 30 s old in slow (over its SLO) and fast (within), finished jobs in fast."""
    now = db_now(conn)
    jobd.enqueue(conn, "h", lane="slow", run_at=now - timedelta(seconds=30))
    jobd.enqueue(conn, "h", lane="fast", run_at=now - timedelta(seconds=30))
    enqueued_when_due(conn)
    for i in range(5):
        finish(conn, "fast", now - timedelta(seconds=5), now - timedelta(seconds=4),
               now - timedelta(seconds=4 - 0.1 * i))
    return {"slow": 1, "fast": 1, "spare": 0}


def test_top_prints_a_plain_snapshot_when_stdout_is_not_a_terminal(
    db_url: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    depth = fill(conn)
    config = write_config(tmp_path)
    for extra in ([], ["--once"], ["--interval", "5s"]):
        out = ok("top", "-c", str(config), "--database-url", db_url, *extra)
        lines = out.splitlines()
        assert lines[0].startswith("jobd top ") and "q quits" not in out
        header = next(line for line in lines if line.startswith("LANE"))
        rows = {line.split()[0]: line for line in lines if line.split()[:1] in (
            ["slow"], ["fast"], ["spare"])}
        assert {name: int(line.split()[1]) for name, line in rows.items()} == depth
        assert "OVER SLO" in rows["slow"] and "OVER SLO" not in rows["fast"]
        # The finished jobs of fast give percentiles; the other lanes have none.
        start = header.index("RUN p50")
        assert rows["fast"][start:start + 7].strip() != "-"
        assert rows["slow"][start:start + 7].strip() == "-"
        assert "no live nodes" in out


def run_on_a_terminal(args: list[str], env: dict[str, str], timeout: float
                      ) -> tuple[int | None, str]:
    """``jobd ARGS`` with stdin and stdout on a pseudo-terminal; its exit code (None if it
    was still running at the deadline, and killed) and what it wrote there."""
    main, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "jobd", *args], stdin=secondary,
                               stdout=secondary, stderr=subprocess.DEVNULL, env=env)
    os.close(secondary)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            if not select.select([main], [], [], remaining)[0]:
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the process has closed the terminal's last descriptor
                break
            if not chunk:
                break
            output += chunk
        try:
            code: int | None = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(main)
    return code, output.decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.parametrize("term", ["dumb", "no-such-terminal"])
def test_top_on_a_terminal_that_cannot_place_the_cursor_prints_a_plain_snapshot(
    db_url: str, conn: psycopg.Connection, tmp_path: Path, term: str
) -> None:
    """TERM=dumb (Emacs' shell, some CI runners) names a terminal curses knows but that
    cannot move its cursor: the live view drew one garbled line there and never a refresh,
    and the command ran on until killed."""
    fill(conn)
    env = clean_env(TERM=term)
    code, out = run_on_a_terminal(
        ["top", "-c", str(write_config(tmp_path)), "--database-url", db_url], env, 20)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("jobd top ") and "q quits" not in out, out
    assert any(line.startswith("LANE") for line in lines), out
    assert "\x1b" not in out  # no curses escapes: plain text


def test_top_json_is_the_snapshot(db_url: str, conn: psycopg.Connection, tmp_path: Path
                                  ) -> None:
    fill(conn)
    data = json.loads(ok("top", "-c", str(write_config(tmp_path)), "--database-url", db_url,
                         "--json"))
    lanes = {entry["lane"]: entry for entry in data["lanes"]}
    assert {name: entry["over_slo"] for name, entry in lanes.items()} == {
        "fast": False, "slow": True, "spare": None}
    assert lanes["fast"]["finished_in_window"] == 5
    assert lanes["fast"]["pickup_p50_seconds"] == pytest.approx(1.0)
    assert data["nodes"] == [] and data["latency_window_seconds"] == top.LATENCY_WINDOW


@pytest.mark.parametrize("interval", ["10ms", "soon", "0"])
def test_a_bad_interval_is_a_usage_error(interval: str) -> None:
    line = assert_one_line_error(cli("top", "--interval", interval), 2)
    assert "--interval" in line


def test_a_config_without_lanes_shows_the_lanes_with_jobs(conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h", lane="only")
    shot = top.collect(conn, Config())
    assert [row.status.lane for row in shot.lanes] == ["only"]
    assert shot.lanes[0].slo_pickup is None


def test_pauses_are_shown_per_lane(conn: psycopg.Connection) -> None:
    for name in ("stopped", "partly", "running"):
        jobd.enqueue(conn, "h", lane=name)
    jobd.pause(conn, "stopped")
    jobd.pause(conn, "partly", "h")
    jobd.pause(conn, "partly", "g")
    shot = top.collect(conn, Config())
    rows = {row.status.lane: row for row in shot.lanes}
    assert (rows["stopped"].paused, rows["stopped"].paused_handlers) == (True, ())
    assert (rows["partly"].paused, rows["partly"].paused_handlers) == (False, ("g", "h"))
    assert rows["running"].as_dict()["paused"] is False
    lines = top.lane_table(shot)
    assert "PAUSED" in row_of(lines, "stopped").text
    assert "paused: g, h" in row_of(lines, "partly").text
    assert "paus" not in row_of(lines, "running").text


def test_a_lane_named_only_by_a_pause_is_shown_as_status_shows_it(
    conn: psycopg.Connection,
) -> None:
    # Paused ahead of a deploy, before its first job and in no config here: `jobd status`
    # and jobd_lane_paused show it, so the view of the same must too.
    jobd.pause(conn, "upcoming")
    shot = top.collect(conn, Config())
    assert [(row.status.lane, row.paused) for row in shot.lanes] == [("upcoming", True)]
    assert "PAUSED" in row_of(top.lane_table(shot), "upcoming").text


def test_slow_reads_stretch_the_refresh_and_say_so() -> None:
    assert top_screen.paced(1.0, 0.01) == 1.0
    assert top_screen.paced(1.0, 0.4) == pytest.approx(0.4 * top_screen.READ_SHARE)
    title = top.render(snapshot(lane("default")), 160, 40, interval=2.0, slowed=True)[0].text
    assert "every 2.0s (slowed: reads take long)" in title
