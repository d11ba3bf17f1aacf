"""A private PostgreSQL cluster from the installed server binaries.

``make run`` keeps one under ``.jobd/`` when no ``JOBD_DATABASE_URL`` is given, and the test
harness starts a throwaway one when no server answers. PostgreSQL refuses to run as root, so
as root the cluster belongs to the ``postgres`` user and its commands run through ``runuser``.

Command line: ``python -m jobd.localpg start DATADIR [--port N]`` prints the URL of a running
cluster (creating it first if needed); ``python -m jobd.localpg stop DATADIR`` stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 54329


class LocalPgError(RuntimeError):
    """The cluster could not be created or started; the message says why."""


def find_bindir() -> Path:
    """The directory holding initdb and pg_ctl."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if result.returncode == 0:
            candidates.append(Path(result.stdout.strip()))
    versioned = [Path(path) for path in glob.glob("/usr/lib/postgresql/*/bin")]
    versioned.sort(key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
                   reverse=True)
    candidates += versioned
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(os.path.realpath(initdb)).parent)
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "pg_ctl").exists():
            return candidate
    raise LocalPgError("no PostgreSQL server binaries found (initdb/pg_ctl); install postgresql")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalCluster:
    datadir: Path
    port: int = DEFAULT_PORT
    # Extra environment for the server processes (e.g. LD_PRELOAD of libfaketime, so a
    # drill can move the server's clock); empty for an ordinary cluster.
    server_env: dict[str, str] = field(default_factory=dict)
    # Server settings passed on the command line after jobd's own (later ones win), e.g. a
    # fault test's {"max_connections": "400"}.
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def socket_dir(self) -> Path:
        # Unix socket paths are limited to ~107 bytes; keep the socket in a short path.
        return Path(tempfile.gettempdir()) / f"jobd-pg-{self.port}"

    def _as_owner(self, command: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return command
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise LocalPgError("running as root but there is no 'postgres' user to own the "
                               "cluster; create one or run as a normal user") from None
        return ["runuser", "-u", "postgres", "--", *command]

    def _give_to_owner(self, path: Path) -> None:
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")

    def _make_socket_dir(self) -> None:
        """The socket directory, under the shared temp directory at a name anyone can
        foresee: one that is already there must be a real directory of the cluster's owner
        that nobody else may write. Another local user could otherwise make it first, as a
        symbolic link to /etc say, and root's ``make run`` gave the link's target to the
        postgres user."""
        path = self.socket_dir
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o755)
            if os.geteuid() == 0:
                owner = pwd.getpwnam("postgres")
                os.lchown(path, owner.pw_uid, owner.pw_gid)
        info = path.lstat()
        expected = pwd.getpwnam("postgres").pw_uid if os.geteuid() == 0 else os.geteuid()
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != expected
                or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            raise LocalPgError(
                f"{path} is not a directory of the cluster's owner that only it may write "
                f"(mode {info.st_mode & 0o7777:04o}, uid {info.st_uid}): another user may have "
                "made it; remove it, or set JOBD_DATABASE_URL")

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(self._as_owner(command), capture_output=True, text=True)
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip().splitlines()
            tail = output[-1] if output else f"exit code {result.returncode}"
            raise LocalPgError(f"{Path(command[0]).name} failed: {tail}")

    def initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    def running(self) -> bool:
        """This cluster's server is up on ``port``: its postmaster.pid names a live process
        and that port, and the port answers. A pid file left by a killed server, or another
        server answering on the port, is not this cluster running."""
        lock = self._postmaster_lock()
        return lock is not None and lock[1] == self.port and _answers(self.port)

    def _postmaster_lock(self) -> tuple[int, int] | None:
        """(pid, port) from postmaster.pid when its process is alive, else None."""
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
            pid, port = int(lines[0]), int(lines[3])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's (the postgres user's, when not root)
            pass
        return pid, port

    def start(self) -> str:
        """Create the cluster if needed, start it if stopped, and return its URL."""
        bindir = find_bindir()
        if not self.initialized():
            self.datadir.mkdir(parents=True, exist_ok=True)
            self.datadir.chmod(0o700)
            self._give_to_owner(self.datadir)
            self._check_owner_reaches_datadir()
            self._run([str(bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres",
                       "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8"])
        if self.running():
            return self.url
        self._check_startable()
        self._make_socket_dir()
        log_file = self.datadir / "server.log"
        try:
            self._run([*self._env(), str(bindir / "pg_ctl"), "-D", str(self.datadir), "-l",
                       str(log_file), "-o", self._options(), "-w", "-t", "60", "start"])
        except LocalPgError as exc:
            # pg_ctl says only "Examine the log output"; the reason (an unknown or invalid
            # setting, a port taken) is the server log's FATAL line, which goes with the
            # directory once a throwaway cluster is removed.
            raise LocalPgError(f"{exc} {_fatal_lines(log_file)}".rstrip()) from None
        return self.url

    def _check_owner_reaches_datadir(self) -> None:
        """As root, the postgres user runs the server: every directory above the data
        directory must let it pass (a checkout under /root, mode 0700, does not), else
        initdb fails with a bare "Permission denied"."""
        if os.geteuid() != 0 or self._owner_can_enter(self.datadir):
            return
        blocking = next((path for path in reversed(self.datadir.parents)
                         if not self._owner_can_enter(path)), self.datadir)
        raise LocalPgError(
            f"running as root, the cluster belongs to the postgres user, which cannot enter "
            f"{blocking} (mode {blocking.stat().st_mode & 0o777:04o}); put the checkout where "
            "it can, run as a normal user, or set JOBD_DATABASE_URL")

    def _owner_can_enter(self, path: Path) -> bool:
        return subprocess.run(self._as_owner(["test", "-x", str(path)])).returncode == 0

    def _check_startable(self) -> None:
        """Name the two usual reasons a start fails before pg_ctl hides them behind
        "Examine the log output": the cluster already runs on another port, or another
        process (another checkout's cluster) holds this one."""
        lock = self._postmaster_lock()
        if lock is not None and lock[1] != self.port:
            raise LocalPgError(
                f"the cluster in {self.datadir} already runs on port {lock[1]} (pid {lock[0]}),"
                f" not {self.port}: use that port, or stop it first "
                f"(python -m jobd.localpg stop {self.datadir})")
        if _answers(self.port):
            raise LocalPgError(
                f"port {self.port} on 127.0.0.1 is taken by another process (another "
                "checkout's cluster?); choose a free port: make run JOBD_PG_PORT=N, or "
                "python -m jobd.localpg start DATADIR --port N")

    def _options(self) -> str:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.socket_dir} -c fsync=on "
                   "-c max_connections=200")
        return " ".join([options, *(f"-c {name}={value}" for name, value in
                                    self.settings.items())])

    def _env(self) -> list[str]:
        if not self.server_env:
            return []
        return ["env", *(f"{key}={value}" for key, value in self.server_env.items())]

    def restart(self, mode: str = "fast") -> None:
        """Restart the running cluster; ``mode`` is pg_ctl's shutdown mode (``immediate``
        is a crash: no checkpoint, the server recovers from its WAL on the way up)."""
        bindir = find_bindir()
        self._run([*self._env(), str(bindir / "pg_ctl"), "-D", str(self.datadir), "-l",
                   str(self.datadir / "server.log"), "-o", self._options(), "-m", mode,
                   "-w", "-t", "60", "restart"])

    def stop(self) -> None:
        # No postmaster.pid, or one whose process is gone: never started, its start failed,
        # or the server was killed (pg_ctl stop would fail: "could not send stop signal").
        if not self.initialized() or self._postmaster_lock() is None:
            return
        bindir = find_bindir()
        self._run([str(bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "fast", "-w", "stop"])


def _answers(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fatal_lines(log_file: Path) -> str:
    """The FATAL lines of a server log, for an error message ('' without any)."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    fatal = [line.split("FATAL:", 1)[1].strip() for line in lines if "FATAL:" in line]
    return f"(server log: {'; '.join(fatal[-3:])})" if fatal else ""


@contextlib.contextmanager
def throwaway_cluster(prefix: str, *, start: bool = True, keep: bool = False,
                      log: Callable[[str], None] = _stderr,
                      server_env: dict[str, str] | None = None,
                      settings: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A cluster in a fresh temp directory on a free port, started unless ``start`` is
    false; stopped and removed at the end, also on an error. ``keep`` leaves the directory
    (data, server log) behind; ``server_env`` is added to the server's environment,
    ``settings`` to its command line."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    # As root the cluster belongs to postgres, which must be able to reach its data directory.
    root.chmod(0o755)
    cluster = LocalCluster(root / "pg", free_port(), dict(server_env or {}), dict(settings or {}))
    try:
        if start:
            cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        except LocalPgError as exc:  # the error that ended the run, if any, stays in front
            log(f"stopping the throwaway cluster failed: {exc}")
        shutil.rmtree(cluster.socket_dir, ignore_errors=True)
        if keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobd.localpg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("datadir", type=Path)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args(argv)
    # The datadir must be reachable by the postgres user when running as root.
    cluster = LocalCluster(args.datadir.resolve(), args.port)
    try:
        if args.action == "start":
            print(cluster.start())
        else:
            cluster.stop()
    except LocalPgError as exc:
        print(f"jobd.localpg: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
