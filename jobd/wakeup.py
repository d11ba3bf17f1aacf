"""The wake-up notifications' grammar: what enqueues send on ``<schema>_wakeup``.

A payload is ``lane#<n>`` (n jobs due now), ``lane@<epoch seconds>`` (the earliest job the
statement scheduled for later), which the supervisor turns into a timer, or
``lane!<control>``: the lane's pauses changed (``pause``), some of its running jobs were asked
to stop (``cancel``), or jobs due for a while were enqueued (``behind``: they may be below the
workers' claim floors; it comes with the ``#<n>`` that wakes them). The supervisor hears them
on its LISTEN connection (jobd.listener).
"""

from __future__ import annotations

from dataclasses import dataclass

CONTROLS = ("pause", "cancel", "behind")


@dataclass(frozen=True, slots=True)
class Wakeup:
    lane: str
    at_epoch: float | None  # None: now
    due: int = 1  # how many jobs became due (when at_epoch is None)
    control: str | None = None  # one of CONTROLS: not work, news for the lane's workers


def parse_payload(payload: str) -> Wakeup | None:
    """``lane#<due count>``, ``lane@<epoch>``, ``lane!<control>``, or a bare ``lane`` (one
    due job)."""
    if "!" in payload:
        lane, _, control = payload.partition("!")
        return Wakeup(lane, None, 0, control) if lane and control in CONTROLS else None
    if "@" in payload:
        lane, _, at = payload.partition("@")
        try:
            return Wakeup(lane, float(at)) if lane else None
        except ValueError:
            return None
    lane, sep, count = payload.partition("#")
    if not lane:
        return None
    if not sep:
        return Wakeup(lane, None)
    try:
        return Wakeup(lane, None, max(1, int(count)))
    except ValueError:
        return None


def channel_name(schema: str) -> str:
    return f"{schema}_wakeup"
