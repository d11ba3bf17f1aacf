"""What a new user meets: the README's quick start runs step by step against a daemon with
the example config, `make run` installs no test tools, and the systemd steps never leave the
database password world-readable."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import daemon_support
import psycopg
import pytest
import yaml
from cli_support import clean_env
from daemon_support import Daemon
from readme_support import ROOT, commands, localize, section, shell_blocks

import jobd
from jobd.testing import run_jobs

daemons = daemon_support.daemons

EXAMPLE = ROOT / "config" / "jobd.example.yaml"
JOBD = Path(sys.executable).parent / "jobd"
MAKE_RUN_URL = "postgresql://postgres@127.0.0.1:54329/postgres"


def quick_start() -> str:
    blocks = shell_blocks(section("Quick start"))
    return next(block for block in blocks if "enqueue" in block)


def test_the_quick_start_uses_the_example_config_for_every_command() -> None:
    steps = commands(quick_start())
    exports = [i for i, line in enumerate(steps)
               if line.startswith("export JOBD_CONFIG=config/jobd.example.yaml")]
    first_command = next(i for i, line in enumerate(steps) if ".venv/bin/jobd" in line)
    assert exports and exports[0] < first_command
    assert not any(" -c " in line or "--config" in line for line in steps)


@pytest.mark.parametrize("payload", [42, 1.5, "text", [3, "a", None], True, None, {"b": 1}])
def test_the_example_echo_handler_takes_any_json_payload(conn: psycopg.Connection,
                                                         payload: object) -> None:
    """`jobd enqueue echo --payload 42`: a payload is any JSON value, not only an object."""
    jobd.enqueue(conn, "echo", payload)
    summary = run_jobs(conn, config=EXAMPLE, raise_errors=True)
    assert [run.outcome for run in summary.runs] == ["done"]


@pytest.mark.slow
def test_the_quick_start_runs_step_by_step(daemons: Callable[..., Daemon], db_url: str
                                           ) -> None:
    assert JOBD.exists(), f"no jobd console script next to {sys.executable}"
    config = yaml.safe_load(EXAMPLE.read_text("utf-8"))
    config.pop("metrics", None)  # several test runs may share this machine
    daemon = daemons(yaml.safe_dump(config))
    daemon.wait_workers_started("default", 2)
    script = quick_start()
    assert MAKE_RUN_URL in script
    script = script.replace(MAKE_RUN_URL, shlex.quote(db_url))
    script = script.replace(".venv/bin/jobd", shlex.quote(str(JOBD)))
    # errexit, as a reader who stops at the first failing step; the bash default otherwise.
    result = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr + daemon.tail()
    out = result.stdout
    assert out.startswith("jobd ")
    assert "exit code 2" in out and "unknown handler 'ecko'" in result.stderr
    assert "errors (3 attempts):" in out
    assert "replayed 1 job(s)" in out
    assert "Traceback" not in result.stderr


def _make_dry_run(target: str) -> list[str]:
    """The pip installs ``make TARGET`` would run in a fresh checkout."""
    result = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines()
            if "pip install" in line and "--upgrade pip" not in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_installs_without_the_test_extras() -> None:
    run = _make_dry_run("run")
    assert run and all("[test]" not in line for line in run), run
    assert any(line.endswith("-e .") for line in run), run
    assert any("'.[test]'" in line for line in _make_dry_run("test"))


def test_the_systemd_steps_keep_the_password_file_private(tmp_path: Path) -> None:
    steps = commands(shell_blocks(section("Run as a systemd service"))[0])
    config_steps = [localize(line, tmp_path) for line in steps
                    if "/etc/jobd" in line and "systemctl" not in line]
    assert any("jobd.env" in line for line in config_steps)
    # The default umask of an interactive root shell: a file created without an explicit
    # mode is world-readable.
    script = "umask 022\n" + "\n".join(config_steps)
    result = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    env_file = tmp_path / "etc" / "jobd" / "jobd.env"
    assert stat.S_IMODE(os.stat(env_file).st_mode) == 0o640
    assert env_file.read_text().startswith("JOBD_DATABASE_URL=postgresql://")
    assert stat.S_IMODE(os.stat(env_file.parent).st_mode) == 0o750
