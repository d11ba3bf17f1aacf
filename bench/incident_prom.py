"""A real Prometheus for the incident drill: scrapes one jobd node with the shipped alert
rules, and answers the queries the drill's timeline and chart are made from.

``/usr/bin/prometheus`` (Debian package prometheus) on a free port, a TSDB in the drill's
directory, scrape and rule evaluation every ``interval`` seconds. Stopped by its PID.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from jobd.localpg import free_port

PROMETHEUS = "/usr/bin/prometheus"
READY_TIMEOUT_S = 30.0


class PrometheusError(RuntimeError):
    """Prometheus could not start or answered with an error."""


def available() -> bool:
    return Path(PROMETHEUS).exists() or shutil.which("prometheus") is not None


def _fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class Prometheus:
    def __init__(self, directory: Path, target: str, rules: Path, interval: float) -> None:
        self.dir = directory
        self.target = target
        self.rules = rules
        self.interval = interval
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "prometheus.log"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        self.dir.mkdir(parents=True, exist_ok=True)
        rules = self.dir / "alerts.yml"
        shutil.copyfile(self.rules, rules)
        config = self.dir / "prometheus.yml"
        every = f"{self.interval:g}s"
        config.write_text(
            f"global: {{scrape_interval: {every}, scrape_timeout: {every}, "
            f"evaluation_interval: {every}}}\n"
            f"rule_files: ['{rules}']\n"
            "scrape_configs:\n"
            "  - job_name: jobd\n"
            f"    static_configs: [{{targets: ['{self.target}']}}]\n")
        tsdb = self.dir / "tsdb"
        tsdb.mkdir(exist_ok=True)
        binary = PROMETHEUS if Path(PROMETHEUS).exists() else str(shutil.which("prometheus"))
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        self._wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited ({self.proc.returncode}):\n"
                                      f"{self.tail()}")
            try:
                if "Ready" in _fetch(f"{self.base}/-/ready", timeout=1.0):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus not ready in {READY_TIMEOUT_S:g}s:\n"
                                      f"{self.tail()}")
            time.sleep(0.2)

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no prometheus log)"
        return "\n".join(text.splitlines()[-lines:])

    def _api(self, path: str, params: dict[str, Any]) -> Any:
        url = f"{self.base}/api/v1/{path}?" + urllib.parse.urlencode(params)
        body = json.loads(_fetch(url))
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant vector: [{"metric": {...}, "value": float}]."""
        return [{"metric": r["metric"], "value": float(r["value"][1])}
                for r in self._api("query", {"query": expression})["result"]]

    def query_range(self, expression: str, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        """A range query: [{"metric": {...}, "values": [(epoch, float), ...]}]."""
        data = self._api("query_range", {"query": expression, "start": f"{start:.3f}",
                                         "end": f"{end:.3f}", "step": f"{step:g}"})
        return [{"metric": r["metric"],
                 "values": [(float(t), float(v)) for t, v in r["values"]]}
                for r in data["result"]]

    def firing(self) -> set[str]:
        """The names of the alerts firing now."""
        return {r["metric"]["alertname"] for r in self.query('ALERTS{alertstate="firing"}')}

    def alert_times(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per alert name, when it was first pending and first firing (epoch seconds): the
        raw samples of the ALERTS series, which carry the timestamps of the rule
        evaluations that wrote them (a range query would round them to its steps)."""
        window = f"{math.ceil(end - start) + 1}s"
        data = self._api("query", {"query": f"ALERTS[{window}]", "time": f"{end:.3f}"})
        times: dict[str, dict[str, float]] = {}
        for series in data["result"]:
            name, state = series["metric"]["alertname"], series["metric"]["alertstate"]
            seen = [float(t) for t, _ in series["values"] if float(t) >= start]
            if not seen:
                continue
            first = min(seen)
            entry = times.setdefault(name, {})
            entry[state] = min(first, entry.get(state, first))
        return times
