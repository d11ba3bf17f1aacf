"""The ``jobd`` subcommands that inspect and operate the queue: ``status``, ``jobs show``,
``jobs list`` and the dead-letter queue's ``dlq list``, ``dlq replay`` and ``dlq purge``.
(The incident controls, pause, cancel and quarantine, are in :mod:`jobd.commands_controls`.)"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timedelta
from typing import Any

from jobd import dlq, pauses, schedules, views
from jobd.cli_context import Context
from jobd.cli_output import (
    cell,
    error_line,
    escaped,
    field,
    json_escaped,
    one_line,
    print_json,
    print_table,
    seconds,
    text_lines,
)
from jobd.commands_controls import checked_names, name_rule
from jobd.config import Config
from jobd.errors import UsageError

# jobs show prints a payload up to this many characters of JSON; longer ones need --payload.
PAYLOAD_PREVIEW_CHARS = 2000


def cmd_status(ctx: Context, _args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        lanes = views.lane_status(conn)
        every_node = views.node_status(conn, include_gone=True)
        conflicts = schedules.conflicts(conn)
        paused = pauses.pauses(conn)
        # Only with a config that lists handlers (-c): without one, every handler would do.
        listed = sorted(ctx.config.worker_handlers())
        unlisted = views.unlisted_handlers(conn, listed) if listed else None
    nodes = [n for n in every_node if not n.gone]
    differing = views.lane_disagreements(nodes)
    # Lanes with no jobs still show when the config, a live node or a pause names them.
    workers = views.live_workers(nodes)
    lanes = views.with_lanes(lanes, set(ctx.config.lanes) | set(workers)
                             | {p.lane for p in paused})
    paused_lanes = {p.lane for p in paused if p.handler is None}

    def paused_handlers(lane: str) -> list[str]:
        return sorted(p.handler for p in paused if p.lane == lane and p.handler is not None)
    rates = views.lane_rates(nodes)

    def rate(lane: str, *kinds: str) -> float:
        return sum(rates.get(lane, {}).get(kind, 0.0) for kind in kinds)

    def slo(lane: str) -> float | None:
        config = ctx.config.lanes.get(lane)
        return config.slo_pickup if config else None

    if ctx.as_json:
        print_json({
            "lanes": [{**s.as_dict(), "claim_rate": rate(s.lane, "claimed"),
                       "failure_rate": rate(s.lane, "failed", "dead"),
                       "live_workers": workers.get(s.lane, 0),
                       "served": workers.get(s.lane, 0) > 0,
                       "slo_pickup_seconds": slo(s.lane),
                       "over_slo": views.over_slo(s, slo(s.lane)),
                       "paused": s.lane in paused_lanes,
                       "paused_handlers": paused_handlers(s.lane),
                       "handlers_not_in_config": (None if unlisted is None
                                                  else unlisted.get(s.lane, {})),
                       "settings_differ": differing.get(s.lane, {})}
                      for s in lanes],
            "nodes": [n.as_dict() for n in every_node],
            "pauses": [p.as_dict() for p in paused],
            "schedule_conflicts": [
                {"schedule": c.schedule_id, "stored_by": list(c.stored_by),
                 "differing": list(c.differing)} for c in conflicts],
        })
        return 0
    print_table(
        ["lane", "pending", "claimed", "failed", "dead (DLQ)", "oldest unclaimed",
         "pickup SLO", "claims/s", "failures/s", "paused", "live workers"],
        [[s.lane, s.pending, s.claimed, s.failed, s.dead, _oldest(s, slo(s.lane)),
          "-" if slo(s.lane) is None else f"{slo(s.lane):g}s",
          f"{rate(s.lane, 'claimed'):.1f}", f"{rate(s.lane, 'failed', 'dead'):.1f}",
          "lane" if s.lane in paused_lanes else ", ".join(paused_handlers(s.lane)) or "-",
          _served(workers.get(s.lane, 0))]
         for s in lanes],
        empty="no jobs and no lanes configured",
    )
    _print_pauses(paused)
    _print_unlisted(unlisted or {})
    _print_disagreements(differing, nodes)
    print()
    print_table(
        ["node", "pid", "lanes (live workers)", "last heartbeat", "state", "wake-ups"],
        [[n.node, n.pid, ", ".join(f"{lane}: {n.workers[lane]}" for lane in n.lanes) or "-",
          f"{n.last_heartbeat_age_seconds:.1f}s ago", _node_state(n), _wakeups(n.listening)]
         for n in every_node],
        empty="no nodes (no daemon runs, or has run in the last hour)",
    )
    _print_schedule_conflicts(conflicts)
    return 0


def _node_state(node: views.NodeStatus) -> str:
    if not node.gone:
        return "live"
    # Its claimed jobs come back when their leases expire: every live node sweeps them.
    return "gone (its leases are swept by the others)"


def _print_unlisted(unlisted: dict[str, dict[str, int]]) -> None:
    if not unlisted:
        return
    print()
    print("jobs of handlers this config does not list (a node with it gives them back; they "
          "wait for a node that has the handler):")
    for lane, handlers in sorted(unlisted.items()):
        waiting = ", ".join(f"{handler} ({count} waiting)"
                            for handler, count in sorted(handlers.items()))
        print(f"  {lane}: {waiting}")


# lanes.<l>.* settings that are durations, printed as such.
_DURATIONS = {"timeout", "visibility_timeout", "backoff_base", "backoff_cap", "rate_per",
              "max_wait", "slo_pickup"}


def _print_disagreements(found: views.Disagreements, nodes: list[views.NodeStatus]) -> None:
    if not found:
        return
    # A node by its name, or with its pid where two live nodes share the name.
    names = [n.node for n in nodes]
    label = {n.instance: n.node if names.count(n.node) == 1 else f"{n.node} (pid {n.pid})"
             for n in nodes}
    print()
    print("lanes the live nodes configure differently (each node applies its own settings to "
          "the jobs it claims; give every node the same):")
    for lane, settings in sorted(found.items()):
        for name, values in settings.items():
            told = ", ".join(f"{field(label.get(instance, instance))} {_setting(name, value)}"
                             for instance, value in values.items())
            print(f"  {lane}: {name}: {told}")


def _setting(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name in _DURATIONS and isinstance(value, int | float):
        return f"{value:g}s"
    return field(value) if isinstance(value, str) else str(value)


def _print_pauses(found: list[pauses.Pause]) -> None:
    if not found:
        return
    print()
    print("paused (on every node, until `jobd lanes resume`):")
    for pause in found:
        what = "the whole lane" if pause.handler is None else f"handler {pause.handler}"
        print(f"  lane {pause.lane}: {what}, since {field(pause.paused_at)} "
              f"by {field(pause.paused_by)}")


def _print_schedule_conflicts(found: list[schedules.Conflict]) -> None:
    if not found:
        return
    print()
    print("schedules with conflicting definitions on live nodes (the stored one is kept):")
    for conflict in found:
        print(f"  {conflict.schedule_id}: stored by {', '.join(conflict.stored_by) or '-'}; "
              f"differing: {', '.join(conflict.differing)}")


def _oldest(status: views.LaneStatus, slo_pickup: float | None) -> str:
    text = seconds(status.oldest_unclaimed_age) if views.waits(status) else "-"
    return text + " OVER SLO" if views.over_slo(status, slo_pickup) else text


def _wakeups(listening: bool | None) -> str:
    """How a node learns of new work: notifications, or (LISTEN unavailable) its poll."""
    if listening is None:
        return "-"
    return "listen" if listening else "poll only (LISTEN unavailable)"


def _served(count: int) -> str:
    return str(count) if count else "0 (no live worker)"


def cmd_jobs_show(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        job = views.get_job(conn, args.id)
    if job is None:
        # A wrong id is the user's input, as in `dlq replay`: exit 2.
        raise UsageError(f"no job {args.id} (live, finished or dead)")
    limit, source = _effective_max_attempts(ctx.config, job)
    if ctx.as_json:
        print_json({**_job_json(job), "effective_max_attempts": limit,
                     "max_attempts_source": source})
        return 0
    history = job["errors"]
    shown = [key for key in job if key not in ("payload", "payload_text", "payload_problem",
                                               "errors")]
    if job["finished_at"] is not None:
        # The archive does not keep when a cancel was asked for: '-' would read "never".
        # A cancelled job's history says when it was cancelled.
        shown.remove("cancel_requested_at")
    width = max(len(key) for key in [*shown, "payload"])
    for key in shown:
        value = job[key]
        if key == "max_attempts":
            value = _max_attempts_text(ctx.config, job, limit, source)
        elif key == "last_error":
            value = error_line(value)
        print(f"{key:>{width}}: {field(value)}")
    print(f"{'payload':>{width}}: {_payload_text(job, args.payload)}")
    for line in _history_lines(history, args.full_errors):
        print(line)
    return 0


def _job_json(job: dict[str, Any]) -> dict[str, Any]:
    """The job for --json: the payload decoded; its stored text and the reason only when it
    cannot be decoded here."""
    data = dict(job)
    if data["payload_problem"] is None:
        del data["payload_problem"], data["payload_text"]
    return data


def _effective_max_attempts(config: Config, job: dict[str, Any]) -> tuple[int | None, str]:
    """The attempt budget the job runs with and where it comes from: the job's own, else its
    lane's in the config given, else unknown here (the daemons' config decides)."""
    if job["max_attempts"] is not None:
        return job["max_attempts"], "job"
    lane = config.lanes.get(job["lane"])
    if lane is not None:
        return lane.max_attempts, "lane"
    return None, "daemon"


def _max_attempts_text(config: Config, job: dict[str, Any], limit: int | None,
                       source: str) -> str:
    # Named as the given config's value of that lane: "(lane default)" read as "from lane
    # 'default'", and nodes may configure a lane differently, so the job may have run with
    # another node's value.
    lane = job["lane"]
    if source == "job":
        return str(limit)
    if source == "lane":
        return (f"{limit} (the max_attempts of lane {lane!r} in {config.path or 'this config'};"
                " a node with another config runs the job with its own)")
    if config.path is not None:
        return (f"not set on the job: lane {lane!r} is not in {config.path}, so the config of "
                "the nodes that run it decides")
    return (f"not set on the job: the config of the nodes that run lane {lane!r} decides "
            "(pass -c FILE to see one)")


def _payload_text(job: dict[str, Any], whole: bool) -> str:
    text = job["payload_text"]
    note = f" ({job['payload_problem']})" if job["payload_problem"] else ""
    if whole or len(text) <= PAYLOAD_PREVIEW_CHARS:
        return json_escaped(text) + note
    return f"{len(text.encode())} bytes of JSON{note}; use --payload to show it"


def _history_lines(history: list[Any], full: bool) -> list[str]:
    """The error history: one labelled line per failed attempt (the error's first line, or
    its whole text with ``full``), and a line per replay."""
    if not history:
        return ["errors: none"]
    attempts = sum(1 for entry in history if isinstance(entry, dict) and "error" in entry)
    lines = [f"errors ({attempts} attempt{'' if attempts == 1 else 's'}):"]
    for entry in history:
        if isinstance(entry, dict) and "error" in entry:
            error = str(entry["error"] or "")
            head = escaped(f"  attempt {entry.get('attempt', '?')} at {_when(entry.get('at'))} "
                           f"on worker {entry.get('worker') or '-'}")
            if full:
                lines.append(head + ":")
                lines.extend("    " + line for line in text_lines(error.rstrip("\r\n")))
            else:
                lines.append(f"{head}: {one_line(error)}")
        elif isinstance(entry, dict) and "replayed_at" in entry:
            lines.append(f"  replayed at {_when(entry['replayed_at'])} "
                         "with a fresh attempt budget")
        elif isinstance(entry, dict) and "cancelled_at" in entry:
            lines.append(f"  cancelled at {_when(entry['cancelled_at'])}")
        elif isinstance(entry, dict) and "quarantined_at" in entry:
            lines.append(f"  quarantined at {_when(entry['quarantined_at'])}: "
                         f"{one_line(str(entry.get('reason') or ''))}")
        else:
            lines.append(f"  {one_line(json.dumps(entry, default=str))}")
    return lines


def _when(value: object) -> str:
    """A timestamp from the error history (ISO text in jsonb) in the CLI's format."""
    if isinstance(value, str):
        try:
            return cell(datetime.fromisoformat(value))
        except ValueError:
            return escaped(value)
    return field(value)


