"""The systemd unit: it verifies, and its hardening scores as low exposure."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "jobd.service"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed")


def _installed_copy(tmp_path: Path) -> Path:
    # The unit names /opt/jobd/venv; verify checks that ExecStart exists, so point it at
    # this interpreter's environment.
    text = UNIT.read_text().replace("/opt/jobd/venv", sys.prefix)
    copy = tmp_path / "jobd.service"
    copy.write_text(text)
    return copy


def test_unit_verifies(tmp_path: Path) -> None:
    result = subprocess.run(["systemd-analyze", "verify", str(_installed_copy(tmp_path))],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "jobd.service" not in result.stderr, result.stderr


def test_unit_is_low_exposure(tmp_path: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(_installed_copy(tmp_path))],
        capture_output=True, text=True, cwd=tmp_path)
    match = re.search(r"Overall exposure level for jobd.service: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result.stdout[-500:] + result.stderr
    assert float(match[1]) <= 2.0, match[0]


def test_unit_declares_what_the_daemon_relies_on() -> None:
    text = UNIT.read_text()
    for setting in ("Type=notify", "NotifyAccess=main", "KillMode=mixed",
                    "ExecReload=/bin/kill -HUP $MAINPID", "RestartPreventExitStatus=3",
                    "User=jobd"):
        assert setting in text, setting
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text)[1])  # type: ignore[index]
    assert stop > 30 + 5, "TimeoutStopSec must exceed the default shutdown_timeout + kill grace"
