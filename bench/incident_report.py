"""The incident drill's output: ``timeline.json`` (everything measured, with the Prometheus
series), ``timeline.md`` (the timeline and the figures for people) and ``chart.png``
(matplotlib, drawn from the series Prometheus recorded).

``python -m bench.incident_report DIR`` redraws the chart and the Markdown from a
``timeline.json`` already written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGETS = {"detection_s": 30.0, "pickup_ratio": 5.0}


def _fmt(value: Any, unit: str = "s") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2f} {unit}".strip()
    return f"{value} {unit}".strip()


def markdown(record: dict[str, Any]) -> str:
    s, settings = record["summary"], record["settings"]
    lines = [
        f"# Incident drill: poison pill and thundering herd (fairness {s['fairness']})",
        "",
        f"Run {record['notes'].get('date', '')}, source {record['notes'].get('source', '')}. "
        f"Command: `{record['notes'].get('command', '')}`.",
        "",
        f"One jobd node, lane `default` ({settings['workers']} workers x concurrency "
        f"{settings['concurrency']}, max_attempts {settings['max_attempts']}, slo.pickup "
        f"{settings['slo_pickup_s']:g}s), handlers `herd` (no-op), `email` and `thumbnail` "
        f"({settings['steady_ms']:g} ms sleep, {settings['steady_rate']:g} jobs/s each), "
        + (f"`poison` (SIGSEGV, one every {settings['poison_every_s']:g} s from the cause). "
           if settings["poison_every_s"] > 0 else "`poison` (none sent: the herd alone). ")
        +
        f"Prometheus scrapes and evaluates the rules of `{Path(settings['rules']).name}` "
        f"every {settings['interval_s']:g} s. The herd: {s['herd_jobs']} jobs enqueued with "
        "`jobd.enqueue_many`, `run_at` an hour ahead by the database clock; the cause: the "
        "server's clock (libfaketime) moved +1h. Lane key fair_by "
        + ("written" if s["fair_by_key_written"] else "not known to this jobd (left out)")
        + ".",
        "",
        "## Timeline (seconds from the cause)",
        "",
        "| t | UTC | event |",
        "|---:|---|---|",
    ]
    for item in record["timeline"]:
        lines.append(f"| {item['t_s']:+.1f} | {item['utc'][11:23]} | {item['event']} |")
    lines += ["", "## Figures", "", "| figure | value |", "|---|---:|"]
    rows = [
        ("first crash after the cause", _fmt(s["first_crash_s"])),
        ("first poison job in the DLQ after the cause", _fmt(s["first_poison_dlq_s"])),
        ("first crash to DLQ, per poison job (min / max, jobs)",
         f"{_fmt(s['first_crash_to_dlq_s']['min'])} / {_fmt(s['first_crash_to_dlq_s']['max'])}"
         f", {s['first_crash_to_dlq_s']['jobs']}"),
        ("poison crashes in all", str(s["crashes"])),
        ("herd drained after the cause", _fmt(s["herd_drain_s"])
         + (" (timed out)" if s["drain_timed_out"] else "")),
    ]
    for name, at in s["alerts_firing_s"].items():
        rows.append((f"alert {name} firing", _fmt(at)))
    for name, at in s["mitigation_s"].items():
        rows.append((name.replace("_", " "), _fmt(at)))
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "## Pickup of the other handlers (claimed_at - run_at, from the archive)", "",
              "| handler | window | jobs | p50 | p99 | max |", "|---|---|---:|---:|---:|---:|"]
    for window in ("baseline", "herd"):
        for handler, f in record["pickup"][window].items():
            lines.append(f"| {handler} | {window} | {f['jobs']} | {f['p50_s']:.3f} s | "
                         f"{f['p99_s']:.3f} s | {f['max_s']:.3f} s |")
    lines += ["", "p99 during the herd / p99 at baseline: " + (", ".join(
        f"{h} {r:g}x" for h, r in record["pickup"]["p99_ratio"].items()) or "—")
        + f" (target: within {TARGETS['pickup_ratio']:g}x)."]
    poison = record["poison"]
    lines += ["", "## The poison", "",
              f"Sent {poison['sent']}; {poison['crashed']} crashed a worker at least once "
              f"({poison['crashes']} crashes); {len(poison['dead_by_crashes'])} reached the DLQ "
              f"by their crashes, {len(poison['quarantined'])} by the quarantine; "
              f"{poison['still_queued_paused']} still queued behind the pause at the end.", ""]
    comp = record["completeness"]
    lines += ["## Every job", "",
              "Archived by handler and state: " + ", ".join(
                  f"{r['handler']} {r['state']} {r['jobs']}" for r in comp["archived"])
              + "; still live: " + (", ".join(f"{h} {n}" for h, n in comp["live"].items())
                                    or "none")
              + "; steady jobs sent: " + ", ".join(
                  f"{h} {n}" for h, n in comp["steady_sent"].items()) + ".", ""]
    lines += ["![chart](chart.png)", ""]
    return "\n".join(lines)


def _lines(ax: Any, series: list[dict[str, Any]], label_key: str | None,
           default: str) -> None:
    for s in series:
        if not s["values"]:
            continue
        xs, ys = zip(*s["values"], strict=True)
        label = s["metric"].get(label_key, default) if label_key else default
        ax.plot(xs, ys, label=label, linewidth=1.4)


def chart(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, marks = record["series"], record["marks"]
    panels = [
        ("queue depth (jobs)", "depth", "state", "depth", True),
        ("oldest unclaimed age (s)", "oldest_unclaimed_age", None, "oldest due job", True),
        ("DLQ depth (jobs)", "dlq_depth", None, "dead letter", False),
        ("worker restarts (total)", "restarts", "reason", "restarts", False),
        ("done per second, by handler", "throughput", "handler", "done/s", True),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 13), sharex=True)
    for ax, (title, key, label_key, default, log_scale) in zip(axes, panels, strict=True):
        _lines(ax, series.get(key, []), label_key, default)
        if key == "restarts":
            _lines(ax, series.get("lease_expiries", []), None, "lease expiries (total)")
        ax.set_title(title, fontsize=10, loc="left")
        if log_scale:
            ax.set_yscale("symlog", linthresh=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
        for name, colour in (("cause", "red"), ("poison_quarantined", "green"),
                             ("herd_drained", "purple")):
            if marks.get(name) is not None:
                ax.axvline(marks[name], color=colour, linestyle="--", linewidth=0.9)
        for name, at in record["summary"]["alerts_firing_s"].items():
            if at is not None:
                ax.axvline(at, color="orange", linestyle=":", linewidth=0.9)
                if ax is axes[0]:
                    ax.annotate(name.removeprefix("Jobd"), (at, 1), fontsize=7,
                                rotation=90, va="bottom", color="darkorange",
                                xycoords=("data", "axes fraction"))
    axes[-1].set_xlabel("seconds from the cause (red: clock jump; orange: alerts firing; "
                        "green: poison quarantined; purple: herd drained)")
    s = record["summary"]
    fig.suptitle(f"jobd incident drill: poison pill + clock-jump herd of {s['herd_jobs']} "
                 f"(fairness {s['fairness']}), from Prometheus at "
                 f"{record['settings']['interval_s']:g}s", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(record: dict[str, Any], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "timeline.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (directory / "timeline.md").write_text(markdown(record))
    chart(record, directory / "chart.png")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.incident_report",
        description="Redraw timeline.md and chart.png from the timeline.json a drill wrote.")
    parser.add_argument("directory", type=Path, help="the drill's output directory")
    directory = parser.parse_args(argv).directory
    try:
        record = json.loads((directory / "timeline.json").read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {directory / 'timeline.json'}: {exc}")
    (directory / "timeline.md").write_text(markdown(record))
    chart(record, directory / "chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
