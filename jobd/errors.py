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


class DatabaseUnavailable(UsageError):
    """The database could not be reached with the URL given (exit code 2: fix the URL)."""
