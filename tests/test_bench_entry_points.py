"""Every script under bench/ that people run (and the peers' installer) answers ``--help``
both ways the docs run them: ``python bench/NAME.py`` and ``python -m bench.NAME``, from the
repository root.

Run as a file, a script's own directory is on ``sys.path`` and the repository root is not, so
its ``from bench...`` imports failed with a traceback for several of them, though the docs
name them that way (``bench/fairness_bench.py --drain``, ``bench/drain_profile.py --py-spy``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ is not installed: its modules are imported below too
# Run by people: the scripts of bench/ and the peers' installer. (bench/peers' other scripts
# are the suite's subprocesses, run with the arguments it gives them.)
ENTRY_POINTS = [*sorted(path.stem for path in (REPO / "bench").glob("*.py")
                        if 'if __name__ == "__main__":' in path.read_text()), "peers/install"]


def _help(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([*command, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_scripts_are_found() -> None:
    assert {"pressure", "fairness_bench", "drain_profile", "enqueue_parts",
            "peers/install"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_bench_script_answers_help_run_as_a_file_and_as_a_module(name: str) -> None:
    module = "bench." + name.replace("/", ".")
    commands = [[sys.executable, f"bench/{name}.py"], [sys.executable, "-m", module]]
    with ThreadPoolExecutor(len(commands)) as pool:
        results = list(pool.map(_help, commands))
    for command, done in zip(commands, results, strict=True):
        shown = " ".join(command[1:])
        assert done.returncode == 0, f"{shown} --help exited {done.returncode}:\n{done.stderr}"
        assert "usage:" in done.stdout, f"{shown} --help printed no usage:\n{done.stdout}"
        assert "Traceback" not in done.stderr, f"{shown} --help:\n{done.stderr}"


@pytest.mark.parametrize(("arguments", "says"), [
    (["bench", "--systems", "nope"], "--systems: unknown nope"),
    (["bench", "--only", "drain,bogus"], "--only: unknown bogus"),
    (["bench", "--rounds", "0"], "must be at least 1"),
    (["bench.enqueue_parts", "--connections", "x"], "not a list of numbers"),
    (["bench.enqueue_parts", "--one-call-transactions", "--calls", "0"], "must be at least 1"),
    (["bench.outcome_plans", "--sizes", "1,x"], "not a list of numbers"),
    (["bench.outcome_plans", "--jobs", "0"], "must be at least 1"),
    (["bench.claim_decode", "--rows", "0"], "must be at least 1"),
    (["bench.claim_decode", "--zones", " , "], "name at least one zone"),
    (["bench.check_constraints", "--statements", "0"], "must be at least 1"),
    (["bench.daemon_bench", "--lane-timeout", "0"], "must be a positive number"),
    (["bench.pressure", "--scenarios", "bogus"], "unknown scenario bogus"),
    (["bench.limits_bench", "--settings", "2y10"], "not a setting W x C"),
    (["bench.limits_bench", "--only", "nope"], "unknown contenders nope"),
    (["bench.pooler_bench", "--jobs", "-1"], "must be at least 1"),
])
def test_a_wrong_argument_is_refused_with_a_usage_error(arguments: list[str], says: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", *arguments], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr


# Refused when the arguments are read, before anything runs: these scripts read the values
# only later (a suite's growth workload comes after an hour of the others; a fleet's sizes,
# a drill's or a pressure run's seconds once its cluster is up), so each is called here in
# process, where a script that still takes the value runs nothing.
@pytest.mark.parametrize(("module", "arguments", "says"), [
    ("bench.suite", ["--growth-sizes", "10000,x"], "--growth-sizes: not a list of numbers"),
    ("bench.suite", ["--growth-sizes", "0"], "table sizes of at least 1"),
    ("bench.fleet_idle", ["--sizes", "1,x"], "--sizes: not a list of numbers"),
    ("bench.fleet_idle", ["--sizes", "0"], "at least 1 node"),
    ("bench.fleet_idle", ["--window", "0"], "--window a positive one"),
    ("bench.fleet_idle", ["--settle", "-1"], "--settle must be a number of seconds"),
    ("bench.fleet_idle", ["--duty-interval", "soon"], "--duty-interval: expected a duration"),
    ("bench.incident", ["--fairness", "on", "--baseline", "nan"], "must be finite"),
    ("bench.pressure", ["--duration", "nan"], "must be finite numbers"),
])
def test_a_value_read_late_is_refused_before_the_run(
    module: str, arguments: list[str], says: str, capsys: pytest.CaptureFixture[str],
) -> None:
    parse_args = importlib.import_module(module).parse_args
    with pytest.raises(SystemExit) as exited:
        parse_args(arguments)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("arguments", "says"), [
    (["bench/chart.py", "no-such-file.json", "out.png"], "cannot read no-such-file.json"),
    (["bench/testing_helpers.py", "--database-url", "unused", "--jobs", "0"],
     "--jobs must be at least 1"),
])
def test_a_script_refuses_its_input_without_a_traceback(arguments: list[str], says: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, *arguments], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
