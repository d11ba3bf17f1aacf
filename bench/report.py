"""Summary, Markdown tables and chart of a bench/suite.py run.

The drain is summarised per in-flight setting (W worker processes x C jobs in flight per
process): jobs/s per system, jobd / the best peer, jobd / the pgbench ceiling of that setting,
each against its target, with a verdict. Latency and idle are summarised per setting they ran
at. Every figure comes from the run's records; nothing here is a constant of a past run.

The chart is drawn by bench/chart.py in the peers' virtualenv (matplotlib lives there, not in
jobd's dependencies); ``python -m bench.report RESULTS.json`` redraws the tables and chart of
a saved run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CEILING = "sql-ceiling"
LABELS = {"jobd": "jobd", "procrastinate": "Procrastinate", "pgqueuer": "PgQueuer",
          "graphile": "Graphile Worker", "pgboss": "pg-boss",
          CEILING: "SQL ceiling (pgbench)"}
METRICS = {"enqueue": ["jobs_per_s"], "drain": ["jobs_per_s", "peak_rss_mb"],
           "latency": ["p50_ms", "p99_ms"], "idle": ["txn_per_s", "txn_per_s_per_node"]}
DEFAULT_TARGETS = {"drain_vs_best_peer": 2.0, "drain_vs_ceiling": 0.5, "latency_p50_ms": 2.0,
                   "latency_p99_ms": 5.0, "idle_txn_per_s_per_node": 1.0,
                   "growth_claim_p99_ratio": 1.5, "rss_mb": 300.0}


def _stats(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _record_setting(results: dict[str, Any], record: dict[str, Any]) -> str:
    """A record's setting label; runs from before the settings matrix ran one setting."""
    if "setting" in record:
        return record["setting"]
    params = results.get("parameters", {})
    return f"{params.get('processes', '?')}x{params.get('jobd_concurrency', '?')}"


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    records = results["records"]
    targets = {**DEFAULT_TARGETS, **results.get("targets", {})}
    summary: dict[str, Any] = {}
    for workload, metrics in METRICS.items():
        grouped: dict[str, dict[str, dict[str, list[float]]]] = {}
        capped: dict[tuple[str, str], int] = {}
        for record in records:
            if record["workload"] != workload:
                continue
            # Bulk enqueue does not depend on the workers: one summary over every drain run.
            label = "all" if workload == "enqueue" else _record_setting(results, record)
            by_metric = grouped.setdefault(label, {}).setdefault(record["system"], {})
            for metric in metrics:
                if metric in record:
                    by_metric.setdefault(metric, []).append(record[metric])
            if record.get("complete") is False:
                key = (label, record["system"])
                capped[key] = capped.get(key, 0) + 1
        out: dict[str, Any] = {}
        for label, systems in grouped.items():
            for system, by_metric in systems.items():
                entry: dict[str, Any] = {m: _stats(v) for m, v in by_metric.items()}
                if capped.get((label, system)):
                    entry["capped_rounds"] = capped[(label, system)]
                out.setdefault(label, {})[system] = entry
        if out:
            summary[workload] = out["all"] if workload == "enqueue" else out
    summary["matrix"] = matrix(results, summary, targets)
    summary["growth"] = [r for r in records if r["workload"] == "growth"]
    summary["verdicts"] = verdicts(results, summary, targets)
    return summary


def _median(entry: dict[str, Any] | None, metric: str) -> float:
    return (entry or {}).get(metric, {}).get("median", math.nan)


def _ceiling_shape(results: dict[str, Any], label: str) -> dict[str, Any]:
    for record in results["records"]:
        if record["workload"] == "drain" and record["system"] == CEILING and \
                record.get("setting") == label:
            return {"batch": record["batch"], "clients": record["clients"]}
    return {}


def _setting_info(results: dict[str, Any], label: str) -> dict[str, Any]:
    for row in results.get("settings", []):
        if row["label"] == label:
            return row
    workers, _, concurrency = label.partition("x")
    try:
        return {"label": label, "workers": int(workers), "concurrency": int(concurrency),
                "in_flight": int(workers) * int(concurrency)}
    except ValueError:
        return {"label": label}


