"""How a run ends: the :class:`Outcome` a worker's handler runners hand to its loop, the
error text stored with a failed attempt, and the lane's timeout for an ``async def``
handler. The text and the timeout are shared with ``jobd.testing``, so a test records a
failure exactly as a worker would."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from jobd import jobs

MAX_ERROR_CHARS = 4000

# The error recorded for an async handler that ended with the CancelledError it was given.
CANCELLED_ERROR = "CancelledError: the job was asked to stop (jobd.cancel)"

Result = TypeVar("Result")


@dataclass(slots=True)
class Outcome:
    job: jobs.Job
    error: str | None  # None: success
    committed: bool = False  # a transactional handler already completed the job
    # A transactional handler's commit archived the job as cancelled (it was asked to stop).
    cancelled: bool = False
    lease_lost: bool = False  # the lease was lost before the commit; nothing was written
    final: bool = False  # the failure cannot be retried away (an undecodable payload)
    # How long the handler ran (monotonic seconds); None when the worker gave up on it at
    # its timeout (the run then lasted the timeout, at least).
    seconds: float | None = None


def failed(job: jobs.Job, exc: BaseException) -> Outcome:
    """The outcome of a run that raised ``exc``; final for an undecodable payload, which
    would fail every attempt the same way (to the dead-letter queue at once)."""
    return Outcome(job, error_text(exc), final=job.undecodable)


class JobTimedOut(Exception):
    """An async handler overran the lane's timeout and was cancelled."""


async def within_timeout(run: Awaitable[Result], timeout: float) -> Result:
    """Await ``run`` under the lane's ``timeout``: JobTimedOut when our deadline passed, the
    handler's own TimeoutError when it raised one itself. A handler that returns after the
    deadline timed out too: it swallowed the cancel, or blocked the event loop so that the
    cancel never came."""
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            result = await run
    except TimeoutError:
        if scope.expired():
            raise JobTimedOut(f"timed out after {timeout:g}s") from None
        raise
    deadline = scope.when()
    if scope.expired() or (deadline is not None
                           and asyncio.get_running_loop().time() >= deadline):
        raise JobTimedOut(f"timed out after {timeout:g}s")
    return result


def error_text(exc: BaseException) -> str:
    """What a failure records: the deadline alone for a timeout, else :func:`format_error`."""
    return str(exc) if isinstance(exc, JobTimedOut) else format_error(exc)


def format_error(exc: BaseException) -> str:
    """The text stored as a failed attempt's error: the exception's headline, then its
    traceback, each at most MAX_ERROR_CHARS, and always storable: PostgreSQL text cannot hold
    NUL or lone surrogates, and an exception whose ``__str__`` fails still fails its job
    rather than the worker thread that ran it."""
    try:
        headline = f"{type(exc).__name__}: {exc}"
    except Exception as broken:
        headline = f"{type(exc).__name__} (its message could not be formatted: {broken!r})"
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:
        # As above, the user's exception is at fault, not the job's outcome: the headline
        # (which says what could not be formatted, if that was it) stands for the text.
        text = headline
    headline, text = _storable(headline)[:MAX_ERROR_CHARS], _storable(text)
    if len(text) > MAX_ERROR_CHARS:
        text = text[-MAX_ERROR_CHARS:]
    return f"{headline}\n{text}" if text.strip() != headline else headline


def first_line_of(text: str) -> str:
    """The headline of an error text (format_error puts it first)."""
    return text.split("\n", 1)[0]


def _storable(text: str) -> str:
    return (text.replace("\x00", "\\x00")
            .encode("utf-8", "backslashreplace").decode("utf-8"))

