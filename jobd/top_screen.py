"""The live ``jobd top`` screen: curses, the refresh timer and the keys, at the edge of
:mod:`jobd.top` (which renders without I/O).

curses rather than a library such as rich or textual: it ships with Python, reads keys with
a timeout (the refresh interval is the wait for ``q``), follows resizes, and restores the
terminal however the loop ends. rich would add packages and still leave reading keys
(termios, raw mode, restoring it) to us; the view needs no widgets beyond styled lines.
"""

from __future__ import annotations

import curses
import os
import time
from collections.abc import Callable

import psycopg

from jobd import top
from jobd.config import Config
from jobd.db import connection_lost, first_line
from jobd.errors import DatabaseUnavailable

QUIT_KEYS = frozenset({ord("q"), ord("Q")})
# The view waits at least this many times as long as a read took before the next one, so it
# keeps the database busy at most a fifth of the time: the depth counts read the live jobs
# (as `jobd status` does), which takes a while on a backlog of millions.
READ_SHARE = 5.0


class Feed:
    """Snapshots for the live view. A failed read keeps the last snapshot on screen with a
    note saying what failed; a lost connection is opened again at the next refresh."""

    def __init__(self, connect: Callable[[], psycopg.Connection], config: Config,
                 conn: psycopg.Connection, first: top.Snapshot) -> None:
        self.connect = connect
        self.config = config
        self.conn: psycopg.Connection | None = conn
        self.latest = first

    def read(self) -> tuple[top.Snapshot, str | None]:
        try:
            if self.conn is None:
                self.conn = self.connect()
            self.latest = top.collect(self.conn, self.config)
            return self.latest, None
        except DatabaseUnavailable as exc:
            return self.latest, f"{exc}; showing the last snapshot, retrying"
        except psycopg.Error as exc:
            if self.conn is not None and connection_lost(self.conn):
                self.close()
            return self.latest, (f"database error: {first_line(exc)}; showing the last "
                                 f"snapshot, retrying")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def usable_terminal() -> bool:
    """Whether curses knows this terminal ($TERM) and can draw a screen on it; if not, the
    caller prints a snapshot."""
    # The size comes from the terminal itself (ncurses asks it when these are unset), not
    # from $LINES and $COLUMNS: a shell may have exported those before its window took its
    # size (tmux starts a pane at 80x24, then sizes it), and they do not follow resizes.
    for name in ("LINES", "COLUMNS"):
        os.environ.pop(name, None)
    try:
        curses.setupterm()
    except curses.error:
        return False
    # A terminal curses knows may still be unable to place its cursor (TERM=dumb, as Emacs'
    # shell and some CI runners set it): the view would be one garbled line, never redrawn.
    return curses.tigetstr("cup") is not None


def run(feed: Feed, interval: float) -> int:
    """The live view until ``q`` or Ctrl-C; exit code 0 either way."""
    try:
        curses.wrapper(_loop, feed, interval)
    except KeyboardInterrupt:
        # Ctrl-C is one of the two ways to leave; curses.wrapper has restored the terminal.
        pass
    return 0


class _View:
    """What is on screen: the latest snapshot and note, drawn for the screen's size."""

    def __init__(self, screen: curses.window, interval: float, snapshot: top.Snapshot) -> None:
        self.screen = screen
        self.asked = interval
        self.interval = interval
        self.styles = _styles()
        self.snapshot = snapshot
        self.note: str | None = None

    def draw(self) -> None:
        height, width = self.screen.getmaxyx()
        _draw(self.screen, self.styles, top.render(
            self.snapshot, width, height, interval=self.interval, note=self.note,
            slowed=self.interval > self.asked))


def _loop(screen: curses.window, feed: Feed, interval: float) -> None:
    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide its cursor shows it; nothing else changes
    view = _View(screen, interval, feed.latest)
    while True:
        view.draw()
        if _quit_within(screen, view.interval, view.draw):
            return
        started = time.monotonic()
        view.snapshot, view.note = feed.read()
        view.interval = paced(interval, time.monotonic() - started)


def paced(interval: float, read_seconds: float) -> float:
    """The wait before the next read: the interval asked for, longer when reads are slow."""
    return max(interval, READ_SHARE * read_seconds)


def _quit_within(screen: curses.window, interval: float, redraw: Callable[[], None]) -> bool:
    """Waits up to ``interval`` for a quit key, redrawing on a resize; True if one came."""
    deadline = time.monotonic() + interval
    while (remaining := deadline - time.monotonic()) > 0:
        screen.timeout(max(1, int(remaining * 1000)))
        key = screen.getch()
        if key in QUIT_KEYS:
            return True
        if key == curses.KEY_RESIZE:
            redraw()
    return False


def _styles() -> dict[top.Style, int]:
    red = yellow = 0
    if curses.has_colors():
        curses.start_color()
        try:
            curses.use_default_colors()
            background = -1  # the terminal's own background
        except curses.error:
            background = curses.COLOR_BLACK  # a terminal without default colours
        curses.init_pair(1, curses.COLOR_RED, background)
        curses.init_pair(2, curses.COLOR_YELLOW, background)
        red, yellow = curses.color_pair(1), curses.color_pair(2)
    return {"title": curses.A_BOLD, "header": curses.A_BOLD | curses.A_UNDERLINE,
            "normal": curses.A_NORMAL, "alert": curses.A_REVERSE | curses.A_BOLD | red,
            "warn": yellow, "error": curses.A_BOLD | red, "dim": curses.A_DIM}


def _draw(screen: curses.window, styles: dict[top.Style, int], lines: list[top.Line]) -> None:
    height, width = screen.getmaxyx()
    screen.erase()
    # One column short of the edge: writing the bottom-right cell makes curses raise.
    room = max(0, width - 1)
    for y, line in enumerate(lines[:height]):
        # An alert spans the row, so the highlight reads as a bar across the screen.
        text = line.text.ljust(room) if line.style == "alert" else line.text
        screen.addnstr(y, 0, text, room, styles[line.style])
    screen.refresh()
