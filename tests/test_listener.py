"""The supervisor's LISTEN connection: read on the loop, opened and probed on a thread, so
that a listen host that stops answering cannot hold the loop (jobd/listener.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
from netcut import cutting_proxy

from jobd.eventloop import SelectLoop
from jobd.listener import Listener


class LoopTurns:
    """The supervisor's use of a listener: a ``select``, then what arrived."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.loop = SelectLoop()
        self.heard: list[str] = []
        self.listens = 0  # how many times take() said a LISTEN had started
        listener.start(self.loop)

    def turn(self) -> None:
        self.loop.wait(0.05)
        wakeups, listening = self.listener.take()
        self.heard += [wakeup.lane for wakeup in wakeups]
        self.listens += listening

    def until(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.turn()


def test_a_probe_without_an_answer_waits_on_the_thread_while_the_loop_turns(
    db_url: str, conn: psycopg.Connection
) -> None:
    with cutting_proxy(db_url) as (proxy, proxied_url):
        listener = Listener(proxied_url, "jobd", probe_interval=0.2)
        turns = LoopTurns(listener)
        try:
            turns.until(lambda: turns.listens == 1, "the first LISTEN")
            conn.execute("SELECT pg_notify('jobd_wakeup', 'first#1')")
            turns.until(lambda: "first" in turns.heard, "the first notification")

            # The next probe goes unanswered, as behind a partition (until tcp_user_timeout,
            # 30 s). The loop turns on meanwhile, the connection still the thread's.
            proxy.hold_before(lambda message: b"SELECT 1" in message)
            # A probe run on the loop would hold its turn for good (the proxy's kernel
            # acknowledges what it is sent): ended by the reset, it fails the assertion.
            partition_ends = threading.Timer(20.0, proxy.reset_held)
            partition_ends.start()
            turns.until(proxy.held.is_set, "the probe to be held")
            for _ in range(5):
                turns.turn()
            assert listener.connected and turns.listens == 1
            partition_ends.cancel()

            # Its connection lost, the thread opens another, and the loop listens on it.
            proxy.reset_held()
            turns.until(lambda: turns.listens == 2, "the second LISTEN")
            conn.execute("SELECT pg_notify('jobd_wakeup', 'second#1')")
            turns.until(lambda: "second" in turns.heard, "a notification on the new connection")
        finally:
            listener.close()


def test_a_lost_connection_is_opened_again_and_says_so(
    db_url: str, conn: psycopg.Connection
) -> None:
    listener = Listener(db_url, "jobd", node="probe-test")
    turns = LoopTurns(listener)
    try:
        turns.until(lambda: turns.listens == 1, "the first LISTEN")
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                     " WHERE datname = current_database()"
                     " AND application_name = 'jobd listener node=probe-test'")
        # Read on the loop: the loss is seen there, the new connection opened on the thread;
        # what was sent in between went to the old session, so take() says to look.
        turns.until(lambda: turns.listens == 2, "the LISTEN after the loss")
        conn.execute("SELECT pg_notify('jobd_wakeup', 'again#1')")
        turns.until(lambda: "again" in turns.heard, "a notification on the new connection")
    finally:
        listener.close()
