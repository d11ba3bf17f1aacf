"""A real PgBouncer in front of the test cluster, in transaction mode, for the pooler tests and
bench/pooler_bench.py.

:func:`start_pgbouncer` writes an ini into a directory of its own: every database of the
server (``* =``), ``pool_mode = transaction``, trust auth for the server's user (listed in an
auth_file, as PgBouncer wants), that user as the console's admin (``PAUSE``, ``RESUME``:
:meth:`PgBouncer.admin`), a free port on 127.0.0.1, and PgBouncer's defaults for
everything else: in particular no ``ignore_startup_parameters``, so it refuses ``options``
the way a stock install does. PgBouncer refuses to run as root; as root it is started with
``-u`` and the user that owns the PostgreSQL install (or ``nobody``), so its directory is a
fresh one under the system's temporary directory (a user that is not root could not reach
one under pytest's), removed when it stops.

:class:`TcpRelay` is a plain TCP forwarder on a port of its own, to make a direct connection
disappear and come back (the listener tests): closed, nothing listens on its port.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PACKAGE = "pgbouncer"  # the Debian package that ships the binary
_CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")


def pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    return next((path for path in _CANDIDATES if os.access(path, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as() -> str | None:
    """The user to drop to when running as root (PgBouncer will not run as root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name).pw_name
    raise RuntimeError("running as root and there is no postgres or nobody user for PgBouncer")


@dataclass
class PgBouncer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes]
    server_url: str  # an admin URL of the server behind it

    def url_for(self, direct_url: str) -> str:
        """``direct_url`` (a database of the server) as reached through this PgBouncer."""
        params = conninfo_to_dict(direct_url)
        params.update(host="127.0.0.1", port=str(self.port))
        params.pop("password", None)  # trust between client and PgBouncer
        params.pop("options", None)  # PgBouncer refuses it (jobd moves it, plain clients fail)
        return make_conninfo(**params)

    def admin(self, command: str) -> list[tuple[object, ...]]:
        """``command`` (``PAUSE``, ``RESUME``, ``SHOW CLIENTS``, ...) on PgBouncer's console,
        which takes the simple query protocol only (a client-side cursor)."""
        url = make_conninfo(self.url_for(self.server_url), dbname="pgbouncer")
        with psycopg.connect(url, autocommit=True, prepare_threshold=None,
                             cursor_factory=psycopg.ClientCursor, connect_timeout=5) as conn:
            cursor = conn.execute(command)
            return cursor.fetchall() if cursor.description else []

    def log(self) -> str:
        texts = [path.read_text(errors="replace") for name in ("stderr.log", "pgbouncer.log")
                 if (path := self.directory / name).exists()]
        return "\n".join(texts) or "(no log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _ini(port: int, server: dict[str, str], directory: Path, pool_mode: str,
         ignore_startup_parameters: str = "", extra: dict[str, str] | None = None) -> str:
    target = " ".join(f"{key}={server[key]}" for key in ("host", "port", "user", "password")
                      if server.get(key))
    return "\n".join([
        "[databases]",
        f"* = {target}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        f"pool_mode = {pool_mode}",
        "auth_type = trust",
        f"auth_file = {directory / 'users.txt'}",
        f"logfile = {directory / 'pgbouncer.log'}",
        f"admin_users = {server['user']}",  # for PgBouncer's console (PgBouncer.admin)
        *([f"ignore_startup_parameters = {ignore_startup_parameters}"]
          if ignore_startup_parameters else []),
        *(f"{name} = {value}" for name, value in (extra or {}).items()),
        "",
    ])


def start_pgbouncer(server_url: str, *, pool_mode: str = "transaction",
                    ignore_startup_parameters: str = "", **extra: str) -> PgBouncer:
    """A PgBouncer on a free port in front of ``server_url``'s server; waits until it answers.
    ``extra``: further settings of its ini (``default_pool_size="2"``, say)."""
    binary = pgbouncer_binary()
    if binary is None:
        raise FileNotFoundError(f"pgbouncer is not installed (Debian package {PACKAGE})")
    directory = Path(tempfile.mkdtemp(prefix="jobd-pgbouncer-"))
    server = {k: str(v) for k, v in conninfo_to_dict(server_url).items()}
    server.setdefault("host", "127.0.0.1")
    server.setdefault("port", "5432")
    server.setdefault("user", "postgres")
    (directory / "users.txt").write_text(f'"{server["user"]}" ""\n')
    port = free_port()
    ini = directory / "pgbouncer.ini"
    ini.write_text(_ini(port, server, directory, pool_mode, ignore_startup_parameters, extra))
    command = [binary, str(ini)]
    user = _run_as()
    if user is not None:
        shutil.chown(directory, user)
        for path in directory.iterdir():
            shutil.chown(path, user)
        command[1:1] = ["-u", user]
    with open(directory / "stderr.log", "wb") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
    bouncer = PgBouncer(port, directory, process, server_url)
    probe = bouncer.url_for(make_conninfo(server_url, dbname="postgres"))
    deadline = time.monotonic() + 15
    while True:
        try:
            with psycopg.connect(probe, connect_timeout=2, autocommit=True,
                                 prepare_threshold=None) as conn:
                conn.execute("SELECT 1")
            return bouncer
        except psycopg.OperationalError as exc:
            if process.poll() is not None or time.monotonic() > deadline:
                bouncer.stop()
                raise RuntimeError(f"PgBouncer did not start: {exc}\n{bouncer.log()}") from None
            time.sleep(0.1)


@dataclass
class TcpRelay:
    """Forwards connections on 127.0.0.1:``port`` to ``target``; :meth:`close` stops
    listening and cuts the connections it carries, :meth:`open` listens again (same port)."""

    target: tuple[str, int]
    port: int = field(default_factory=free_port)
    _server: socket.socket | None = None
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self) -> TcpRelay:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def url_for(self, direct_url: str) -> str:
        return make_conninfo(direct_url, host="127.0.0.1", port=str(self.port))

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            with self._lock:
                if self._server is not server:
                    # close() ran since the accept: it cut the connections it knew of, and
                    # this pair was not among them.
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass  # the other direction closed both sockets, or close() did
        finally:
            # Closed here too, not only by close(): a pair whose relay is never closed again
            # must not be left to the garbage collector (a ResourceWarning in a later test).
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.close()
                self._server = None
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextlib.contextmanager
def running_pgbouncer(server_url: str, **settings: str) -> Iterator[PgBouncer]:
    bouncer = start_pgbouncer(server_url, **settings)
    try:
        yield bouncer
    finally:
        bouncer.stop()
