"""The metrics endpoint: prometheus-client's WSGI application behind a server of our own.

prometheus-client's ``start_http_server`` starts a thread for every connection and never
times one out. Each connection that sends nothing (a port scanner, a half-open client, a
deliberate slow sender) then holds a thread of the supervisor's process for good, and
enough of them reach the task limit systemd puts on the unit (``TasksMax``), which the
workers' processes and handler threads count against too: the node stops spawning workers.
So here a connection has ``timeout`` seconds for its request and the answer, and at most
``max_connections`` are served at once; one beyond that is closed at once (Prometheus
retries at its next scrape).

``HEAD`` is answered as ``GET`` without the body: load balancers and uptime checks probe with
it, and prometheus-client's application answers it 405.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from jobd.errors import JobdError, UsageError

# Listen failures that may pass: the port held by another process, the address not up yet.
_NOT_YET = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL})

SCRAPE_TIMEOUT = 10.0  # seconds: Prometheus's default scrape timeout
MAX_CONNECTIONS = 16  # served at once: Prometheus servers, a person with curl

_LISTEN = re.compile(r"^\[?(?P<host>[^\[\]]+?)\]?:(?P<port>\d+)$")


def _answering_head(app: WSGIApplication) -> WSGIApplication:
    """``app``, with HEAD answered as GET: the same status and headers (Content-Length that
    of the body a GET gets), no body. Allow names HEAD too (OPTIONS, a refused method)."""

    def application(environ: WSGIEnvironment,
                    start_response: StartResponse) -> Iterable[bytes]:
        head = environ.get("REQUEST_METHOD") == "HEAD"
        answer: list[tuple[str, list[tuple[str, str]]]] = []

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers = [(name, _with_head(value) if name.lower() == "allow" else value)
                       for name, value in headers]
            if head:
                answer.append((status, headers))
                return lambda _data: None  # the body is not sent
            return start_response(status, headers, exc_info)

        if not head:
            return app(environ, start)
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, start))
        [(status, headers)] = answer
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        return []

    return application


def _with_head(allow: str) -> str:
    return allow if "HEAD" in allow.split(",") else f"{allow},HEAD"


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line on stderr per scrape is noise in the daemon's log


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds up the daemon's exit
    request_queue_size = 64  # the listen backlog (socketserver's default is 5)
    block_on_close = False
    max_connections = MAX_CONNECTIONS

    def server_bind(self) -> None:
        super().server_bind()
        self.slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


@dataclass
class Server:
    """The endpoint on its own thread, serving one collector."""

    listen: str
    collector: Collector
    timeout: float = SCRAPE_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    handle: tuple[WSGIServer, threading.Thread] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Bind and serve; UsageError (one line) when the address cannot be had."""
        match = _LISTEN.match(self.listen)
        assert match is not None  # checked when the config was read
        host, port = match["host"], int(match["port"])
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        try:
            server = make_server(host, port, _answering_head(make_wsgi_app(registry)),
                                 self._server_class(host, port),
                                 handler_class=self._handler_class())
        except OSError as exc:
            message = f"metrics.listen {self.listen}: cannot listen: {exc.strerror or exc}"
            if exc.errno in _NOT_YET:
                # Not the config's fault: another process holds the port (an old daemon still
                # stopping), or the address is not up yet at boot. A runtime failure (exit
                # code 1), which systemd's Restart=on-failure tries again; exit code 2 is in
                # the unit's RestartPreventExitStatus.
                raise JobdError(message) from None
            raise UsageError(message) from None
        thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
        thread.start()
        self.handle = (server, thread)

    def stop(self) -> None:
        if self.handle is not None:
            server, thread = self.handle
            server.shutdown()
            server.server_close()
            thread.join(timeout=5.0)
            self.handle = None

    def _server_class(self, host: str, port: int) -> type[_BoundedServer]:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as exc:
            raise UsageError(f"metrics.listen {self.listen}: cannot listen: {exc}") from None
        return type("MetricsServer", (_BoundedServer,),
                    {"address_family": family, "max_connections": self.max_connections})

    def _handler_class(self) -> type[_Handler]:
        # StreamRequestHandler applies `timeout` to the connection's socket.
        return type("MetricsHandler", (_Handler,), {"timeout": self.timeout})
