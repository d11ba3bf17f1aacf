"""Running the ``jobd`` command line as a subprocess, for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres"
TIMEOUT = 60
JOBD = [sys.executable, "-m", "jobd"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without jobd's own variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("JOBD_DATABASE_URL", "JOBD_CONFIG")}
    return {**env, **extra}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobd", *args], capture_output=True, text=True,
                          env=env or clean_env(), timeout=TIMEOUT)


def ok(*args: str) -> str:
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The command failed with ``code``, one line on stderr, no traceback; returns the line."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jobd")
    return lines[0]
