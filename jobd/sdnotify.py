"""systemd's notification protocol (``Type=notify``): a datagram to ``$NOTIFY_SOCKET``.

Only the supervisor sends (the unit sets ``NotifyAccess=main``). Without ``$NOTIFY_SOCKET``
(not started by systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time

RETRY_INTERVAL = 0.1  # seconds between attempts to deliver a state change


class Notifier:
    """Sends without ever blocking: the supervisor's loop must not stall on a slow or absent
    reader (``$NOTIFY_SOCKET``'s datagram queue is short). A ``STATUS=`` that does not fit is
    dropped (the next one says the same); a ``WATCHDOG=1`` that does not fit is the caller's
    to retry (:meth:`watchdog` says so: dropped, the next ping came a whole interval later,
    with no margin left); state changes (``READY=1``, ``RELOADING=1``, ``STOPPING=1``) are
    kept and retried by :meth:`flush`, in order."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # An address starting with @ is in the abstract namespace: a leading NUL byte.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        watchdog_usec = os.environ.get("WATCHDOG_USEC", "")
        watchdog_pid = os.environ.get("WATCHDOG_PID", "")
        enabled = watchdog_usec.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid()))
        # Ping at a quarter of the watchdog timeout (sd_watchdog_enabled(3) says half at
        # most): a ping the reader could not take is retried, and one turn of the loop may be
        # long while the database stalls (statements bounded by their timeouts).
        self.watchdog_interval = int(watchdog_usec) / 4e6 if enabled else None
        self.pending: list[bytes] = []  # state changes not delivered yet, oldest first
        self._socket: socket.socket | None = None

    def send(self, **fields: str | int) -> None:
        """Send a message that may be dropped when the reader cannot take it now."""
        self._send(self._encode(fields), keep=False)

    def _encode(self, fields: dict[str, str | int]) -> bytes:
        return "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()

    def _send(self, message: bytes, keep: bool) -> None:
        if not self.address:
            return
        if self.pending and keep:
            self.pending.append(message)  # behind the ones already waiting, in order
            return
        if self._deliver(message) == "busy" and keep:
            self.pending.append(message)

    def _deliver(self, message: bytes) -> str:
        """"sent"; "busy" when the reader's queue is full (worth a retry); "gone" when
        there is no reader (systemd went away: retrying would only spin)."""
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(message, self.address)
            return "sent"
        except (BlockingIOError, InterruptedError):
            return "busy"
        except OSError:
            # systemd going away must not take the daemon with it; a new socket next time.
            self.close()
            return "gone"

    def flush(self) -> None:
        """Retry the state changes that did not fit; the loop calls this each turn."""
        while self.pending:
            if self._deliver(self.pending[0]) == "busy":
                return
            self.pending.pop(0)

    def retry_at(self, now: float) -> float | None:
        """When the loop should next call :meth:`flush` (monotonic), or None."""
        return now + RETRY_INTERVAL if self.pending else None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def ready(self, status: str) -> None:
        self._send(self._encode({"ready": 1, "status": status}), keep=True)

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(self._encode({"reloading": 1, "monotonic_usec": usec}), keep=True)

    def stopping(self, status: str, extend_timeout: float | None = None) -> None:
        """``STOPPING=1``; with ``extend_timeout`` (seconds) ``EXTEND_TIMEOUT_USEC=`` too: systemd
        (236 and later; older ones ignore it) then gives the stop that long from the message's
        arrival before its own ``TimeoutStopSec`` kills the unit. It only ever lengthens the
        timeout, so a longer ``TimeoutStopSec`` still holds."""
        fields: dict[str, str | int] = {"stopping": 1, "status": status}
        if extend_timeout is not None:
            fields["extend_timeout_usec"] = round(extend_timeout * 1_000_000)
        self._send(self._encode(fields), keep=True)

    def status(self, status: str) -> None:
        self.send(status=status)

    def watchdog(self) -> bool:
        """Ping; False when the reader could not take it now (retry soon)."""
        if not self.address:
            return True
        return self._deliver(self._encode({"watchdog": 1})) != "busy"
