"""systemd's notification protocol (``Type=notify``): a datagram to ``$NOTIFY_SOCKET``.

Only the supervisor sends (the unit sets ``NotifyAccess=main``). Without ``$NOTIFY_SOCKET``
(not started by systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # An address starting with @ is in the abstract namespace: a leading NUL byte.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        watchdog_usec = os.environ.get("WATCHDOG_USEC", "")
        watchdog_pid = os.environ.get("WATCHDOG_PID", "")
        enabled = watchdog_usec.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid()))
        # Ping at half the watchdog timeout, as sd_watchdog_enabled(3) recommends.
        self.watchdog_interval = int(watchdog_usec) / 2e6 if enabled else None

    def send(self, **fields: str | int) -> None:
        if not self.address:
            return
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(message.encode("utf-8"), self.address)
            except OSError:
                # systemd going away must not take the daemon with it.
                pass

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status)

    def reloading(self) -> None:
        self.send(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str) -> None:
        self.send(stopping=1, status=status)

    def status(self, status: str) -> None:
        self.send(status=status)

    def watchdog(self) -> None:
        self.send(watchdog=1)
