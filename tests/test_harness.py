"""The test harness's last fallback, a testcontainers PostgreSQL, can be reached at all."""

from __future__ import annotations

import socket
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


@pytest.mark.parametrize("kind", ["CuttingProxy", "SilenceableProxy", "SilentServer"])
def test_a_closed_proxy_takes_no_more_connections(kind: str) -> None:
    """A plain close() of the listener left the proxy's accepting thread in ``accept()``,
    still listening: a daemon reconnecting while its test ended got one more connection,
    whose sockets nobody closed (a ResourceWarning, an error of whichever test came next)."""
    import netcut

    with socket.create_server(("127.0.0.1", 0)) as upstream:
        address = ("127.0.0.1", upstream.getsockname()[1])
        proxy = netcut.SilentServer() if kind == "SilentServer" else getattr(netcut, kind)(address)
        proxy.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
