"""The systemd unit: it verifies, its hardening scores as low exposure, and what it points
at exists after the README's install steps."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_support import ROOT, commands, localize, section, shell_blocks

from jobd.config import Config
from jobd.supervisor import STOP_MARGIN

UNIT = ROOT / "systemd" / "jobd.service"

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed")


def _installed_copy(tmp_path: Path) -> Path:
    # The unit names /opt/jobd/venv; verify checks that ExecStart exists, so point it at
    # this interpreter's environment.
    text = UNIT.read_text().replace("/opt/jobd/venv", sys.prefix)
    copy = tmp_path / "jobd.service"
    copy.write_text(text)
    return copy


@needs_systemd_analyze
def test_unit_verifies(tmp_path: Path) -> None:
    result = subprocess.run(["systemd-analyze", "verify", str(_installed_copy(tmp_path))],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "jobd.service" not in result.stderr, result.stderr


@needs_systemd_analyze
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
                    "ExecReload=/bin/kill -HUP $MAINPID", "RestartPreventExitStatus=2 3",
                    # Its failure is left to `jobd run`, whose exit code 2 is not restarted.
                    "ExecStartPre=-/opt/jobd/venv/bin/jobd migrate",
                    "User=jobd"):
        assert setting in text, setting
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text)[1])  # type: ignore[index]
    # The supervisor extends the stop timeout to shutdown_timeout + STOP_MARGIN at SIGTERM;
    # a systemd older than 236 ignores that, and the unit's own covers the default.
    assert stop >= Config().shutdown_timeout + STOP_MARGIN, (
        "TimeoutStopSec must cover a stop at the default shutdown_timeout")


def test_documentation_exists_after_the_install_steps(tmp_path: Path) -> None:
    [line] = re.findall(r"^Documentation=(.*)$", UNIT.read_text(), re.MULTILINE)
    uris = line.split()
    assert uris and all(uri.startswith("file:///opt/jobd/") for uri in uris), uris
    steps = commands(shell_blocks(section("Run as a systemd service"))[0])
    # The steps that put files under /opt/jobd, apart from the venv and pip (run as written,
    # from the checkout, into a stand-in for /opt/jobd).
    copies = [localize(step, tmp_path) for step in steps
              if "/opt/jobd" in step and "venv" not in step and "useradd" not in step]
    assert copies, "the install steps copy nothing to /opt/jobd"
    (tmp_path / "opt" / "jobd").mkdir(parents=True)  # made by `python3 -m venv /opt/jobd/venv`
    result = subprocess.run(["bash", "-e", "-c", "\n".join(copies)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for uri in uris:
        assert (tmp_path / uri.removeprefix("file:///")).is_file(), uri
