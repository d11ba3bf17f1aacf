"""A TCP proxy to the test's database that loses a connection the way a network does.

Closing a client's socket sends the server a FIN, and its backend ends at once: not what a
partition or a frozen node does. Here the proxy closes its side towards the client and
keeps its side towards the server open and silent, so the server's backend stays where the
client left it (idle in its transaction) until something ends it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo


class CuttingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._cut_when: Callable[[bytes], bool] | None = None
        self._hold_when: Callable[[bytes], bool] | None = None
        self._held: socket.socket | None = None
        self._sockets = _Sockets()  # closed on the way out, the silent ones too
        self.cut = threading.Event()
        self.held = threading.Event()
        threading.Thread(target=_accept, args=(self.listener, self._connect), daemon=True).start()

    def cut_before(self, condition: Callable[[bytes], bool]) -> None:
        """The next client message for which ``condition`` holds is not forwarded: its
        client's connection is lost instead, the server's side left open."""
        self._cut_when = condition

    def hold_before(self, condition: Callable[[bytes], bool]) -> None:
        """The next client message for which ``condition`` holds is not forwarded, and
        nothing more is, either way: a partition, until :meth:`reset_held`."""
        self._hold_when = condition

    def reset_held(self) -> None:
        """End the held connection towards its client, as a reset (once)."""
        assert self._held is not None
        if self._held.fileno() != -1:
            _reset(self._held)

    def _connect(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        if not self._sockets.keep(client, server):
            return
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                condition = self._cut_when
                if from_client and condition is not None and condition(data):
                    self._cut_when = None
                    # Set before the reset: the client, woken by it, may look at once.
                    self.cut.set()
                    # Towards the client only: a reset, and nothing towards the server.
                    _reset(source)
                    return
                hold = self._hold_when
                if from_client and hold is not None and hold(data):
                    self._hold_when = None
                    self._held = source
                    sink.shutdown(socket.SHUT_RD)  # nothing from the server either
                    self.held.set()
                    return
                sink.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self._sockets.close(self.listener)


class _Sockets:
    """A proxy's sockets, closed together with its listener. A connection whose sockets come
    after the close is closed at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._closed = False

    def keep(self, *new: socket.socket) -> bool:
        """Record a new connection's sockets; False (and closed) if the proxy is closed."""
        with self._lock:
            if not self._closed:
                self._open.extend(new)
                return True
        for sock in new:
            sock.close()
        return False

    def listed(self) -> list[socket.socket]:
        with self._lock:
            return list(self._open)

    def close(self, listener: socket.socket) -> None:
        """Close the listener and every recorded socket. The listener is shut down first: a
        thread blocked in its ``accept()`` keeps it listening past a plain ``close()`` and
        would take one more connection (a daemon reconnecting while its test ends)."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for sock in self.listed():
            with contextlib.suppress(OSError):
                sock.close()


def _accept(listener: socket.socket, on_client: Callable[[socket.socket], None]) -> None:
    """Hand each client to ``on_client`` until the listener is closed."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # closed
        on_client(client)


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@contextlib.contextmanager
def cutting_proxy(db_url: str) -> Iterator[tuple[CuttingProxy, str]]:
    """A proxy to ``db_url``'s server and the URL that goes through it."""
    with _proxied(db_url, CuttingProxy) as pair:
        yield pair


P = TypeVar("P", "CuttingProxy", "SilenceableProxy")


@contextlib.contextmanager
def _proxied(db_url: str, kind: Callable[[tuple[str, int]], P]) -> Iterator[tuple[P, str]]:
    """A proxy of ``kind`` to ``db_url``'s server, and the URL that goes through it; closed
    on the way out."""
    params = conninfo_to_dict(db_url)
    host = str(params.get("host") or "")
    if not host or host.startswith("/"):
        pytest.skip("the test database is reached through a Unix socket; the proxy needs TCP")
    proxy = kind((host, int(params.get("port") or 5432)))
    try:
        yield proxy, make_conninfo(db_url, host="127.0.0.1", port=proxy.port)
    finally:
        proxy.close()


