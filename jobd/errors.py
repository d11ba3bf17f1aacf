"""Exceptions that carry a user-facing message and decide the CLI's exit code."""

from __future__ import annotations


class JobdError(Exception):
    """A failure at run time (exit code 1): the database refused, a job vanished..."""

    exit_code = 1


class UsageError(JobdError):
    """Bad input from the user: a malformed argument, config or payload (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """The configuration file is invalid; the message names the file and line."""


class InvalidDatabaseUrl(UsageError):
    """A database URL that libpq refuses before connecting: it does not parse, or an
    option's value is invalid (a port that is no number, an unknown sslmode)."""


class DatabaseUnavailable(JobdError):
    """The database could not be reached with the URL given (exit code 1, a runtime
    failure: a script may retry; the message says whether the server refused, was not
    there, or rejected the role or database)."""


def printable(text: str) -> str:
    """``text`` with each character that is not printable (a newline, a carriage return,
    U+0085...) written as its escape: a message that echoes a user's input stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
