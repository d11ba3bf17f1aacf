"""A throwaway cluster from the installed server binaries: the harness's fallback server and the
database `make run` keeps under .jobd/."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Another process's server on a free port (a listening socket is enough to answer)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock


def test_a_port_another_process_holds_is_named(cluster: LocalCluster,
                                               listener: socket.socket) -> None:
    """pg_ctl says only "could not create any TCP/IP sockets"; the user needs the port and
    how to choose another (a second checkout's `make run`)."""
    taken = LocalCluster(cluster.datadir, listener.getsockname()[1])
    with pytest.raises(LocalPgError, match=f"port {taken.port} on 127.0.0.1 is taken.*"
                                           "JOBD_PG_PORT"):
        taken.start()


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_pid_file_a_killed_server_left_is_not_this_cluster_running(
        cluster: LocalCluster, listener: socket.socket) -> None:
    """After a kill -9 (or a reboot) postmaster.pid stays; with another server on the port
    the cluster was taken for running, and `make run` used that other server."""
    cluster.start()
    cluster.stop()
    port = listener.getsockname()[1]
    pid_file = cluster.datadir / "postmaster.pid"
    pid_file.write_text(f"{dead_pid()}\n{cluster.datadir}\n0\n{port}\n/tmp\n127.0.0.1\n")
    stale = LocalCluster(cluster.datadir, port)
    try:
        assert not stale.running()
        with pytest.raises(LocalPgError, match=f"port {port} on 127.0.0.1 is taken"):
            stale.start()
        stale.stop()  # nothing to stop: pg_ctl's "could not send stop signal" was an error
    finally:
        pid_file.unlink()


def test_a_cluster_running_on_another_port_is_named(cluster: LocalCluster) -> None:
    cluster.start()
    elsewhere = LocalCluster(cluster.datadir, free_port())
    assert not elsewhere.running()
    with pytest.raises(LocalPgError, match=f"already runs on port {cluster.port}"):
        elsewhere.start()
    assert cluster.running()


def test_as_root_a_datadir_the_postgres_user_cannot_enter_is_named() -> None:
    """A root user's checkout under /root (0700): initdb, run as postgres, said only
    "Permission denied"."""
    need_server_binaries()
    if os.geteuid() != 0:
        pytest.skip("as a normal user the cluster is the user's own")
    # Not pytest's tmp_path: its own root is 0700 already.
    root = Path(tempfile.mkdtemp(prefix="jobd-localpg-private-"))
    try:
        root.chmod(0o755)
        private = root / "private"
        private.mkdir(mode=0o700)
        cluster = LocalCluster(private / "checkout" / ".jobd" / "pg", free_port())
        with pytest.raises(LocalPgError, match=f"postgres user, which cannot enter {private} "
                                               r"\(mode 0700\)"):
            cluster.start()
    finally:
        shutil.rmtree(root)


def test_a_socket_directory_made_beforehand_as_a_link_is_refused(cluster: LocalCluster) -> None:
    """The socket directory's name in the shared temp directory is foreseeable: another local
    user could make it a link, to /etc say, and root's start handed the target to postgres."""
    target = Path(tempfile.mkdtemp(prefix="jobd-localpg-target-"))
    before = target.stat()
    cluster.socket_dir.symlink_to(target)
    try:
        with pytest.raises(LocalPgError, match="is not a directory of the cluster's owner"):
            cluster.start()
        after = target.stat()
        assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
        assert not cluster.running()
    finally:
        cluster.socket_dir.unlink()
        shutil.rmtree(target)


def test_a_socket_directory_others_may_write_is_refused(cluster: LocalCluster) -> None:
    cluster.socket_dir.mkdir(mode=0o700)
    try:
        if os.geteuid() == 0:
            shutil.chown(cluster.socket_dir, "postgres", "postgres")
        cluster.socket_dir.chmod(0o777)
        with pytest.raises(LocalPgError, match=r"\(mode 0777, uid \d+\): another user may"):
            cluster.start()
        cluster.socket_dir.chmod(0o755)  # the cluster's own, as it makes it: started in it
        cluster.start()
        assert cluster.running()
    finally:
        cluster.stop()
