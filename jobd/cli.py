"""The ``jobd`` command line's entry point (:func:`main`): it parses the arguments, builds the
:class:`Context` every subcommand receives and maps errors to exit codes. It only wires
arguments to the modules that do the work.

Exit codes: 0 ok, 1 runtime failure, 2 usage or input error (one line on stderr, no traceback).

The parser is in :mod:`jobd.cli_parser`; the subcommands are in :mod:`jobd.commands`
(run, migrate, enqueue, top), :mod:`jobd.commands_jobs` (status, jobs, dlq) and
:mod:`jobd.commands_schedules`; what they print is formatted by :mod:`jobd.cli_output`.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from collections.abc import Callable, Sequence

import psycopg

from jobd import grants
from jobd.cli_context import Context
from jobd.cli_parser import build_parser, version
from jobd.config import Config, load
from jobd.db import first_line, resolve_url, validate_schema
from jobd.errors import JobdError, UsageError
from jobd.migrate import MigrationMismatch

__all__ = ["Context", "build_parser", "main", "version"]


def _context(args: argparse.Namespace) -> Context:
    config_path = args.config or _environment("JOBD_CONFIG")
    config = load(config_path) if config_path else Config()
    schema = validate_schema(args.schema or config.schema)
    url = resolve_url(args.database_url, _environment("JOBD_DATABASE_URL"), config.database_url)
    return Context(config=config, url=url, schema=schema, as_json=args.json)


def _environment(name: str) -> str | None:
    """A variable of the environment, None when unset. Set but empty is refused, as an empty
    ``--database-url`` or ``-c`` is: ``JOBD_DATABASE_URL=$PROD_URL`` with PROD_URL unset
    would otherwise reach the next source (the config's URL, else the local default), the
    wrong database without a word."""
    value = os.environ.get(name)
    if value is not None and not value.strip():
        raise UsageError(f"${name} is set but empty: give it a value, or unset it")
    return value


# Arguments that are file names, not text for the database: any bytes the file system holds.
_PATH_ARGUMENTS = frozenset({"config"})


def _refuse_unstorable_text(args: argparse.Namespace) -> None:
    """PostgreSQL text cannot hold NUL, nor bytes that are not UTF-8 (Python decodes those
    into lone surrogates, which psycopg cannot encode): either would fail mid-command, so it
    is refused before anything runs, naming the argument."""
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        # --where pairs are (key, value) tuples; a payload (already JSON) is checked apart.
        texts = [t for v in values for t in (v if isinstance(v, tuple) else (v,))
                 if isinstance(t, str)]
        if any("\x00" in v for v in texts):
            raise UsageError(f"{dest.replace('_', '-')}: NUL characters are not allowed")
        if dest not in _PATH_ARGUMENTS and any(not _is_utf8(v) for v in texts):
            raise UsageError(f"{dest.replace('_', '-')}: not valid UTF-8 text")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# SQLSTATEs that mean the database refused the user's input rather than failed: class 22
# (data exception: a value out of range, invalid text, a check in jobd.enqueue), a CHECK
# constraint (23514) and a value over a limit such as an index entry's size (54000).
_INPUT_SQLSTATES = ("23514", "54000")


def _is_input_error(exc: psycopg.Error) -> bool:
    state = exc.sqlstate or ""
    return (isinstance(exc, psycopg.DataError) or state.startswith("22")
            or state in _INPUT_SQLSTATES)


def _server_message(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or first_line(exc)


# Options whose value may start with '-' followed by a digit (`--delay -5s`): argparse takes
# such a token for an option and says "expected one argument". Joined to its option, the
# value reaches the option's own check, which says what is wrong with it.
_SIGNED_VALUE_OPTIONS = frozenset({"--delay", "--before", "--interval"})


def _join_signed_values(argv: Sequence[str]) -> list[str]:
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":  # the rest is positional
            joined.append(token)
            joined.extend(tokens)
            break
        if token in _SIGNED_VALUE_OPTIONS:
            value = next(tokens, None)
            if value is not None and value[:1] == "-" and value[1:2].isdigit():
                joined.append(f"{token}={value}")
                continue
            joined.extend([token] if value is None else [token, value])
            continue
        joined.append(token)
    return joined


def _missing_schema(ctx: Context | None, schema: str) -> str:
    """What a statement that found none of jobd's tables means: the schema is missing (or
    older), or it is there and the role may not use it (then its names look missing too)."""
    missing = f"{schema} is missing or incomplete in this database; run `jobd migrate` first"
    return _usage_problem(ctx) or missing


def _refused(ctx: Context | None, exc: psycopg.Error) -> str:
    """What a statement refused for want of a privilege means. One that names jobd's schema
    (``SELECT jobd.enqueue(...)``, ``jobd.pause``) is refused the schema itself, not a name
    in it, when the role was granted nothing: that is said as for the commands that find no
    table, naming the grant."""
    return _usage_problem(ctx) or f"database error: {first_line(exc)}"


def _usage_problem(ctx: Context | None) -> str | None:
    """Why the role may not use jobd's schema (no USAGE on it), or None."""
    if ctx is None:
        return None
    try:
        with ctx.connect() as conn:
            return grants.usage_problem(conn, ctx.schema)
    except (psycopg.Error, JobdError):
        # A second look for a better message only: the statement's own failure is what the
        # user is told about otherwise.
        return None


