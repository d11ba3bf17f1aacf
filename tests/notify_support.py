"""Reading the wake-up notifications a statement sent, without waiting a while for them.

A notification committed before another one is delivered before it, to every listener. So
:func:`sent_so_far` sends one of its own on the listening connection and reads up to it:
what came before is everything committed until then, in order, duplicates included. A test
that expects none gets its answer at once, rather than after a timeout that a slow delivery
could outlast.
"""

from __future__ import annotations

import psycopg

CHANNEL = "jobd_wakeup"
SENTINEL = "jobd-tests:end-of-notifications"


def sent_so_far(listener: psycopg.Connection, channel: str = CHANNEL,
                timeout: float = 10.0) -> list[str]:
    """The payloads on ``channel`` committed since the last call, in the order sent.

    ``listener`` is an autocommit connection that LISTENs on ``channel``; fails if its own
    marker does not come back within ``timeout``."""
    listener.execute("SELECT pg_notify(%s, %s)", (channel, SENTINEL))
    own = listener.info.backend_pid
    received: list[str] = []
    for notify in listener.notifies(timeout=timeout):
        if notify.channel != channel:
            continue
        if notify.payload == SENTINEL and notify.pid == own:
            return received
        received.append(notify.payload)
    raise AssertionError(f"the marker notification did not come back within {timeout:g}s; "
                         f"received {received}")
