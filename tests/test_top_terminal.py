"""`jobd top` in a real terminal: tmux runs it, capture-pane reads the screen, send-keys
types. Each test has its own tmux server (its own socket), ended by the test."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from daemon_support import enqueued_when_due

import jobd

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="needs tmux (Debian package tmux)")

DEADLINE = 20.0
# Select Graphic Rendition sequences as capture-pane -e writes them.
SGR = re.compile(r"\x1b\[([0-9;]*)m")


class Terminal:
    """A tmux server with one session running a command; the command's exit code lands in
    a file, since the session ends with it."""

    def __init__(self, workdir: Path) -> None:
        self.socket = workdir / "tmux.sock"
        self.rc_file = workdir / "rc"

    def tmux(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True,
                                text=True, timeout=10, check=True)
        return result.stdout

    def start(self, argv: list[str], width: int = 160, height: int = 40) -> None:
        command = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(self.rc_file))}"
        self.tmux("-f", "/dev/null", "new-session", "-d", "-x", str(width), "-y", str(height),
                  command)

    def screen(self, escapes: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []))

    def wait_for(self, condition: Callable[[str], bool], what: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if self.rc_file.exists():
                pytest.fail(f"the command exited while waiting for {what}: "
                            f"rc {self.rc_file.read_text().strip()}")
            text = self.screen()
            if condition(text):
                return text
            time.sleep(0.1)
        pytest.fail(f"no {what} on screen within {DEADLINE}s:\n{self.screen()}")

    def exit_code(self) -> int:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if self.rc_file.exists() and self.rc_file.read_text().strip():
                return int(self.rc_file.read_text())
            time.sleep(0.05)
        pytest.fail(f"the command did not exit within {DEADLINE}s:\n{self.screen()}")

    def stop(self) -> None:
        if self.socket.exists():
            subprocess.run(["tmux", "-S", str(self.socket), "kill-server"],
                           capture_output=True, timeout=10, check=False)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    # Not tmp_path: a unix socket's path must stay under about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="jobd-tmux-") as workdir:
        term = Terminal(Path(workdir))
        try:
            yield term
        finally:
            term.stop()


def top_argv(config: Path, db_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobd", "top", "-c", str(config), "--database-url", db_url,
            *extra]


@pytest.fixture
def queue_with_lanes(conn: psycopg.Connection, tmp_path: Path) -> Path:
    """Lanes slow (a due job older than its SLO), fast (the same job, within its SLO) and
    spare (empty); returns the config."""
    config = tmp_path / "jobd.yaml"
    config.write_text("lanes:\n  slow: {slo: {pickup: 5s}}\n  fast: {slo: {pickup: 1h}}\n"
                      "  spare: {}\n", "utf-8")
    row = conn.execute("SELECT now() - interval '30 seconds'").fetchone()
    assert row is not None
    for lane in ("slow", "fast"):
        jobd.enqueue(conn, "h", lane=lane, run_at=row[0])
    enqueued_when_due(conn)
    return config


def lane_line(screen: str, lane: str) -> str:
    [line] = [line for line in screen.splitlines()
              if SGR.sub("", line).split()[:1] == [lane]]
    return line


def attributes_before(line: str) -> set[str]:
    """The SGR parameters in force where the visible text of ``line`` starts."""
    leading = re.match(r"(?:\x1b\[[0-9;]*m)*", line)
    assert leading is not None
    params: set[str] = set()
    for match in SGR.finditer(leading[0]):
        for param in (match[1] or "0").split(";"):
            params = set() if param == "0" else params | {param}
    return params


def shows_lanes(text: str) -> bool:
    rows = [line.split()[:1] for line in text.splitlines()]
    return all([lane] in rows for lane in ("slow", "fast", "spare"))


def test_top_shows_the_lanes_highlights_the_one_over_its_slo_and_quits_on_q(
    terminal: Terminal, queue_with_lanes: Path, db_url: str
) -> None:
    terminal.start(top_argv(queue_with_lanes, db_url))
    text = terminal.wait_for(shows_lanes, "the lanes")
    assert text.splitlines()[0].startswith("jobd top ")
    assert "OVER SLO" in lane_line(text, "slow") and "OVER SLO" not in lane_line(text, "fast")
    coloured = terminal.screen(escapes=True)
    slow, fast = lane_line(coloured, "slow"), lane_line(coloured, "fast")
    assert "7" in attributes_before(slow), repr(slow)  # reverse video
    assert "7" not in attributes_before(fast), repr(fast)
    terminal.tmux("send-keys", "q")
    assert terminal.exit_code() == 0


def test_top_refreshes_and_leaves_on_ctrl_c(
    terminal: Terminal, queue_with_lanes: Path, db_url: str, conn: psycopg.Connection
) -> None:
    terminal.start(top_argv(queue_with_lanes, db_url, "--interval", "200ms"))
    terminal.wait_for(shows_lanes, "the lanes")

    def spare_depth(text: str) -> int:
        return int(lane_line(text, "spare").split()[1])

    assert spare_depth(terminal.screen()) == 0
    added = 3
    for _ in range(added):
        jobd.enqueue(conn, "h", lane="spare")
    terminal.wait_for(lambda text: spare_depth(text) == added, "the new jobs")
    terminal.tmux("send-keys", "C-c")
    assert terminal.exit_code() == 0


def test_a_small_terminal_shows_what_fits(
    terminal: Terminal, conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    names = [f"lane-{i:02d}" for i in range(20)]
    config.write_text("lanes:\n" + "".join(f"  {name}: {{}}\n" for name in names), "utf-8")
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    jobd.enqueue(conn, "h", lane="lane-00", run_at=row[0] - timedelta(seconds=1))
    terminal.start(top_argv(config, db_url), width=70, height=10)
    text = terminal.wait_for(lambda t: "more lanes" in t, "the count of lanes left out")
    lines = text.splitlines()
    assert len(lines) <= 10 and all(len(line) <= 70 for line in lines)
    shown = [line.split()[0] for line in lines if line.startswith("lane-")]
    assert shown == names[:len(shown)] and shown
    assert f"... {len(names) - len(shown)} more lanes" in text
    terminal.tmux("send-keys", "q")
    assert terminal.exit_code() == 0


def test_a_lost_connection_shows_a_note_and_the_view_reconnects(
    terminal: Terminal, queue_with_lanes: Path, db_url: str, conn: psycopg.Connection
) -> None:
    terminal.start(top_argv(queue_with_lanes, db_url, "--interval", "1s"))
    terminal.wait_for(shows_lanes, "the lanes")
    ended = conn.execute(
        """SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
            WHERE datname = current_database() AND pid <> pg_backend_pid()""").fetchone()
    assert ended == (1,)
    text = terminal.wait_for(lambda t: "database error" in t, "the note")
    assert shows_lanes(text)  # the last snapshot stays on screen
    terminal.wait_for(lambda t: "database error" not in t and shows_lanes(t), "the recovery")
    terminal.tmux("send-keys", "q")
    assert terminal.exit_code() == 0
