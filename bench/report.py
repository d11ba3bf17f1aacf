"""Summary, Markdown table and chart of a bench/suite.py run.

The chart is drawn by bench/chart.py in the peers' virtualenv (matplotlib lives there, not in
jobd's dependencies); ``python -m bench.report RESULTS.json`` redraws the table and chart of
a saved run.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LABELS = {"jobd": "jobd", "procrastinate": "Procrastinate", "pgqueuer": "PgQueuer",
          "graphile": "Graphile Worker", "pgboss": "pg-boss",
          "sql-ceiling-batch1": "SQL ceiling, batch 1 (pgbench)",
          "sql-ceiling-batch100": "SQL ceiling, batch 100 (pgbench)"}
METRICS = {"enqueue": ["jobs_per_s"], "drain": ["jobs_per_s", "peak_rss_mb"],
           "latency": ["p50_ms", "p99_ms"], "idle": ["txn_per_s", "txn_per_s_per_node"]}


def _stats(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    records = results["records"]
    summary: dict[str, Any] = {}
    for workload, metrics in METRICS.items():
        for record in records:
            if record["workload"] != workload:
                continue
            for metric in metrics:
                if metric in record:
                    summary.setdefault(workload, {}).setdefault(record["system"], {}) \
                        .setdefault(metric, []).append(record[metric])
        for system, by_metric in summary.get(workload, {}).items():
            for metric, values in by_metric.items():
                by_metric[metric] = _stats(values)
            capped = [r for r in records if r["workload"] == workload and
                      r["system"] == system and r.get("complete") is False]
            if capped:
                by_metric["capped_rounds"] = len(capped)
    summary["growth"] = [r for r in records if r["workload"] == "growth"]
    summary["verdicts"] = verdicts(summary, results["targets"])
    return summary


def _median(summary: dict, workload: str, system: str, metric: str) -> float:
    return summary.get(workload, {}).get(system, {}).get(metric, {}).get("median", math.nan)


def verdicts(summary: dict[str, Any], targets: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    drain = summary.get("drain", {})
    jobd_drain = _median(summary, "drain", "jobd", "jobs_per_s")
    peers = {s: v["jobs_per_s"]["median"] for s, v in drain.items()
             if s not in ("jobd",) and not s.startswith("sql-")}
    if peers and not math.isnan(jobd_drain):
        best = max(peers, key=peers.get)
        ratio = jobd_drain / peers[best]
        out.append({"target": f"drain >= {targets['drain_vs_best_peer']}x best peer",
                    "value": f"{ratio:.2f}x {LABELS.get(best, best)}",
                    "met": ratio >= targets["drain_vs_best_peer"]})
    ceiling = _median(summary, "drain", "sql-ceiling-batch100", "jobs_per_s")
    if not math.isnan(ceiling) and not math.isnan(jobd_drain):
        share = jobd_drain / ceiling
        out.append({"target": f"drain >= {targets['drain_vs_ceiling_batch']:.0%} of the "
                              "batch-100 ceiling",
                    "value": f"{share:.0%}", "met": share >= targets["drain_vs_ceiling_batch"]})
    for metric, key in (("p50_ms", "latency_p50_ms"), ("p99_ms", "latency_p99_ms")):
        value = _median(summary, "latency", "jobd", metric)
        if not math.isnan(value):
            out.append({"target": f"latency {metric[:3]} <= {targets[key]:g} ms",
                        "value": f"{value:.2f} ms", "met": value <= targets[key]})
    idle = _median(summary, "idle", "jobd", "txn_per_s_per_node")
    if not math.isnan(idle):
        out.append({"target": f"idle <= ~{targets['idle_txn_per_s_per_node']:g} txn/s per node",
                    "value": f"{idle:.2f} txn/s", "met": idle <= targets["idle_txn_per_s_per_node"]
                    * 1.1})
    growth = summary.get("growth", [])
    if len(growth) >= 2:
        ratio = growth[-1]["claim_p99_ms"] / growth[0]["claim_p99_ms"]
        out.append({"target": f"claim p99 at {growth[-1]['rows']:,} rows within "
                              f"{targets['growth_claim_p99_ratio']}x of {growth[0]['rows']:,}",
                    "value": f"{ratio:.2f}x", "met": ratio <= targets["growth_claim_p99_ratio"]})
    rss = summary.get("drain", {}).get("jobd", {}).get("peak_rss_mb", {}).get("median")
    if rss is not None and not math.isnan(rss):
        out.append({"target": f"supervisor + 4 workers < {targets['rss_mb']:g} MB RSS draining",
                    "value": f"{rss:.0f} MB", "met": rss < targets["rss_mb"]})
    return out


def _fmt(stat: dict[str, float] | None, digits: int = 0) -> str:
    if not stat or math.isnan(stat.get("median", math.nan)):
        return "-"
    if digits:
        return (f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}-"
                f"{stat['max']:.{digits}f})")
    return f"{stat['median']:,.0f} ({stat['min']:,.0f}-{stat['max']:,.0f})"


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    hw = results["hardware"]
    settings = results.get("server_settings", {})
    lines = [
        f"## jobd benchmark suite, {results['started']}",
        "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB; "
        f"jobd {results['revision']}; run took {results.get('elapsed_s', '?')} s.",
        "PostgreSQL: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
        "Median over rounds, (min-max) in brackets. Drain: 20,000 no-op jobs, jobs/s from the "
        "first handler start to the last completion recorded in the database; "
        f"{results['parameters']['processes']} worker processes per system.",
        "",
        "| system | enqueue jobs/s | drain jobs/s | drain peak RSS MB | latency p50 ms | "
        "latency p99 ms | idle txn/s (fleet) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = [*list(results["systems"]), "sql-ceiling-batch1", "sql-ceiling-batch100"]
    for system in names:
        row = [LABELS.get(system, system)]
        enq = summary.get("enqueue", {}).get(system, {})
        drain = summary.get("drain", {}).get(system, {})
        lat = summary.get("latency", {}).get(system, {})
        idle = summary.get("idle", {}).get(system, {})
        if not (enq or drain or lat or idle):
            continue
        drain_text = _fmt(drain.get("jobs_per_s"))
        if drain.get("capped_rounds"):
            drain_text += " *"
        row += [_fmt(enq.get("jobs_per_s")), drain_text, _fmt(drain.get("peak_rss_mb")),
                _fmt(lat.get("p50_ms"), 2), _fmt(lat.get("p99_ms"), 2),
                _fmt(idle.get("txn_per_s"), 2)]
        lines.append("| " + " | ".join(row) + " |")
    if any(v.get("capped_rounds") for v in summary.get("drain", {}).values()):
        lines += ["", f"\\* stopped after {results['parameters']['drain_cap_s']:g} s; the rate "
                      "covers the jobs finished by then."]
    for system, why in results.get("left_out", {}).items():
        lines.append(f"\n{LABELS.get(system, system)} left out: {why}")
    growth = summary.get("growth", [])
    if growth:
        lines += ["", "### jobd as history grows", "",
                  "| rows in the system | archived | future-scheduled | claim p50 ms | "
                  "claim p99 ms | drain jobs/s | drop one day of history |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for g in growth:
            lines.append(f"| {g['rows']:,} | {g['archived_rows']:,} | {g['pending_rows']:,} | "
                         f"{g['claim_p50_ms']:.3f} | {g['claim_p99_ms']:.3f} | "
                         f"{g['drain_jobs_per_s']:,.0f} | {g['retention_drop_ms']:.0f} ms "
                         f"({g['retention_rows']:,} rows) |")
    if summary.get("verdicts"):
        lines += ["", "### Targets", "", "| target | jobd | met |", "|---|---|---|"]
        for v in summary["verdicts"]:
            lines.append(f"| {v['target']} | {v['value']} | {'yes' if v['met'] else 'NO'} |")
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path, peers: Any) -> None:
    """Draw the chart with the peers' interpreter (which has matplotlib)."""
    if getattr(peers, "python", None) is None:
        print("chart skipped: no peers' virtualenv with matplotlib", file=sys.stderr)
        return
    data = path.with_suffix(".chart.json")
    data.write_text(json.dumps({"summary": results["summary"], "systems": results["systems"],
                                "labels": LABELS, "title": results["started"]}))
    try:
        subprocess.run([str(peers.python), str(HERE / "chart.py"), str(data), str(path)],
                       check=True)
    finally:
        data.unlink(missing_ok=True)


if __name__ == "__main__":
    from bench.peers.install import install

    saved = json.loads(Path(sys.argv[1]).read_text())
    saved["summary"] = summarize(saved)
    print(markdown(saved))
    chart(saved, Path(sys.argv[1]).with_suffix(".png"), install())