def cmd_jobs_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = views.list_jobs(conn, args.state, args.lane, args.limit, args.before)
    if ctx.as_json:
        print_json(rows)
        return 0
    columns = ["id", "lane", "handler", "state", "priority", "run_at", "attempts", "last_error"]
    print_table(columns, [_row_cells(row, columns) for row in rows], empty="no jobs")
    return 0


def _row_cells(row: dict[str, Any], columns: list[str]) -> list[object]:
    return [error_line(row[c]) if c == "last_error" else row[c] for c in columns]


def cmd_dlq_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = views.list_dead(conn, args.lane, args.limit)
    if ctx.as_json:
        print_json(rows)
        return 0
    columns = ["id", "lane", "handler", "attempts", "died_at", "last_error"]
    print_table(columns, [_row_cells(row, columns) for row in rows],
                 empty="the dead-letter queue is empty")
    return 0


def cmd_dlq_replay(ctx: Context, args: argparse.Namespace) -> int:
    if bool(args.ids) == (args.handler is not None):
        raise UsageError("give the ids of dead jobs, or --handler H for all of a handler's"
                         + (", not both" if args.ids else ""))
    if args.lane is not None and args.handler is None:
        raise UsageError("--lane goes with --handler")
    # As quarantine, whose undo this is: the dead jobs of a handler or lane the config does
    # not name (a producer's typo, a lane of another node's config) come back with it; the
    # config's names only tell a typo from a handler with no dead jobs.
    name_rule(args.lane, args.handler)
    with ctx.connect() as conn:
        if args.handler is None:
            replayed = dlq.replay(conn, args.ids)
        else:
            replayed = dlq.replay_handler(conn, args.handler, args.lane)
    if args.handler is not None and not replayed:
        checked_names(ctx.config, args.lane, args.handler)
    if ctx.as_json:
        print_json({"replayed": replayed})
    elif args.handler is not None and not replayed:
        print(f"no dead job of handler {args.handler}"
              + (f" in lane {args.lane}" if args.lane else "") + "; nothing replayed")
    elif len(replayed) > 20:
        print(f"replayed {len(replayed)} job(s): {', '.join(map(str, replayed[:20]))}, ...")
    else:
        print(f"replayed {len(replayed)} job(s): {', '.join(map(str, replayed))}")
    return 0


def cmd_dlq_purge(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        if isinstance(args.before, datetime):
            cutoff = args.before
        else:
            cutoff = views.database_clock(conn) - timedelta(seconds=args.before)
        purged = dlq.purge(conn, cutoff)
    if ctx.as_json:
        print_json({"purged": purged, "before": cutoff})
    else:
        print(f"purged {purged} dead job(s) that died before {cutoff.isoformat()}")
    return 0
