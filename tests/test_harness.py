"""The test harness's last fallback, a testcontainers PostgreSQL, can be reached at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def test_the_container_fallback_imports_without_a_warning() -> None:
    """The suite runs with warnings as errors: a deprecation warning on the import of
    testcontainers' PostgresContainer made the fallback fail before it asked Docker."""
    pytest.importorskip("testcontainers")
    # A fresh interpreter: a module imported earlier in this run would not warn again.
    probe = ("import sys, warnings; sys.path.insert(0, sys.argv[1]); "
             "warnings.simplefilter('error'); import conftest; "
             "print(conftest.postgres_container_class().__name__)")
    result = subprocess.run([sys.executable, "-c", probe, str(TESTS)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "PostgresContainer"
