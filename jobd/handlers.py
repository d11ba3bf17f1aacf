"""Resolving the config's handler allow-list (``name: module:function``) to callables.

Workers resolve their handlers at start. Before the supervisor starts workers or applies a
reloaded config it runs ``python -m jobd.handlers`` in a fresh process, so a handler that
cannot be imported is refused up front instead of crash-looping workers, and user code is
never imported into the supervisor itself.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Handler = Callable[..., Any]

TRANSACTIONAL_ATTRIBUTE = "__jobd_transactional__"
_SIGNALS = frozenset(s.value for s in signal.Signals)


class HandlerImportError(Exception):
    """A handler's import path does not lead to a handler jobd can run."""


def transactional(func: Handler) -> Handler:
    """Mark a handler as transactional: it is called as ``handler(job, conn)``."""
    setattr(func, TRANSACTIONAL_ATTRIBUTE, True)
    return func


@dataclass(frozen=True, slots=True)
class ResolvedHandler:
    name: str
    func: Handler
    is_async: bool
    is_transactional: bool


# What an import path names: a job handler (config ``handlers``) or an outbox sender
# (``outbox.senders``). The two maps may use the same name; the kind tells them apart.
HANDLER = "handler"
SENDER = "outbox sender"


@dataclass(frozen=True, slots=True)
class ImportPath:
    """One entry of the config to import-check: its kind, name and ``module:function``."""

    kind: str
    name: str
    path: str


def resolve(name: str, path: str, kind: str = HANDLER) -> ResolvedHandler:
    module_name, _, attribute_path = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            target = getattr(target, attribute)
    except Exception as exc:
        raise HandlerImportError(
            f"{kind} {name!r} ({path}) cannot be imported: {type(exc).__name__}: {exc}"
            f"{_where(exc)}") from exc
    if not callable(target):
        raise HandlerImportError(f"{kind} {name!r} ({path}) is not callable")
    return resolved(name, target, kind, path)


_IMPORTLIB = os.path.dirname(importlib.__file__) + os.sep


def _where(exc: BaseException) -> str:
    """Where the application's code raised ``exc`` while it was imported: its innermost
    frame outside the import machinery and this module (a NameError in a module's body, an
    import of a package not installed), as " (at FILE, line N)"; empty for an error of the
    path itself (no such module, no such attribute), which the message names already. A
    SyntaxError names its file without the directory: it gets the whole path."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}, line {exc.lineno})"
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith(("<", _IMPORTLIB))
              and frame.filename != __file__]
    if not frames:
        return ""
    return f" (at {frames[-1].filename}, line {frames[-1].lineno})"


def resolved(name: str, target: Handler, kind: str = HANDLER, path: str | None = None
             ) -> ResolvedHandler:
    """A callable as a handler (or outbox sender) named ``name``: async or not,
    transactional or not, and able to take the arguments it is called with."""
    # A class instance with an ``async def __call__`` is an async handler too, and so is an
    # ``async def`` behind a plain decorator that kept it as ``__wrapped__`` (functools.wraps).
    is_async = any(inspect.iscoroutinefunction(candidate) for candidate in (
        target, type(target).__call__, inspect.unwrap(target)))
    is_transactional = bool(getattr(target, TRANSACTIONAL_ATTRIBUTE, False))
    if any(inspect.isgeneratorfunction(candidate) or inspect.isasyncgenfunction(candidate)
           for candidate in (target, inspect.unwrap(target))):
        raise HandlerImportError(
            f"handler {name!r} is a generator function (its body holds a yield): calling it "
            f"runs none of its body, so no job of it would ever do anything")
    if is_async and is_transactional:
        # Its transaction is a psycopg (sync) connection's, committed on a handler thread.
        raise HandlerImportError(
            f"handler {name!r} is async and @jobd.transactional: a transactional handler "
            f"runs on a thread with a sync connection; write it as a plain def")
    _check_arguments(f"{kind} {name!r}" + (f" ({path})" if path else ""), target, kind,
                     is_transactional)
    return ResolvedHandler(name, target, is_async, is_transactional)


def _check_arguments(label: str, target: Handler, kind: str, is_transactional: bool) -> None:
    """Refuse a callable that cannot take what it is called with (the wrong function named,
    a transactional handler without ``conn``): every job of it would fail with a TypeError
    until the dead-letter queue. The callable's own signature is read, not the one a
    decorator's ``functools.wraps`` shows, since the wrapper is what gets called."""
    arguments: tuple[str, ...] = (
        ("entry",) if kind == SENDER else ("job", "conn") if is_transactional else ("job",))
    try:
        signature = inspect.signature(target, follow_wrapped=False)
    except (TypeError, ValueError):
        return  # no signature to read (a callable of an extension module): its call tells
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        call = f"{'sender' if kind == SENDER else 'handler'}({', '.join(arguments)})"
        hint = _transactional_hint(signature, kind, is_transactional)
        raise HandlerImportError(f"{label} cannot be called as {call}: {exc}{hint}") from None


def _transactional_hint(signature: inspect.Signature, kind: str, is_transactional: bool
                        ) -> str:
    """A plain handler that would take ``(job, conn)`` most likely lacks its decorator."""
    if kind == SENDER or is_transactional:
        return ""
    try:
        signature.bind("job", "conn")
    except TypeError:
        return ""
    return " (a handler that takes the job's connection needs @jobd.transactional)"


