"""Draw the suite's chart: drain per in-flight setting, bulk enqueue, latency p50/p99.

Runs in the peers' virtualenv (matplotlib): ``python chart.py DATA.json OUT.png``.
"""

import argparse
import json
from typing import Any

CEILING = "sql-ceiling"


PEER_COLORS = {"procrastinate": "#8c564b", "pgqueuer": "#2ca02c", "graphile": "#9467bd",
               "pgboss": "#bcbd22"}


def color(name):
    return {"jobd": "#1f77b4", CEILING: "#d62728", **PEER_COLORS}.get(name, "#999999")


def main(data: dict[str, Any], out_path: str) -> None:
    # Imported here: --help and a wrong argument need no matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, labels = data["summary"], data["labels"]
    systems, settings = data["systems"], data["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2.2, 1, 1]})

    # Drain: one group of bars per setting, one bar per system and the ceiling.
    ax = axes[0]
    names = [*systems, CEILING]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, values, lows, highs = [], [], [], []
        for i, setting in enumerate(settings):
            stat = summary.get("drain", {}).get(setting, {}).get(name, {}).get("jobs_per_s")
            if not stat or stat.get("n", 0) == 0:
                continue
            xs.append(i + (k - (len(names) - 1) / 2) * width)
            values.append(stat["median"])
            lows.append(stat["median"] - stat["min"])
            highs.append(stat["max"] - stat["median"])
        if not values:
            continue
        bars = ax.bar(xs, values, width, yerr=[lows, highs], capsize=2,
                      label=labels.get(name, name), color=color(name),
                      alpha=1.0 if name in ("jobd", CEILING) else 0.6,
                      edgecolor="black", linewidth=0.3)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(f"{v / 1000:.1f}k", (bar.get_x() + bar.get_width() / 2, v),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=6, rotation=90)
    ax.set_xticks(range(len(settings)),
                  [f"{s} (W x C)" for s in settings], fontsize=9)
    ax.set_title("Drain: 20,000 no-op jobs, per in-flight setting")
    ax.set_ylabel("jobs/s (median, min-max)")
    ax.legend(fontsize=7, ncol=2)

    # Bulk enqueue.
    ax = axes[1]
    shown = [s for s in systems if summary.get("enqueue", {}).get(s, {}).get("jobs_per_s")]
    values = [summary["enqueue"][s]["jobs_per_s"]["median"] for s in shown]
    ax.bar(range(len(shown)), values, color=[color(s) for s in shown], alpha=0.8)
    for i, v in enumerate(values):
        ax.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(shown)), [labels.get(s, s) for s in shown], rotation=30,
                  ha="right", fontsize=8)
    ax.set_title("Bulk enqueue: 20,000 jobs")
    ax.set_ylabel("jobs/s")

    # Latency, at the first setting it ran at.
    ax = axes[2]
    latency = summary.get("latency", {})
    if latency:
        setting, by_system = next(iter(latency.items()))
        shown = [s for s in systems if by_system.get(s)]
        width = 0.38
        for k, (metric, tint) in enumerate((("p50_ms", "#1f77b4"), ("p99_ms", "#ff7f0e"))):
            values = [by_system[s][metric]["median"] for s in shown]
            ax.bar([i + (k - 0.5) * width for i in range(len(shown))], values, width,
                   label=metric[:3], color=tint)
            for i, v in enumerate(values):
                ax.annotate(f"{v:.1f}", (i + (k - 0.5) * width, v), ha="center",
                            va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(shown)), [labels.get(s, s) for s in shown], rotation=30,
                      ha="right", fontsize=8)
        ax.set_title(f"Enqueue-to-start at 200 jobs/s ({setting})")
        ax.set_ylabel("ms (log scale)")
        ax.legend()
    else:
        ax.set_axis_off()
    fig.suptitle(f"jobd and peers, one PostgreSQL 15 cluster, synchronous_commit=on "
                 f"({data['title']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Draw the suite's chart from the data bench/report.py writes (run with "
                    "the peers' interpreter, which has matplotlib).")
    parser.add_argument("data", help="the chart's data (JSON)")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args()
    try:
        with open(args.data) as f:
            chart_data = json.load(f)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {args.data}: {exc}")
    main(chart_data, args.out)
