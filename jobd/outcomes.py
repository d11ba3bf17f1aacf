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


# In the traceback, an exception's own lines (its type and message) beyond this many
# characters are cut: the headline carries the message, and the traceback's frames, which
# say where it was raised, must not be pushed out of the text that is kept.
MAX_MESSAGE_IN_TRACEBACK = 500
# A group's headline names at most this many of the exceptions it holds.
GROUP_LEAVES_NAMED = 3


def format_error(exc: BaseException) -> str:
    """The text stored as a failed attempt's error: the exception's headline, then its
    traceback, each at most MAX_ERROR_CHARS, and always storable: PostgreSQL text cannot hold
    NUL or lone surrogates, and an exception whose ``__str__`` fails still fails its job
    rather than the worker thread that ran it.

    The headline is the first line (what ``jobd jobs show`` and the log print): for an
    exception group (``asyncio.TaskGroup``) it also names the exceptions the group holds. The
    traceback keeps its end, where the innermost frames are; an exception's message is cut
    short in it, so a long one (a response body) leaves room for the frames."""
    headline = _headline(exc)
    try:
        text = _shortened("".join(traceback.format_exception(exc)), exc)
    except Exception:
        # As above, the user's exception is at fault, not the job's outcome: the headline
        # (which says what could not be formatted, if that was it) stands for the text.
        text = headline
    headline, text = _storable(headline)[:MAX_ERROR_CHARS], _storable(text)
    if len(text) > MAX_ERROR_CHARS:
        text = text[-MAX_ERROR_CHARS:]
    return f"{headline}\n{text}" if text.strip() != headline else headline


def _headline(exc: BaseException) -> str:
    headline = _one_line(exc)
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        named = "; ".join(_one_line(leaf).split("\n", 1)[0]
                          for leaf in leaves[:GROUP_LEAVES_NAMED])
        more = len(leaves) - GROUP_LEAVES_NAMED
        headline += f": {named}" + (f"; and {more} more" if more > 0 else "")
    return headline


def _one_line(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception as broken:
        return f"{type(exc).__name__} (its message could not be formatted: {broken!r})"


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions a group holds, nested groups opened, in order."""
    found: list[BaseException] = []
    for inner in group.exceptions:
        found.extend(_leaves(inner) if isinstance(inner, BaseExceptionGroup) else [inner])
    return found


def _shortened(text: str, exc: BaseException) -> str:
    """``text`` (the formatted traceback of ``exc``) with the long messages of ``exc`` and of
    the exceptions chained to it cut to MAX_MESSAGE_IN_TRACEBACK characters."""
    for chained in _chain(exc):
        try:
            lines = "".join(traceback.format_exception_only(chained))
        except Exception:
            continue
        if len(lines) > MAX_MESSAGE_IN_TRACEBACK:
            cut = (lines[:MAX_MESSAGE_IN_TRACEBACK]
                   + f"... [{len(lines) - MAX_MESSAGE_IN_TRACEBACK} more characters]\n")
            text = text.replace(lines, cut)
    return text


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from or while handling, as a traceback shows them."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and not any(current is s for s in seen):
        seen.append(current)
        current = current.__cause__ or (None if current.__suppress_context__
                                        else current.__context__)
    return seen


def first_line_of(text: str) -> str:
    """The headline of an error text (format_error puts it first)."""
    return text.split("\n", 1)[0]


def _storable(text: str) -> str:
    return (text.replace("\x00", "\\x00")
            .encode("utf-8", "backslashreplace").decode("utf-8"))