class SilentServer:
    """A server that accepts connections and never says a word: a host behind a partition,
    as a client in its connection attempt meets it (until its connect timeout)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._accepted = _Sockets()
        threading.Thread(target=_accept, args=(self.listener, self._accepted.keep),
                         daemon=True).start()

    @property
    def accepted(self) -> list[socket.socket]:
        """Every connection accepted so far."""
        return self._accepted.listed()

    def open_attempts(self) -> list[socket.socket]:
        """The accepted connections their clients have not given up on (nor closed)."""
        return [sock for sock in self._accepted.listed() if not _closed_by_peer(sock)]

    def close(self) -> None:
        self._accepted.close(self.listener)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the client has closed ``sock``; what it sent (a startup packet) is read and
    dropped on the way."""
    try:
        while sock.recv(65536, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return False  # open and quiet
    except OSError:
        return True  # reset
    return True  # the end of the stream


@contextlib.contextmanager
def silent_server(db_url: str) -> Iterator[tuple[SilentServer, str]]:
    """A silent server and ``db_url`` pointed at it."""
    server = SilentServer()
    try:
        yield server, make_conninfo(db_url, host="127.0.0.1", port=server.port)
    finally:
        server.close()


class SilenceableProxy:
    """A TCP proxy whose forwarding can stop, in either direction or both, while every
    socket stays open: a partition, a dead NAT entry, a frozen load balancer. Nothing is
    reset or closed; what arrives meanwhile is held and delivered once forwarding resumes,
    as TCP retransmits it when the network comes back.

    The proxy's own sockets acknowledge every byte and answer the kernel's keepalives, so to
    the client the silence is a server that stopped answering mid-statement: only the
    client's own timeouts end its wait."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets = _Sockets()
        # Set while bytes flow that way.
        self._to_server = threading.Event()
        self._to_client = threading.Event()
        self._silence_when: Callable[[bytes], bool] | None = None
        self.resume()
        threading.Thread(target=_accept, args=(self.listener, self._connect), daemon=True).start()

    def silence(self, *, to_server: bool = True, to_client: bool = True) -> None:
        """Stop forwarding towards the server, the client or both."""
        if to_server:
            self._to_server.clear()
        if to_client:
            self._to_client.clear()

    def silence_before(self, condition: Callable[[bytes], bool]) -> None:
        """Silence both ways once a client sends data for which ``condition`` holds (that
        data held too): a network lost between a connection's start and its statement."""
        self._silence_when = condition

    def _client_sent(self, data: bytes) -> None:
        condition = self._silence_when
        if condition is not None and condition(data):
            self._silence_when = None
            self.silence()

    def resume(self) -> None:
        self._to_server.set()
        self._to_client.set()

    def _connect(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        if not self._sockets.keep(client, server):
            return
        threading.Thread(target=_forward,
                         args=(client, server, self._to_server, self._client_sent),
                         daemon=True).start()
        threading.Thread(target=_forward, args=(server, client, self._to_client),
                         daemon=True).start()

    def close(self) -> None:
        self.resume()
        self._sockets.close(self.listener)


def _forward(source: socket.socket, sink: socket.socket, flowing: threading.Event,
             on_data: Callable[[bytes], None] | None = None) -> None:
    """Copy ``source`` to ``sink`` while ``flowing`` is set; an end passes on as an end."""
    try:
        while data := source.recv(65536):
            if on_data is not None:
                on_data(data)
            flowing.wait()
            sink.sendall(data)
        flowing.wait()
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        return


@contextlib.contextmanager
def silenceable_proxy(db_url: str) -> Iterator[tuple[SilenceableProxy, str]]:
    """A silenceable proxy to ``db_url``'s server and the URL that goes through it."""
    with _proxied(db_url, SilenceableProxy) as pair:
        yield pair
