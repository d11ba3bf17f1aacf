"""A throwaway cluster from the installed server binaries: the harness's fallback server and the
database `make run` keeps under .jobd/."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest

import jobd
from jobd.db import connect
from jobd.localpg import LocalCluster, LocalPgError, find_bindir, free_port, throwaway_cluster
from jobd.migrate import migrate


def need_server_binaries() -> None:
    try:
        find_bindir()
    except LocalPgError as exc:
        pytest.skip(f"no PostgreSQL server binaries to start a cluster with: {exc}")


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    need_server_binaries()
    with throwaway_cluster("jobd-localpg-", start=False) as local:
        yield local


def test_find_bindir_finds_initdb_and_pg_ctl() -> None:
    try:
        bindir = find_bindir()
    except LocalPgError as exc:
        pytest.skip(f"no PostgreSQL server binaries: {exc}")
    assert (bindir / "initdb").exists() and (bindir / "pg_ctl").exists()


def test_free_port_can_be_listened_on() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_a_throwaway_cluster_starts_serves_and_stops(cluster: LocalCluster) -> None:
    assert not cluster.initialized() and not cluster.running()
    url = cluster.start()
    assert url == f"postgresql://postgres@127.0.0.1:{cluster.port}/postgres"
    assert cluster.initialized() and cluster.running()
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("SELECT current_setting('port')::int, current_user").fetchone()
        assert row == (cluster.port, "postgres")
    # Starting a running cluster changes nothing and gives the same URL.
    assert cluster.start() == url

    cluster.stop()
    assert not cluster.running()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2)


def test_a_setting_the_server_refuses_is_named_and_nothing_is_left_to_stop() -> None:
    need_server_binaries()
    logged: list[str] = []
    refused = 'unrecognized configuration parameter "shared_bufers"'
    with (pytest.raises(LocalPgError, match=refused),
          throwaway_cluster("jobd-localpg-", log=logged.append,
                            settings={"shared_bufers": "4GB"})):
        pass
    assert logged == []  # no "stopping the throwaway cluster failed" after the failed start

def test_jobd_runs_on_it_and_its_data_survives_a_restart(cluster: LocalCluster) -> None:
    url = cluster.start()
    with connect(url) as conn:
        migrate(conn, "jobd")
        job_id = jobd.enqueue(conn, "send_email", {"to": "a@example.com"})
    cluster.stop()

    # The module's command line, as `make run` uses it.
    command = [sys.executable, "-m", "jobd.localpg"]
    datadir, port = str(cluster.datadir), str(cluster.port)
    started = subprocess.run([*command, "start", datadir, "--port", port],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == url
    with connect(url) as conn:
        assert conn.execute("SELECT id, payload FROM jobs").fetchall() == [
            (job_id, {"to": "a@example.com"})]
    stopped = subprocess.run([*command, "stop", datadir, "--port", port],
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not cluster.running()


def test_a_throwaway_cluster_leaves_nothing_behind() -> None:
    need_server_binaries()
    with throwaway_cluster("jobd-localpg-tc-") as local:
        root, socket_dir = local.datadir.parent, local.socket_dir
        with psycopg.connect(local.url, connect_timeout=5) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    assert not local.running()
    assert not root.exists() and not socket_dir.exists()