def drain_settings(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The drain settings in the order the run was given them."""
    given = results.get("parameters", {}).get("settings", [])
    found = list(summary.get("drain", {}))
    return [s for s in given if s in found] + [s for s in found if s not in given]


def matrix(results: dict[str, Any], summary: dict[str, Any],
           targets: dict[str, float]) -> list[dict[str, Any]]:
    """Per drain setting: jobd, the best peer, the ceiling, the two ratios and the verdict."""
    rows = []
    for label in drain_settings(results, summary):
        by_system = summary["drain"][label]
        jobd = _median(by_system.get("jobd"), "jobs_per_s")
        peers = {s: _median(v, "jobs_per_s") for s, v in by_system.items()
                 if s != "jobd" and not s.startswith("sql-")}
        peers = {s: v for s, v in peers.items() if not math.isnan(v)}
        best = max(peers, key=peers.get) if peers else None
        ceiling = _median(by_system.get(CEILING), "jobs_per_s")
        row: dict[str, Any] = {
            **{k: v for k, v in _setting_info(results, label).items() if k != "knobs"},
            "setting": label, "jobd_jobs_per_s": jobd, "best_peer": best,
            "best_peer_jobs_per_s": peers.get(best, math.nan) if best else math.nan,
            "ceiling_jobs_per_s": ceiling, **{f"ceiling_{k}": v for k, v in
                                              _ceiling_shape(results, label).items()}}
        row["vs_best_peer"] = jobd / row["best_peer_jobs_per_s"] if best else math.nan
        row["vs_ceiling"] = jobd / ceiling if ceiling else math.nan
        row["vs_best_peer_met"] = (None if math.isnan(row["vs_best_peer"])
                                   else row["vs_best_peer"] >= targets["drain_vs_best_peer"])
        row["vs_ceiling_met"] = (None if math.isnan(row["vs_ceiling"])
                                 else row["vs_ceiling"] >= targets["drain_vs_ceiling"])
        rows.append(row)
    return rows


def verdicts(results: dict[str, Any], summary: dict[str, Any],
             targets: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for row in summary["matrix"]:
        at = f"drain at {row['setting']}"
        if row["vs_best_peer_met"] is not None:
            rounds = summary["drain"][row["setting"]]
            jobd_range = rounds["jobd"]["jobs_per_s"]
            peer_range = rounds[row["best_peer"]]["jobs_per_s"]
            out.append({"target": f"{at} >= {targets['drain_vs_best_peer']:g}x best peer",
                        "setting": row["setting"],
                        "value": f"{row['vs_best_peer']:.2f}x {LABELS.get(row['best_peer'])} "
                                 f"(jobd {_range(jobd_range)}, peer {_range(peer_range)})",
                        "met": row["vs_best_peer_met"]})
        if row["vs_ceiling_met"] is not None:
            shape = (f"batch {row.get('ceiling_batch', '?')}, "
                     f"{row.get('ceiling_clients', '?')} client(s)")
            out.append({"target": f"{at} >= {targets['drain_vs_ceiling']:.0%} of the ceiling "
                                  f"({shape})",
                        "setting": row["setting"], "value": f"{row['vs_ceiling']:.0%}",
                        "met": row["vs_ceiling_met"]})
    for label, systems in summary.get("latency", {}).items():
        for metric, key in (("p50_ms", "latency_p50_ms"), ("p99_ms", "latency_p99_ms")):
            value = _median(systems.get("jobd"), metric)
            if not math.isnan(value):
                out.append({"target": f"latency {metric[:3]} at 200 jobs/s, {label}: "
                                      f"<= {targets[key]:g} ms",
                            "setting": label, "value": f"{value:.2f} ms",
                            "met": value <= targets[key]})
    for label, systems in summary.get("idle", {}).items():
        idle = _median(systems.get("jobd"), "txn_per_s_per_node")
        if not math.isnan(idle):
            limit = targets["idle_txn_per_s_per_node"]
            out.append({"target": f"idle at {label}: <= ~{limit:g} txn/s per node",
                        "setting": label, "value": f"{idle:.2f} txn/s",
                        "met": idle <= limit * 1.1})
    growth = summary.get("growth", [])
    if len(growth) >= 2:
        ratio = growth[-1]["claim_p99_ms"] / growth[0]["claim_p99_ms"]
        out.append({"target": f"claim p99 at {growth[-1]['rows']:,} rows within "
                              f"{targets['growth_claim_p99_ratio']}x of {growth[0]['rows']:,}",
                    "value": f"{ratio:.2f}x", "met": ratio <= targets["growth_claim_p99_ratio"]})
    # Memory: at the drain setting with the most worker processes.
    rss_at = max(summary["matrix"], key=lambda r: r.get("workers", 0), default=None)
    if rss_at is not None:
        rss = _median(summary["drain"][rss_at["setting"]].get("jobd"), "peak_rss_mb")
        if not math.isnan(rss):
            out.append({"target": f"supervisor + {rss_at.get('workers', '?')} worker(s) "
                                  f"< {targets['rss_mb']:g} MB RSS draining, "
                                  f"{rss_at['setting']}",
                        "setting": rss_at["setting"], "value": f"{rss:.0f} MB",
                        "met": rss < targets["rss_mb"]})
    return out


def _range(stat: dict[str, float]) -> str:
    if stat["n"] <= 1:
        return f"{stat['median']:,.0f}"
    return f"{stat['min']:,.0f}-{stat['max']:,.0f}"


def _fmt(stat: dict[str, float] | None, digits: int = 0) -> str:
    if not stat or math.isnan(stat.get("median", math.nan)):
        return "-"
    if stat.get("n", 0) <= 1:
        return f"{stat['median']:,.{digits}f}"
    return (f"{stat['median']:,.{digits}f} ({stat['min']:,.{digits}f}-"
            f"{stat['max']:,.{digits}f})")


def _knob_text(knobs: dict[str, Any]) -> str:
    def flat(prefix: str, value: Any) -> list[str]:
        if isinstance(value, dict):
            return [item for k, v in value.items() for item in flat(f"{prefix}{k}.", v)]
        return [f"`{prefix[:-1]}`={json.dumps(value)}"]
    return ", ".join(flat("", knobs))


def _yes(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    targets = {**DEFAULT_TARGETS, **results.get("targets", {})}
    hw = results["hardware"]
    settings = results.get("server_settings", {})
    params = results.get("parameters", {})
    systems = list(results["systems"])
    lines = [
        f"## jobd benchmark suite, {results['started']}",
        "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB; "
        f"jobd {results['revision']}; run took {results.get('elapsed_s', '?')} s.",
        "PostgreSQL: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
    ]
    rows = summary.get("matrix", [])
    if rows:
        lines += [
            "### Drain at each in-flight setting",
            "",
            f"W x C: W worker processes x C jobs in flight per process, for every system. "
            f"{params.get('drain_jobs', 20_000):,} no-op jobs enqueued in one transaction "
            "while the workers idle; jobs/s from the first handler start to the last "
            "completion recorded in the database. Median over "
            f"{params.get('rounds', '?')} round(s), (min-max) in brackets. The ceiling: "
            "pgbench claiming and completing batches of W x C on jobd's tables.",
            "",
            "| setting | " + " | ".join(LABELS.get(s, s) for s in systems)
            + " | SQL ceiling [batch, clients] | jobd / best peer "
            f"(>= {targets['drain_vs_best_peer']:g}x) | jobd / ceiling "
            f"(>= {targets['drain_vs_ceiling']:.0%}) | verdict |",
            "|---|" + "---:|" * (len(systems) + 3) + "---|",
        ]
        for row in rows:
            by_system = summary["drain"][row["setting"]]
            cells = [f"{row['setting']} ({row.get('in_flight', '?')} in flight)"]
            for system in systems:
                text = _fmt(by_system.get(system, {}).get("jobs_per_s"))
                if by_system.get(system, {}).get("capped_rounds"):
                    text += " *"
                cells.append(text)
            ceiling = _fmt(by_system.get(CEILING, {}).get("jobs_per_s"))
            if "ceiling_batch" in row:
                ceiling += f" [{row['ceiling_batch']}, {row['ceiling_clients']}]"
            cells.append(ceiling)
            best = row["best_peer"]
            cells.append("-" if best is None else
                         f"{row['vs_best_peer']:.2f}x {LABELS.get(best, best)}")
            cells.append("-" if math.isnan(row["vs_ceiling"]) else f"{row['vs_ceiling']:.0%}")
            checks = {"vs peer": row["vs_best_peer_met"], "vs ceiling": row["vs_ceiling_met"]}
            missed = [name for name, met in checks.items() if met is False]
            if all(met is None for met in checks.values()):
                cells.append("-")
            else:
                cells.append("NOT met: " + ", ".join(missed) if missed else "met")
            lines.append("| " + " | ".join(cells) + " |")
        if any(v.get("capped_rounds") for by_system in summary["drain"].values()
               for v in by_system.values()):
            lines += ["", f"\\* stopped after {params.get('drain_cap_s', '?')} s in at least "
                          "one round; the rate covers the jobs finished by then."]
        lines += ["", "Peak RSS of each fleet while draining, MB (jobd: supervisor + W "
                      "workers):", "",
                  "| setting | " + " | ".join(LABELS.get(s, s) for s in systems) + " |",
                  "|---|" + "---:|" * len(systems)]
        for row in rows:
            by_system = summary["drain"][row["setting"]]
            lines.append(f"| {row['setting']} | " + " | ".join(
                _fmt(by_system.get(s, {}).get("peak_rss_mb")) for s in systems) + " |")
    lat = summary.get("latency", {})
    idle = summary.get("idle", {})
    enq = summary.get("enqueue", {})
    if lat or idle or enq:
        columns = []
        if enq:
            columns.append(("bulk enqueue jobs/s (every drain run)",
                            lambda s: _fmt(enq.get(s, {}).get("jobs_per_s"))))
        for label, by_system in lat.items():
            for metric in ("p50_ms", "p99_ms"):
                columns.append((f"latency {metric[:3]} ms, {label}",
                                lambda s, b=by_system, m=metric: _fmt(b.get(s, {}).get(m), 2)))
        for label, by_system in idle.items():
            columns.append((f"idle txn/s fleet, {label}",
                            lambda s, b=by_system: _fmt(b.get(s, {}).get("txn_per_s"), 2)))
            columns.append((f"idle txn/s per node, {label}", lambda s, b=by_system: _fmt(
                b.get(s, {}).get("txn_per_s_per_node"), 2)))
        lines += ["", "### Enqueue, latency and idle", "",
                  f"Latency: enqueue-to-start at {params.get('latency_rate', 200)} jobs/s "
                  "offered one job at a time, median of the rounds' percentiles; idle: "
                  "transactions/s per database with no jobs, per node (jobd's fleet is one "
                  "node, every peer process is one). The setting each ran at is in the column.",
                  "",
                  "| system | " + " | ".join(title for title, _ in columns) + " |",
                  "|---|" + "---:|" * len(columns)]
        for system in systems:
            lines.append(f"| {LABELS.get(system, system)} | "
                         + " | ".join(cell(system) for _, cell in columns) + " |")
    for system, why in results.get("left_out", {}).items():
        lines.append(f"\n{LABELS.get(system, system)} left out: {why}")
    if results.get("settings"):
        lines += ["", "### The settings each system ran", "",
                  "What W x C became, per system (bench/README_suite.md explains each knob).",
                  "", "| setting | " + " | ".join(LABELS.get(s, s) for s in systems) + " |",
                  "|---|" + "---|" * len(systems)]
        for row in results["settings"]:
            lines.append(f"| {row['label']} | " + " | ".join(
                _knob_text(row["knobs"].get(s, {})) for s in systems) + " |")
    growth = summary.get("growth", [])
    if growth:
        lines += ["", f"### jobd as history grows (drain at "
                      f"{params.get('growth_setting', '4x100')})", "",
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
            lines.append(f"| {v['target']} | {v['value']} | {_yes(v['met'])} |")
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path, peers: Any) -> None:
    """Draw the chart with the peers' interpreter (which has matplotlib)."""
    if getattr(peers, "python", None) is None:
        print("chart skipped: no peers' virtualenv with matplotlib", file=sys.stderr)
        return
    data = path.with_suffix(".chart.json")
    data.write_text(json.dumps({
        "summary": results["summary"], "systems": results["systems"], "labels": LABELS,
        "settings": drain_settings(results, results["summary"]), "title": results["started"]},
        default=str))
    try:
        subprocess.run([str(peers.python), str(HERE / "chart.py"), str(data), str(path)],
                       check=True)
    finally:
        data.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """Redraw the tables (stdout) and the chart (beside the file) of a saved run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description="Redraw the Markdown tables (to stdout) and the chart (RESULTS.png) of a "
                    "saved run of the suite.")
    parser.add_argument("results", type=Path, help="a run's JSON, e.g. bench/results/DATE.json")
    args = parser.parse_args(argv)
    try:
        saved = json.loads(args.results.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {args.results}: {exc}")
    from bench.peers.install import install

    saved["summary"] = summarize(saved)
    print(markdown(saved))
    chart(saved, args.results.with_suffix(".png"), install())
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make the repository root importable
        sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
