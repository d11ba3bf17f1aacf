"""A network that goes silent between jobd and its database: packets dropped, no reset, no
end (a partition, a dead NAT entry, a frozen load balancer or pooler), then back.

The database is reached through ``netcut.SilenceableProxy``, which stops forwarding while
keeping every socket open. Its sockets acknowledge what they are sent and answer the kernel's
keepalives, so the kernel never gives up on them (``tcp_user_timeout`` and keepalives count
only unacknowledged data and unanswered probes): to jobd the silence is a server that stopped
answering mid-statement, the case only its own reply bound (``db.BoundedConnection``,
statement_timeout + ``REPLY_GRACE``) ends. The daemon here runs with a 1 s statement_timeout,
so each wait gives up after 6 s.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import cli_support
import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, wait_until
from fault_support import (
    LANE,
    create_effects_table,
    done_count,
    enqueue_load,
    fault_config,
    prepare,
    wait_all_done,
)
from invariants import assert_invariants
from netcut import SilenceableProxy, silenceable_proxy

from jobd import fastpath
from jobd.db import REPLY_GRACE, NoAnswer, SessionSettings, connect

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

Daemons = Callable[..., Daemon]

STATEMENT_TIMEOUT = 1.0
BOUND = STATEMENT_TIMEOUT + REPLY_GRACE
SESSION = SessionSettings(statement_timeout=STATEMENT_TIMEOUT)


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[SilenceableProxy, str]]:
    with silenceable_proxy(db_url) as pair:
        yield pair


def outcome_within(call: Callable[[], Any], timeout: float,
                   proxy: SilenceableProxy) -> BaseException | Any:
    """What ``call`` returned or raised, run on a thread; fails the test if it is still
    waiting after ``timeout`` seconds (after letting the network back, so that the call
    returns and its connection can be closed)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(call())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        proxy.resume()
        thread.join(10)
        pytest.fail(f"still waiting after {timeout} s; the answer came when the network was "
                    f"back: {box}")
    return box[0]


@pytest.mark.parametrize("to_server, to_client", [(True, True), (False, True)],
                         ids=["both-ways", "answers-lost"])
def test_a_statement_into_a_silent_network_gives_up_and_loses_its_connection(
    proxied: tuple[SilenceableProxy, str], to_server: bool, to_client: bool
) -> None:
    proxy, url = proxied
    with connect(url, session=SESSION) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        proxy.silence(to_server=to_server, to_client=to_client)
        outcome = outcome_within(lambda: conn.execute("SELECT 1"), BOUND + 10, proxy)
        assert isinstance(outcome, NoAnswer), outcome
        assert isinstance(outcome, psycopg.OperationalError)
        assert conn.closed  # lost, for ManagedConnection and the pool: reconnect
    proxy.resume()
    with connect(url, session=SESSION) as again:
        assert again.execute("SELECT 1").fetchone() == (1,)


def test_a_worker_exchange_into_a_silent_network_gives_up_and_closes_its_connection(
    proxied: tuple[SilenceableProxy, str]
) -> None:
    proxy, url = proxied
    with connect(url, session=SESSION) as conn:
        assert fastpath.run(conn, [("search_path_setting", None)]) == [[("jobd",)]]
        proxy.silence()
        outcome = outcome_within(lambda: fastpath.run(conn, [("search_path_setting", None)]),
                                 BOUND + 10, proxy)
        assert isinstance(outcome, NoAnswer), outcome
        assert conn.closed


def test_a_connection_without_a_statement_timeout_waits_for_the_network(
    proxied: tuple[SilenceableProxy, str]
) -> None:
    """No statement_timeout (code's own connect(), a migration): nothing says an answer is
    overdue, so it waits as before, and gets its answer when the network is back."""
    proxy, url = proxied
    with connect(url) as conn:
        proxy.silence()
        box: list[Any] = []
        thread = threading.Thread(
            target=lambda: box.append(conn.execute("SELECT 1").fetchone()), daemon=True)
        thread.start()
        thread.join(0.5)
        assert not box
        proxy.resume()
        thread.join(10)
        assert box == [(1,)]


def is_statement(data: bytes) -> bool:
    """A simple or extended-protocol query (the startup packet starts with its length)."""
    return data[:1] in (b"Q", b"P")


def test_the_cli_against_a_silent_network_fails_with_one_line_instead_of_waiting(
    tmp_path: Any, proxied: tuple[SilenceableProxy, str]
) -> None:
    proxy, url = proxied
    config = tmp_path / "jobd.yaml"
    config.write_text(f"database:\n  statement_timeout: {STATEMENT_TIMEOUT:g}s\n")
    proxy.silence_before(is_statement)  # connected, then silent at its first statement
    try:
        result = subprocess.run(
            [*cli_support.JOBD, "status", "-c", str(config), "--database-url", url],
            capture_output=True, text=True, env=cli_support.clean_env(), timeout=BOUND + 20)
    except subprocess.TimeoutExpired:
        proxy.resume()
        pytest.fail("jobd status still waiting for the silent database")
    assert result.returncode == 1, result.stderr
    assert "no answer from the database" in result.stderr
    assert "Traceback" not in result.stderr


# --- the daemon -------------------------------------------------------------------------


def partition_config(**supervisor: Any) -> dict[str, Any]:
    config = fault_config(lane={"workers": 2, "concurrency": 2}, supervisor=supervisor)
    config["database"] = {"statement_timeout": f"{STATEMENT_TIMEOUT:g}s"}
    return config


def flowing(daemons: Daemons, db_url: str, proxy_url: str, conn: psycopg.Connection,
            **supervisor: Any) -> tuple[Daemon, list[int]]:
    """A node on ``proxy_url`` with jobs of its lane running."""
    create_effects_table(conn)
    daemon = prepare(daemons(name="partition"))
    daemon.run_url = proxy_url
    daemon.start(partition_config(**supervisor))
    daemon.wait_workers_started(LANE, 2, timeout=30)
    ids = enqueue_load(conn, 20, hold=0.2, prefix="before")
    wait_until(lambda: done_count(conn, ids) >= 4, 30, message=daemon.tail)
    return daemon, ids


def lost_connections(daemon: Daemon, since: int) -> set[str]:
    """The connections whose loss the node logged since ``since``, by application name."""
    return {str(e["connection"]) for e in daemon.events(None, process=None, since=since)
            if str(e.get("event", "")).endswith(" lost")}


def test_a_node_behind_a_silent_network_gives_its_connections_up_and_recovers_when_it_returns(
    daemons: Daemons, db_url: str, effects_db: psycopg.Connection,
    proxied: tuple[SilenceableProxy, str]
) -> None:
    proxy, proxy_url = proxied
    conn = effects_db
    daemon, before = flowing(daemons, db_url, proxy_url, conn)
    mark = daemon.mark()
    proxy.silence()
    # Every connection that was waiting gives up within its bound, and says so: the
    # supervisor's duties and the workers' claims and settles.
    wait_until(lambda: any("supervisor" in name for name in lost_connections(daemon, mark))
               and any("worker" in name for name in lost_connections(daemon, mark)),
               BOUND + 15, interval=0.2,
               message=lambda: f"the losses logged\n{daemon.tail()}")
    # The loop answers meanwhile: a reload is taken.
    daemon.signal(signal.SIGHUP)
    daemon.wait_for_log("config reloaded", since=mark, timeout=10)
    proxy.resume()
    after = enqueue_load(conn, 10, prefix="after")
    wait_all_done(conn, before + after, 60, daemon)
    assert daemon.running(), daemon.tail()
    assert_invariants(conn, before + after, settled=True, context=daemon.tail())
