"""Figures, tables, verdicts and result files of bench/pressure.py.

``finish_scenario`` turns a finished scenario (its phases, the producer's send logs, the
handler's files, the sampler's counts) into one dict of figures per phase, computed in the
scenario's database (bench/pressure_stats.py), and prints its table. ``write_results`` prints
the verdict per target and writes ``bench/results/pressure-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from bench.pressure_stats import (
    Analysis,
    PhaseWindow,
    claim_reads,
    per_second,
    recovered_after,
    top_statements,
)
from bench.result_files import free_stem

if TYPE_CHECKING:
    from bench.pressure_run import PhaseRecord, Run

# The targets of the issue.
ENQUEUE_RATIO = 0.8  # jobd.enqueue / bare INSERT, closed loop, same connections
ENQUEUE_P99_MS = 5.0  # open loop at --rate
HOLDS_RATE = 0.95  # done/s at least this share of the offered rate counts as holding it
PICKUP_P99_FACTOR = 3.0  # held pickup p99 at most this times the lead phase's
RECOVERY_S = 30.0  # overload: pickup back to baseline within this of the backlog clearing
# "Back to baseline": RECOVERY_WINDOW_S consecutive seconds whose jobs' pickup p99 is at most
# RECOVERY_FACTOR times the lead phase's p99.
RECOVERY_FACTOR = 1.5
RECOVERY_WINDOW_S = 5
# Index reads per claim are "bounded" when the last fifth of the held phase reads at most
# twice as many per claim as the second fifth (they do not grow with the held horizon's age),
# or at most BOUNDED_READS per claim whatever the second fifth read. Not the first fifth: the
# reads every bounded scan makes fill up during it, from about 2 per claim to the plateau
# (the workers' look back of 10 s; their scans from the head, whose share of a worker's time
# is reached once such a scan costs 2 ms, some 15 s of dead entries at 400 jobs/s), so a
# first fifth of 36 s compares the plateau with its own ramp.
BOUNDED_GROWTH = 2.0
BOUNDED_READS = 10.0
MIN_BACKLOG_S = 2.0  # a backlog gone sooner gives no drain rate worth the name

REPORTED_KINDS = ("clean", "held", "recovery", "open", "drain", "overload", "backlog")


# --- one scenario --------------------------------------------------------------------------


def finish_scenario(run: Run) -> dict[str, Any]:
    sent = b"".join(p.sent_rows() for p in run.producers) + b"".join(
        b"%d\t%d\n" % pair for pair in run.extra_sent)
    windows = [PhaseWindow(p.index, p.name, p.db_started, p.db_ended) for p in run.phases
               if p.db_started is not None and p.db_ended is not None]
    with psycopg.connect(run.env.url, autocommit=True,
                         application_name="pressure-analysis") as conn:
        analysis = Analysis(conn)
        analysis.load(sent, run.runs.all_lines(), windows, run.visibility_timeout)
        pickups, done, check = analysis.pickups(), analysis.done(), analysis.check()
        recovery_jobs = {p.index: analysis.phase_jobs(p.index) for p in run.phases
                         if p.kind == "recovery"}
    phases = [phase_figures(run, p, pickups, done) for p in run.phases]
    lead = next((f for f in phases if f["kind"] == "clean"), None)
    for figures in phases:
        if figures["kind"] == "recovery" and lead is not None:
            bound = RECOVERY_FACTOR * lead["pickup_p99_ms"]
            figures["recovery_bound_ms"] = round(bound, 2)
            jobs = recovery_jobs[figures["index"]]
            figures["recovered_after_s"] = recovered_after(jobs, bound, RECOVERY_WINDOW_S)
            figures["per_second"] = per_second(jobs)
    problems = run.daemon.problems()
    result = {"scenario": run.name, "phases": phases, "check": check, "extra": run.extra,
              "daemon_warnings": len(problems), "daemon_warning_lines": problems[:5]}
    print_scenario(result)
    return result


def _producer_stats(run: Run, index: int) -> dict[str, Any]:
    for producer in run.producers:
        stats = producer.send_stats(index)
        if stats["sends"]:
            return stats
    return {}


def phase_figures(run: Run, p: PhaseRecord, pickups: dict[int, dict[str, Any]],
                  done: dict[int, int]) -> dict[str, Any]:
    seconds = p.seconds
    sends = _producer_stats(run, p.index)
    extra_jobs = sum(1 for _, phase in run.extra_sent if phase == p.index)
    jobs_sent = sends.get("jobs", 0) + extra_jobs
    claimed = (p.after["claim_rows"] - p.before["claim_rows"] if "claim_rows" in p.after
               else p.runs_after - p.runs_before)
    figures: dict[str, Any] = {
        "index": p.index, "phase": p.name, "kind": p.kind, "seconds": round(seconds, 1),
        "target_rate": round(p.target_rate, 1), "jobs_sent": jobs_sent,
        "offered_per_s": jobs_sent / seconds if seconds else math.nan,
        "done_per_s": done.get(p.index, 0) / seconds if seconds else math.nan,
        "pickup_p50_ms": math.nan, "pickup_p95_ms": math.nan, "pickup_p99_ms": math.nan,
        "pickup_max_ms": math.nan, **pickups.get(p.index, {}),
        "dead_tuples_end": p.after["dead_tuples"], "live_tuples_end": p.after["live_tuples"],
        "heap_mb": p.after["heap_bytes"] / 2**20, "index_mb": p.after["index_bytes"] / 2**20,
        "vacuums": p.after["vacuums"] - p.before["vacuums"],
        "claim": claim_reads(p.before, p.after, run.args.claim_index, claimed),
        "enqueue": sends, "waits": run.sampler.top(p.index),
        "statements": top_statements(p.before, p.after),
    }
    figures.update({k: v for k, v in p.extra.items() if k not in figures})
    if p.kind == "held":
        figures["reads_timeline"] = reads_timeline(p, run.args.claim_index)
        figures["statements_by_fifth"] = statements_by_fifth(p)
    return figures


def statements_by_fifth(p: PhaseRecord, count: int = 3) -> list[list[dict[str, Any]]]:
    """The ``count`` statements that touched the most shared blocks in each fifth of a phase
    (by its snapshots): which reads grow as the phase goes on. Empty without statements."""
    points = [p.before, *p.timeline, p.after]
    if "statements" not in p.after or len(points) < 6:
        return []
    edges = [points[round(i * (len(points) - 1) / 5)] for i in range(6)]
    return [top_statements(a, b, count) for a, b in itertools.pairwise(edges)]


def reads_timeline(p: PhaseRecord, claim_index: str) -> list[tuple[float, float]]:
    """(seconds into the phase, index entries read per claim) for each snapshot interval."""
    points = [p.before, *p.timeline, p.after]
    out = []
    for a, b in itertools.pairwise(points):
        claims = (b["claim_calls"] - a["claim_calls"] if "claim_calls" in b
                  else b.get("runs", p.runs_after) - a.get("runs", p.runs_before))
        reads = claim_reads(a, b, claim_index, claims)
        per = reads.get("per_claim", reads["per_job"])
        out.append((round(b["at"] - p.before["at"], 1), round(per, 1)))
    return out


def bounded(timeline: list[tuple[float, float]]) -> tuple[bool | None, float, float]:
    """Whether reads per claim stayed bounded, with the second and last fifth's averages
    (the first fifth is the ramp up to the plateau: BOUNDED_GROWTH's comment); None when
    the phase had too few snapshot intervals to compare a settled fifth with the last."""
    values = [v for _, v in timeline if not math.isnan(v)]
    fifth = len(values) // 5
    if fifth < 1:
        return None, math.nan, math.nan
    settled = statistics.fmean(values[fifth:2 * fifth])
    last = statistics.fmean(values[-fifth:])
    return last <= max(BOUNDED_GROWTH * settled, BOUNDED_READS), settled, last


# --- tables --------------------------------------------------------------------------------

COLUMNS = ["phase", "s", "offered/s", "done/s", "p50 ms", "p95 ms", "p99 ms", "max ms",
           "backlog", "dead tup", "heap MB", "idx MB", "reads/claim", "reads/job", "idx blks/claim",
           "seq/claim",
           "enq p50", "enq p99", "late %", "horizon s", "other load"]


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def phase_row(scenario: str, f: dict[str, Any]) -> list[str]:
    claim, sends = f["claim"], f["enqueue"]
    return [f"{scenario}/{f['phase']}", _f(f["seconds"], 0), _f(f["offered_per_s"]),
            _f(f["done_per_s"]), _f(f["pickup_p50_ms"]), _f(f["pickup_p95_ms"]),
            _f(f["pickup_p99_ms"]), _f(f["pickup_max_ms"]), _f(f.get("backlog_end")),
            _f(f["dead_tuples_end"]), _f(f["heap_mb"], 2), _f(f["index_mb"], 2),
            _f(claim.get("per_claim")), _f(claim["per_job"]),
            _f(claim.get("index_blocks_per_claim")), _f(claim.get("seq_rows_per_claim")),
            _f(sends.get("call_p50_ms"), 2), _f(sends.get("call_p99_ms"), 2),
            _f(sends.get("late_pct")), _f(f.get("horizon_age_s")), _f(f.get("other_load_cores"), 2)]


def waits_line(f: dict[str, Any]) -> str:
    parts = []
    for kind, events in f["waits"].items():
        if kind in ("producer", "worker", "supervisor", "reader", "autovacuum worker"):
            parts.append(f"{kind}: " + ", ".join(f"{e} {n:.2f}" for e, n in events))
    return "; ".join(parts) or "-"


def statements_line(f: dict[str, Any]) -> str:
    return "; ".join(f"{r['statement']} {r['calls']:,} calls, {r['blocks_per_call']:,.1f} "
                     f"blocks and {r['ms_per_call']:.2f} ms a call"
                     for r in f.get("statements", [])) or "-"


def text_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(rows: list[list[str]], header: list[str]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def reported(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in result["phases"] if f["kind"] in REPORTED_KINDS]


def print_scenario(result: dict[str, Any]) -> None:
    name = result["scenario"]
    print(f"\n== {name} ==")
    closed = result["extra"].get("closed_loop")
    if closed:
        print(text_table(closed_rows(closed), CLOSED_COLUMNS))
    phases = reported(result)
    if phases:
        print(text_table([phase_row(name, f) for f in phases], COLUMNS))
        print("top wait events (average active backends per sample):")
        for f in phases:
            print(f"  {name}/{f['phase']}: {waits_line(f)}")
        if any(f.get("statements") for f in phases):
            print("statements that touched the most shared blocks (pg_stat_statements):")
            for f in phases:
                print(f"  {name}/{f['phase']}: {statements_line(f)}")
    for f in phases:
        if "recovered_after_s" in f:
            print(f"  {name}/{f['phase']}: pickup p99 back under {f['recovery_bound_ms']:.1f} ms "
                  f"after {_f(f['recovered_after_s'])} s")
        if "reads_timeline" in f:
            print(f"  {name}/{f['phase']}: index entries read per claim by snapshot "
                  "interval: " + " ".join(_f(v, 0) for _, v in f["reads_timeline"]))
        for number, rows in enumerate(f.get("statements_by_fifth", []), 1):
            print(f"  {name}/{f['phase']}, fifth {number}: "
                  f"{statements_line({'statements': rows})}")
    check = result["check"]
    print(f"exactly once: {'ok' if check['ok'] else 'FAILED'} ({check_text(check)}); daemon "
          f"warnings: {result['daemon_warnings']}", flush=True)


def check_text(check: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in check.items() if k != "ok")


CLOSED_COLUMNS = ["closed loop", "clients", "round", "tx/s", "latency avg ms", "rows",
                  "processed"]


def closed_rows(closed: list[dict[str, Any]]) -> list[list[str]]:
    return [[c["contender"], str(c["clients"]), str(c["round"]), _f(c["tps"], 0),
             _f(c.get("latency_ms"), 3), _f(c["rows"]), _f(int(c["processed"]))]
            for c in closed]


# --- verdicts ------------------------------------------------------------------------------


def _phase(results: dict[str, dict[str, Any]], scenario: str,
           name: str) -> dict[str, Any] | None:
    result = results.get(scenario)
    if result is None:
        return None
    return next((f for f in result["phases"] if f["phase"] == name), None)


def verdicts(results: dict[str, dict[str, Any]], rate: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(target: str, met: bool | None, text: str) -> None:
        out.append({"target": target, "met": met, "figures": text})

    if "enqueue" in results:
        closed = results["enqueue"]["extra"]["closed_loop"]
        short = [c for c in closed if c["rows"] < c["processed"]]
        add("enqueue closed loop: every committed transaction left its row", not short,
            f"{len(closed)} runs, rows >= pgbench's processed in all" if not short else
            "; ".join(f"{c['contender']} x{c['clients']}: {c['rows']} rows of "
                      f"{int(c['processed'])}" for c in short))
        for clients in sorted({c["clients"] for c in closed}):
            tps = {kind: statistics.median(c["tps"] for c in closed
                                           if c["clients"] == clients and c["contender"] == kind)
                   for kind in ("enqueue", "insert")}
            ratio = tps["enqueue"] / tps["insert"]
            add(f"enqueue x{clients}: jobd.enqueue >= {ENQUEUE_RATIO:g} x bare INSERT",
                ratio >= ENQUEUE_RATIO, f"{tps['enqueue']:,.0f} vs {tps['insert']:,.0f} tx/s "
                f"= {ratio:.2f}")
            f = _phase(results, "enqueue", f"open_c{clients}")
            if f is not None:
                p99 = f["enqueue"]["call_p99_ms"]
                add(f"enqueue x{clients}: call p99 <= {ENQUEUE_P99_MS:g} ms at {rate:g}/s",
                    p99 <= ENQUEUE_P99_MS, f"p50 {f['enqueue']['call_p50_ms']:.2f} ms, p99 "
                    f"{p99:.2f} ms, {f['enqueue']['late_pct']:.1f} % late")
    for scenario in ("idle_in_tx", "active_readers"):
        held, lead = _phase(results, scenario, "held"), _phase(results, scenario, "lead")
        if held is None or lead is None:
            continue
        add(f"{scenario}: done/s holds the offered rate", held["done_per_s"] >= HOLDS_RATE * rate,
            f"done {held['done_per_s']:.0f}/s, offered {held['offered_per_s']:.0f}/s "
            f"(target rate {rate:g})")
        bound = PICKUP_P99_FACTOR * lead["pickup_p99_ms"]
        add(f"{scenario}: pickup p99 <= {PICKUP_P99_FACTOR:g} x clean",
            held["pickup_p99_ms"] <= bound, f"{held['pickup_p99_ms']:.1f} ms vs clean "
            f"{lead['pickup_p99_ms']:.1f} ms (bound {bound:.1f})")
        ok, settled, last = bounded(held["reads_timeline"])
        add(f"{scenario}: index entries read per claim stay bounded", ok,
            f"{held['claim'].get('per_claim', held['claim']['per_job']):,.1f} per claim over "
            f"the phase; second fifth {settled:,.1f}, last fifth {last:,.1f} (clean "
            f"{lead['claim'].get('per_claim', lead['claim']['per_job']):,.1f})")
    if "overload" in results:
        extra = results["overload"]["extra"]
        backlog = _phase(results, "overload", "backlog")
        recovery = _phase(results, "overload", "recovery")
        overload = _phase(results, "overload", "overload")
        if backlog is not None and overload is not None:
            clean = extra["clean_drain_per_s"]
            target = "overload: backlog drains at >= the clean drain rate"
            if backlog["seconds"] < MIN_BACKLOG_S:
                # The daemon kept up with the overload: nothing was left to measure a drain by.
                add(target, None, f"no backlog to drain: offered {overload['offered_per_s']:,.0f}"
                    f"/s (1.5 x clean {clean:,.0f}/s), done {overload['done_per_s']:,.0f}/s, "
                    f"{overload['backlog_end']:,} left at the overload's end")
            else:
                add(target, backlog["done_per_s"] >= clean and "timed_out_after_s" not in backlog,
                    f"{backlog['done_per_s']:,.0f} done/s over {backlog['seconds']:.0f} s vs "
                    f"clean {clean:,.0f}/s ({overload['backlog_end']:,} jobs at the overload's "
                    f"end){cause_drains_text(extra)}")
        if recovery is not None:
            after = recovery.get("recovered_after_s")
            add(f"overload: pickup back to baseline within {RECOVERY_S:g} s of the backlog "
                "clearing", after is not None and after <= RECOVERY_S,
                f"after {_f(after)} s (p99 under {recovery.get('recovery_bound_ms', math.nan):.1f}"
                f" ms for {RECOVERY_WINDOW_S} s)")
    for name, result in results.items():
        check = result["check"]
        add(f"{name}: every sent job done exactly once", check["ok"], check_text(check))
    return out


def cause_drains_text(extra: dict[str, Any]) -> str:
    """The drains that tell the backlog's causes apart, those the run made: a clean drain
    beside the producer's standing load, and one of as many jobs as the backlog's."""
    parts = []
    if "loaded_drain_per_s" in extra:
        parts.append(f"a clean drain beside the producer's standing load: "
                     f"{extra['loaded_drain_per_s']:,.0f}/s")
    if "same_size_drain_per_s" in extra:
        parts.append(f"a drain of the same {extra['same_size_drain_jobs']:,} jobs after the "
                     f"recovery: {extra['same_size_drain_per_s']:,.0f}/s")
    return "".join(f"; {part}" for part in parts)


def verdict_word(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT MET")


# --- result files --------------------------------------------------------------------------


def write_results(meta: dict[str, Any], results: list[dict[str, Any]], directory: Path | None,
                  quick: bool) -> None:
    by_name = {r["scenario"]: r for r in results}
    found = verdicts(by_name, meta["args"]["rate"])
    print("\nverdicts:")
    for v in found:
        print(f"  {verdict_word(v['met']):8} {v['target']}: {v['figures']}")
    print(flush=True)
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    stem = free_stem(directory, f"pressure-{datetime.now(UTC):%Y-%m-%d}"
                     + ("-quick" if quick else ""))
    data = {"benchmark": "pressure", **meta, "scenarios": results, "verdicts": found}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, results, found))
    print(f"wrote {stem}.json and .md", flush=True)


def markdown(meta: dict[str, Any], results: list[dict[str, Any]],
             found: list[dict[str, Any]]) -> str:
    server = meta["server"]
    lines = [
        f"# Pressure benchmark, {meta['date']}", "",
        f"- source: {meta['source']}; {meta['cores']} cores; load average at start "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_at_start'])}; run took "
        f"{meta['seconds']} s",
        f"- PostgreSQL {server['server_version']} (throwaway cluster), " + ", ".join(
            f"{k}={v}" for k, v in server.items() if k != "server_version"),
        f"- daemon: one lane, {meta['workers']} workers x concurrency {meta['concurrency']}, "
        f"no-op handler; producer {meta['args']['rate']:g} jobs/s from "
        f"{meta['args']['producers']} autocommit connections; phases (s): " + ", ".join(
            f"{k} {v:g}" for k, v in meta["durations"].items()),
        "- *other load*: CPU cores that processes outside this benchmark used during the "
        "phase (the machine may be shared); figures taken beside other work are disturbed.",
        "", "## Verdicts", "",
    ]
    lines += [f"- **{verdict_word(v['met'])}**: {v['target']}: {v['figures']}" for v in found]
    for result in results:
        name = result["scenario"]
        lines += ["", f"## {name}", ""]
        closed = result["extra"].get("closed_loop")
        if closed:
            lines += [md_table(closed_rows(closed), CLOSED_COLUMNS), ""]
        phases = reported(result)
        if phases:
            lines += [md_table([phase_row(name, f) for f in phases], COLUMNS), "",
                      "Top wait events (average active backends per sample):", ""]
            lines += [f"- {f['phase']}: {waits_line(f)}" for f in phases]
            if any(f.get("statements") for f in phases):
                lines += ["", "Statements that touched the most shared blocks "
                          "(pg_stat_statements):", ""]
                lines += [f"- {f['phase']}: {statements_line(f)}" for f in phases]
        for f in phases:
            if "recovered_after_s" in f:
                lines.append(f"- {f['phase']}: pickup p99 back under "
                             f"{f['recovery_bound_ms']:.1f} ms after "
                             f"{_f(f['recovered_after_s'])} s")
            if "reads_timeline" in f:
                lines.append(f"- {f['phase']}: index entries read per claim, 5 s intervals: "
                             + " ".join(_f(v, 0) for _, v in f["reads_timeline"]))
            for number, rows in enumerate(f.get("statements_by_fifth", []), 1):
                lines.append(f"- {f['phase']}, fifth {number} of the phase: "
                             f"{statements_line({'statements': rows})}")
        if result["extra"]:
            shown = {k: v for k, v in result["extra"].items() if k != "closed_loop"}
            if shown:
                lines.append(f"- {', '.join(f'{k} {v}' for k, v in shown.items())}")
        check = result["check"]
        lines.append(f"- exactly once: {'ok' if check['ok'] else 'FAILED'} "
                     f"({check_text(check)}); daemon warnings {result['daemon_warnings']}")
    return "\n".join(lines) + "\n"