def check_ran(name: str, result: object) -> None:
    """A sync handler returned ``result``. An awaitable means its body never ran (an async
    function behind a wrapper that hid it): that fails the job rather than count it done.
    So does a generator (a ``yield`` in the body, behind a wrapper that hid it): its body
    runs only as it is iterated, and nothing iterates it."""
    if result is None:  # first: it is 5 x cheaper than the checks below
        return
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        kind = "a generator" if inspect.isgenerator(result) else "an async generator"
        if inspect.isgenerator(result):
            result.close()
        raise TypeError(
            f"handler {name!r} returned {kind} instead of running: a function with a "
            f"yield in its body runs none of it when called; do the work and return")
    if not inspect.isawaitable(result):
        return
    if inspect.iscoroutine(result):
        result.close()  # no "never awaited" warning: the job's error says it
    raise TypeError(
        f"handler {name!r} returned {type(result).__name__} instead of running: an async "
        f"function behind a plain decorator; declare the decorator's wrapper async def, or "
        f"apply functools.wraps so jobd sees the async function")


def resolve_all(paths: Mapping[str, str], kind: str = HANDLER) -> dict[str, ResolvedHandler]:
    return {name: resolve(name, path, kind) for name, path in paths.items()}


# Written to stderr by the check before each import, so that a check that dies in an import
# (a crash in an extension module, os._exit, the OOM killer) or hangs there is reported
# with the entry it was importing, not with whatever stderr happened to end with.
_IMPORTING = "jobd handler check: importing "


class HandlerCheck:
    """``python -m jobd.handlers`` importing ``paths`` in a fresh interpreter, in the
    background: the supervisor's loop polls it instead of waiting, so a slow import never
    holds up the running lanes. Output goes to temporary files, not pipes, so user code that
    prints a lot at import cannot block on a full pipe. ``paths`` is a list, not a map by
    name: a handler and an outbox sender may share a name, and each must be checked."""

    def __init__(self, paths: Sequence[ImportPath], timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        # Closed by _close() once the verdict is read; the check outlives this call.
        self._stdout = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        with tempfile.TemporaryFile("w+") as stdin:
            stdin.write(json.dumps([[p.kind, p.name, p.path] for p in paths]))
            stdin.seek(0)
            # Born with SIGHUP held (a blocked signal stays blocked across exec): a SIGHUP
            # sent to the daemon's process group (a terminal that closes) would otherwise end
            # the check, which reads as a handler that cannot be imported: at boot, exit
            # code 3. The supervisor takes the group's SIGHUP as a reload.
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "jobd.handlers"], stdin=stdin, stdout=self._stdout,
                    stderr=self._stderr, text=True)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self.problems: list[str] | None = None

    def poll(self) -> list[str] | None:
        """None while it runs; then one message per handler that cannot be imported."""
        if self.problems is not None:
            return self.problems
        if self.process.poll() is None:
            if time.monotonic() < self.deadline:
                return None
            self.process.kill()
            self.process.wait()
            entry, _after = self._last_import()
            self.problems = [f"importing the handlers took longer than {self.timeout:g}s"
                             + (f" (still importing {entry})" if entry else "")]
            self._close()
            return self.problems
        self.problems = self._verdict()
        self._close()
        return self.problems

    def wait(self) -> list[str]:
        try:
            self.process.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # poll() below says it: still running past the deadline, it is killed
        problems = self.poll()
        return problems if problems is not None else self.cancel()

    def cancel(self) -> list[str]:
        self.process.kill()
        self.process.wait()
        self._close()
        self.problems = self.problems or ["the handler check was cancelled"]
        return self.problems

    def _verdict(self) -> list[str]:
        self._stdout.seek(0)
        self._stderr.seek(0)
        lines = self._stdout.read().strip().splitlines()
        try:
            problems = json.loads(lines[-1]) if lines else None
            if not isinstance(problems, list):
                raise ValueError
        except ValueError:
            return [self._died()]
        return [str(problem) for problem in problems]

    def _died(self) -> str:
        """The check ended without its verdict: what it was importing, how it ended, and
        the last line that import wrote to stderr, if any."""
        code = self.process.returncode
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in _SIGNALS
               else f"exit code {code}")
        entry, after = self._last_import()
        if entry is None:
            return f"the handler check failed ({how}) before importing anything"
        return (f"{entry} ended the handler check at import ({how})"
                + (f": {after[-1]}" if after else ""))

    def _last_import(self) -> tuple[str | None, list[str]]:
        """The entry the check announced last ("handler 'x' (module:function)"), and the
        non-empty stderr lines written after that announcement."""
        self._stderr.seek(0)
        entry: str | None = None
        after: list[str] = []
        for line in self._stderr.read().splitlines():
            if line.startswith(_IMPORTING):
                entry, after = line.removeprefix(_IMPORTING), []
            elif line.strip():
                after.append(line.strip())
        return entry, after

    def _close(self) -> None:
        self._stdout.close()
        self._stderr.close()


def check_in_subprocess(paths: Sequence[ImportPath], timeout: float = 60.0) -> list[str]:
    """Import every handler in a fresh interpreter and wait; one message per failure."""
    if not paths:
        return []
    return HandlerCheck(paths, timeout).wait()


def _check_main() -> int:
    paths = json.load(sys.stdin)
    problems = []
    for kind, name, path in paths:
        sys.stderr.write(f"\n{_IMPORTING}{kind} {name!r} ({path})\n")
        sys.stderr.flush()
        try:
            resolve(name, path, kind)
        except HandlerImportError as exc:
            problems.append(str(exc))
        except BaseException as exc:  # a module that calls sys.exit() at import, say
            problems.append(f"{kind} {name!r} ({path}) failed at import: "
                            + traceback.format_exception_only(exc)[-1].strip() + _where(exc))
    # Imported user code may have printed to stdout; the verdict is the last line.
    sys.stdout.write("\n" + json.dumps(problems) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_check_main())
