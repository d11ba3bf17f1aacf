"""Draw the suite's chart: drain and enqueue throughput, latency p50/p99, per system.

Runs in the peers' virtualenv (matplotlib): ``python chart.py DATA.json OUT.png``.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(data_path: str, out_path: str) -> None:
    with open(data_path) as f:
        data = json.load(f)
    summary, labels = data["summary"], data["labels"]
    systems = data["systems"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    def bars(ax, workload, metric, names, title, unit, colors):
        values, lows, highs, shown = [], [], [], []
        for name in names:
            stat = summary.get(workload, {}).get(name, {}).get(metric)
            if not stat or stat.get("n", 0) == 0:
                continue
            shown.append(labels.get(name, name).replace(" (pgbench)", "").replace(", ", "\n"))
            values.append(stat["median"])
            lows.append(stat["median"] - stat["min"])
            highs.append(stat["max"] - stat["median"])
        ax.bar(range(len(values)), values, yerr=[lows, highs], capsize=4,
               color=colors[:len(values)])
        ax.set_xticks(range(len(values)), shown, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.0f}" if v >= 10 else f"{v:.2f}", (i, v), ha="center",
                        va="bottom", fontsize=7)

    palette = ["#1f77b4" if s == "jobd" else "#999999" for s in systems] + ["#d62728"] * 2
    bars(axes[0], "drain", "jobs_per_s",
         [*systems, "sql-ceiling-batch1", "sql-ceiling-batch100"],
         "Drain: 20,000 no-op jobs", "jobs/s (median, min-max)", palette)
    bars(axes[1], "enqueue", "jobs_per_s", systems, "Bulk enqueue: 20,000 jobs",
         "jobs/s", palette)
    ax = axes[2]
    shown = [s for s in systems if summary.get("latency", {}).get(s)]
    width = 0.38
    for k, (metric, color) in enumerate((("p50_ms", "#1f77b4"), ("p99_ms", "#ff7f0e"))):
        values = [summary["latency"][s][metric]["median"] for s in shown]
        ax.bar([i + (k - 0.5) * width for i in range(len(shown))], values, width,
               label=metric[:3], color=color)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i + (k - 0.5) * width, v), ha="center", va="bottom",
                        fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(shown)), [labels.get(s, s) for s in shown], rotation=30,
                  ha="right", fontsize=8)
    ax.set_title("Enqueue-to-start at 200 jobs/s")
    ax.set_ylabel("ms (log scale)")
    ax.legend()
    fig.suptitle(f"jobd and peers, one PostgreSQL 15 cluster, synchronous_commit=on "
                 f"({data['title']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