def _dispatch(argv: Sequence[str] | None) -> int:
    schema = "jobd's schema"  # named once the context is known
    ctx: Context | None = None
    try:
        # Parsed in here: parsing reads `--payload -` from standard input, which Ctrl-C
        # may interrupt.
        args = build_parser().parse_args(
            _join_signed_values(sys.argv[1:] if argv is None else argv))
        func: Callable[[Context, argparse.Namespace], int] = args.func
        _refuse_unstorable_text(args)
        ctx = _context(args)
        schema = f"schema {ctx.schema}"
        return func(ctx, args)
    except JobdError as exc:
        print(f"jobd: {exc}", file=sys.stderr)
        return exc.exit_code
    except MigrationMismatch as exc:
        print(f"jobd: {exc}", file=sys.stderr)
        return 1
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction,
            psycopg.errors.UndefinedColumn, psycopg.errors.InvalidSchemaName):
        # UndefinedColumn: a schema of an older jobd, whose tables lack a newer column.
        print(f"jobd: {_missing_schema(ctx, schema)}", file=sys.stderr)
        return 1
    except psycopg.errors.InsufficientPrivilege as exc:
        print(f"jobd: {_refused(ctx, exc)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        if _is_input_error(exc):
            print(f"jobd: {_server_message(exc)}", file=sys.stderr)
            return 2
        print(f"jobd: database error: {first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    _open_closed_std_streams()
    _tolerant_stdout()
    try:
        try:
            return _dispatch(argv)
        finally:
            # Flushed here, not at interpreter exit, so a closed pipe is caught below.
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`jobd jobs list | head`): that is not an error worth a
        # traceback. As the Python docs recommend, point stdout at devnull so the final
        # flush at exit cannot fail again.
        _silence_stdout()
        return 1
    except OSError as exc:
        if exc.errno not in _OUTPUT_REFUSED:
            raise
        # Output to a full disk (or /dev/full): one line, as for any failure at run time.
        print(f"jobd: cannot write the output: {exc.strerror}", file=sys.stderr)
        _silence_stdout()
        return 1


def _open_closed_std_streams() -> None:
    """Put /dev/null on descriptors 0-2 if they were closed at start (``jobd run 2>&-``,
    ``>&-``). Python then has no sys.stdout or sys.stderr: the daemon failed at its first
    record or its last flush (exit code 1). Worse, the first file or socket opened would take
    the number, and what was written to "stderr" would go into it (a database connection).
    What was to go to a closed stream is dropped instead."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            os.set_inheritable(fd, True)  # the workers' stdout and stderr too
    if sys.stdout is None:
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                          errors="backslashreplace", closefd=False)


def _tolerant_stdout() -> None:
    """Characters the output's encoding lacks (PYTHONIOENCODING=ascii, a Latin-1 locale) are
    written as escapes (\\U0001f600), as on stderr, instead of failing mid-output."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


# What a write to a file that cannot take more says.
_OUTPUT_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _silence_stdout() -> None:
    """Point stdout at devnull, so that the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
