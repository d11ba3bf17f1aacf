"""The select loop the supervisor and each worker sleep in, with signals as events.

Signal handlers only record the signal number (after gunicorn's arbiter: no logging, I/O or
locking inside a handler); ``signal.set_wakeup_fd`` makes the pending ``select`` return, and
the owner takes the recorded signals off the list in its own loop.
"""

from __future__ import annotations

import os
import selectors
import signal
from collections.abc import Callable, Iterable

from jobd import pipes


class SelectLoop:
    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._signals: list[int] = []
        self._signal_r, self._signal_w = os.pipe()
        for fd in (self._signal_r, self._signal_w):
            os.set_blocking(fd, False)

    def install_signals(self, handled: Iterable[int], ignored: Iterable[int] = ()) -> None:
        signal.set_wakeup_fd(self._signal_w)
        for signum in handled:
            signal.signal(signum, self._record)
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)
        self.register(self._signal_r, pipes.drain)

    def _record(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def pending_signals(self) -> list[int]:
        """The signals recorded and not taken yet, oldest first (they stay recorded)."""
        return list(self._signals)

    def take_signals(self) -> list[int]:
        """The signals recorded since the last call, oldest first."""
        taken, self._signals = self._signals, []
        return taken

    def register(self, fd: int, on_readable: Callable[[int], None]) -> None:
        self.selector.register(fd, selectors.EVENT_READ, on_readable)

    def unregister(self, fd: int) -> None:
        """Forget ``fd``; one that was never registered (or closed meanwhile) is fine."""
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def wait(self, timeout: float) -> None:
        """Sleep until a registered fd is readable, a signal arrives or ``timeout`` passes,
        then call the callbacks of the readable fds."""
        for key, _events in self.selector.select(max(0.0, timeout)):
            key.data(key.fd)
