"""A real Prometheus server and promtool for the metrics tests.

:class:`Prometheus` starts ``/usr/bin/prometheus`` on a free port with a temporary TSDB
directory, scraping one target every second (and evaluating a rule file's rules as often,
when given one), and stops it by its PID. Tests that need the binaries skip with the Debian
package that brings them.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_support import wait_until

from jobd.localpg import free_port

PROMETHEUS = "/usr/bin/prometheus"
SKIP_PROMETHEUS = "needs prometheus (Debian package prometheus)"
SKIP_PROMTOOL = "needs promtool (Debian package prometheus)"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(SKIP_PROMTOOL)
    return path


def check_metrics(exposition: str) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` on an exposition text."""
    return subprocess.run([promtool(), "check", "metrics"], input=exposition,
                          capture_output=True, text=True, timeout=30)


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Prometheus:
    def __init__(self, directory: Path, target: str, rules: Path | None = None) -> None:
        if not Path(PROMETHEUS).exists():
            pytest.skip(SKIP_PROMETHEUS)
        self.dir = directory
        self.target = target
        self.rules = rules  # a rule file to load, evaluated every second
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "prometheus.log"

    def start(self) -> Prometheus:
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
            + (f"rule_files: [{json.dumps(str(self.rules))}]\n" if self.rules else "")
            + "scrape_configs:\n"
            "  - job_name: jobd\n"
            f"    static_configs: [{{targets: ['{self.target}']}}]\n")
        tsdb = self.dir / "tsdb"
        tsdb.mkdir()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        wait_until(self._ready, 30, interval=0.2,
                   message=lambda: f"prometheus to answer\n{self.tail()}")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode})\n{self.tail()}")
        try:
            return "Ready" in fetch(f"http://127.0.0.1:{self.port}/-/ready", timeout=1.0)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no prometheus log)"
        return "--- prometheus log (tail) ---\n" + "\n".join(text.splitlines()[-lines:])

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant vector of a PromQL expression: [{"metric": {...}, "value": float}]."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expression}))
        body = json.loads(fetch(url))
        assert body["status"] == "success", body
        return [{"metric": r["metric"], "value": float(r["value"][1])}
                for r in body["data"]["result"]]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alerts of rule ``name`` that are pending or firing, with their labels."""
        body = json.loads(fetch(f"http://127.0.0.1:{self.port}/api/v1/alerts"))
        assert body["status"] == "success", body
        return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]

    def value(self, expression: str) -> float | None:
        """The value of an expression that selects one series, or None while it has none."""
        result = self.query(expression)
        assert len(result) <= 1, f"{expression} selects several series: {result}"
        return result[0]["value"] if result else None

    def wait_value(self, expression: str, expected: float, timeout: float = 30.0,
                   context: Any = None) -> None:
        wait_until(lambda: self.value(expression) == expected, timeout, interval=0.25,
                   message=lambda: f"{expression} == {expected} (it is "
                                   f"{self.value(expression)})\n{context() if context else ''}")
