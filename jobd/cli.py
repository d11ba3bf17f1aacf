"""The ``jobd`` command line. It only wires arguments to the modules that do the work.

Exit codes: 0 ok, 1 runtime failure, 2 usage or input error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from importlib import metadata
from typing import Any

import psycopg

import jobd
from jobd import dlq, logs, queue, schedules, views
from jobd.config import Config, load, parse_duration
from jobd.cron import CronError, CronSchedule
from jobd.db import DEFAULT_SCHEMA, connect, first_line, resolve_url, validate_schema
from jobd.errors import JobdError, UsageError
from jobd.migrate import MigrationMismatch, migrate, schema_problem
from jobd.supervisor import Supervisor

EPILOG = """\
connection: --database-url, else $JOBD_DATABASE_URL, else database.url in the config file
(-c FILE or $JOBD_CONFIG), else postgresql://postgres@127.0.0.1:5432/postgres.
exit codes: 0 ok, 1 runtime failure, 2 usage or input error."""

BIGINT_MAX = 2**63 - 1
# jobs show prints a payload up to this many characters of JSON; longer ones need --payload.
PAYLOAD_PREVIEW_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Context:
    """What every subcommand needs: the config (possibly empty) and how to connect."""

    config: Config
    url: str
    schema: str
    as_json: bool

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return connect(self.url, self.schema, autocommit=autocommit)


# --- argument types ------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    """1 up to the largest bigint: ids and limits go to PostgreSQL as bigint."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    if value > BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"too large: at most {BIGINT_MAX}")
    return value


def _int32(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"out of range for a 32-bit integer: {value}")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (PostgreSQL refuses it)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large for a JSON number (PostgreSQL refuses it)")
    return value


def _contains_nul(value: Any) -> bool:
    """Whether any string (key or value) holds NUL; iterative, so depth cannot overflow."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _payload(text: str) -> Any:
    """The decoded payload: JSON that Python can decode and PostgreSQL can store.

    json.loads accepts NaN and Infinity and turns 1e999 into infinity, none of which jsonb
    holds; it fails with RecursionError on deep nesting and ValueError on integers of more
    than 4300 digits. All of these are the user's input, so they are refused here, at
    argument parsing, with a message instead of a traceback.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(
            "payload is nested too deeply to be decoded") from None
    except ValueError as exc:
        message = str(exc)
        if "integer string conversion" in message:
            message = ("an integer has more than 4300 digits, which a handler could not "
                       "decode")
        raise argparse.ArgumentTypeError(f"payload refused: {message}") from None
    if _contains_nul(value):
        raise argparse.ArgumentTypeError(
            "payload refused: a string contains NUL (\\u0000), which PostgreSQL cannot store")
    return value


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 timestamp: {text!r} (e.g. 2026-12-01T09:30:00+01:00)") from None
    if value.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no UTC offset; add one (e.g. +00:00 or Z) so the instant is exact")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _timestamp_or_age(text: str) -> datetime | float:
    """An instant, or a duration meaning "that long ago" (e.g. 7d)."""
    try:
        return parse_duration(text)
    except ValueError:
        return _timestamp(text)


class _Parser(argparse.ArgumentParser):
    """Reports usage errors in one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# --- parser --------------------------------------------------------------------------------


def _common_options(default: Any) -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("-c", "--config", metavar="FILE", default=default,
                        help="configuration file (default: $JOBD_CONFIG if set)")
    common.add_argument("--database-url", metavar="URL", default=default,
                        help="PostgreSQL connection URL (default: $JOBD_DATABASE_URL, else "
                             "database.url in the config, else "
                             "postgresql://postgres@127.0.0.1:5432/postgres)")
    common.add_argument("--schema", metavar="NAME", default=default,
                        help=f"schema holding jobd's tables (default: database.schema in the "
                             f"config, else {DEFAULT_SCHEMA})")
    common.add_argument("--json", action="store_true",
                        default=False if default is None else default,
                        help="print data as JSON (default: text for people)")
    return common


def build_parser() -> argparse.ArgumentParser:
    # The connection options work before or after the subcommand. Below the subcommand they
    # default to SUPPRESS, so an option given before it is not overwritten by a default.
    common = _common_options(argparse.SUPPRESS)

    parser = _Parser(
        prog="jobd", description="A durable job scheduler whose queue is a PostgreSQL table.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common_options(None)])
    parser.add_argument("--version", action="version", version=f"jobd {version()}",
                        help="print jobd's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser, help="what to do")

    def add(name: str, help_text: str, **kwargs: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], help=help_text,
                                   description=help_text, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   **kwargs)

    run_cmd = add("run", "Run the supervisor daemon in the foreground: lane-pinned worker "
                         "processes, wake-ups, lease sweeps. SIGHUP reloads the config, "
                         "SIGTERM/SIGINT drain (a second one stops fast). Exit code 3: a "
                         "handler cannot be imported.")
    run_cmd.set_defaults(func=cmd_run)

    migrate_cmd = add("migrate", "Create or upgrade jobd's schema (safe to run on many nodes at "
                                 "once).")
    migrate_cmd.set_defaults(func=cmd_migrate)

    enqueue_cmd = add("enqueue", "Enqueue one job and print its id.")
    enqueue_cmd.add_argument("handler", help="handler name (from the config's handlers)")
    enqueue_cmd.add_argument("--payload", type=_payload, default="{}", metavar="JSON",
                             help="JSON payload (default: {})")
    enqueue_cmd.add_argument("--lane", default="default", help="lane (default: default)")
    enqueue_cmd.add_argument("--priority", type=_int32, default=0,
                             help="higher runs first (default: 0)")
    when = enqueue_cmd.add_mutually_exclusive_group()
    when.add_argument("--run-at", type=_timestamp, metavar="ISO8601",
                      help="when the job becomes due, with a UTC offset (default: now)")
    when.add_argument("--delay", type=_duration, metavar="DURATION",
                      help="due after this long by the database clock, e.g. 30s, 5m "
                           "(default: due now)")
    enqueue_cmd.add_argument("--idempotency-key", metavar="KEY",
                             help="enqueue at most once per key; repeats print the first id "
                                  "(default: no key)")
    enqueue_cmd.add_argument("--max-attempts", type=_positive_int, metavar="N",
                             help="attempt budget (default: the lane's max_attempts)")
    enqueue_cmd.set_defaults(func=cmd_enqueue)

    status_cmd = add("status", "Per lane: jobs by state, oldest unclaimed age, DLQ depth, "
                               "rates and live workers (lanes no live worker serves are "
                               "marked); live nodes.")
    status_cmd.set_defaults(func=cmd_status)

    jobs_cmd = add("jobs", "Inspect jobs, live or finished.")
    jobs_sub = jobs_cmd.add_subparsers(dest="jobs_command", metavar="ACTION", required=True,
                                       parser_class=_Parser, help="what to do with jobs")
    show = jobs_sub.add_parser("show", parents=[common], help="show one job with its history")
    show.add_argument("id", type=_positive_int, help="the job's id")
    show.add_argument("--payload", action="store_true",
                      help=f"print the payload however long (default: only payloads of at "
                           f"most {PAYLOAD_PREVIEW_CHARS} characters, else their size)")
    show.add_argument("--full-errors", action="store_true",
                      help="print each attempt's whole error text, traceback included "
                           "(default: its first line)")
    show.set_defaults(func=cmd_jobs_show)
    listing = jobs_sub.add_parser("list", parents=[common], help="list jobs, newest first")
    listing.add_argument("--state", choices=views.JOB_STATES,
                         help="only jobs in this state (default: any)")
    listing.add_argument("--lane", help="only jobs of this lane (default: any)")
    listing.add_argument("--limit", type=_positive_int, default=50,
                         help="at most this many (default: 50)")
    listing.set_defaults(func=cmd_jobs_list)

    dlq_cmd = add("dlq", "Operate the dead-letter queue.")
    dlq_sub = dlq_cmd.add_subparsers(dest="dlq_command", metavar="ACTION", required=True,
                                     parser_class=_Parser, help="what to do with dead jobs")
    dlq_list = dlq_sub.add_parser("list", parents=[common], help="list dead jobs, newest first")
    dlq_list.add_argument("--lane", help="only dead jobs of this lane (default: any)")
    dlq_list.add_argument("--limit", type=_positive_int, default=50,
                          help="at most this many (default: 50)")
    dlq_list.set_defaults(func=cmd_dlq_list)
    replay = dlq_sub.add_parser("replay", parents=[common],
                                help="requeue dead jobs with a fresh attempt budget")
    replay.add_argument("ids", type=_positive_int, nargs="+", metavar="ID",
                        help="ids of dead jobs; all are replayed or none")
    replay.set_defaults(func=cmd_dlq_replay)
    purge = dlq_sub.add_parser("purge", parents=[common],
                               help="delete dead jobs that died before a time")
    purge.add_argument("--before", type=_timestamp_or_age, required=True,
                       metavar="ISO8601|AGE", help="an instant, or an age such as 30d")
    purge.set_defaults(func=cmd_dlq_purge)
    schedules_cmd = add("schedules", "Recurring schedules: list them, disable or enable one, "
                                     "or preview a cron expression's occurrences (DST "
                                     "included).")
    schedules_sub = schedules_cmd.add_subparsers(dest="schedules_command", metavar="ACTION",
                                                 required=True, parser_class=_Parser)
    schedules_list = schedules_sub.add_parser(
        "list", parents=[common],
        help="the schedules in the database with their next fire, the live nodes declaring "
             "them and their state (enabled, conflict, undeclared, disabled)")
    schedules_list.set_defaults(func=cmd_schedules_list)
    for action, summary in (
            ("disable", "retire a schedule: no node fires it, whatever the configs declare, "
                        "until it is enabled again"),
            ("enable", "let a disabled schedule fire again while a live node declares it; "
                       "occurrences due while it was disabled are skipped")):
        toggle = schedules_sub.add_parser(action, parents=[common], help=summary,
                                          description=summary)
        toggle.add_argument("id", metavar="ID", help="the schedule's id (see schedules list)")
        toggle.set_defaults(func=cmd_schedules_toggle, enabled=action == "enable")
    preview = schedules_sub.add_parser(
        "next", parents=[common],
        help="occurrences of an expression strictly after --from, with the materializer's "
             "DST policy")
    preview.add_argument("--cron", required=True, metavar="EXPR",
                         help='five fields, e.g. "30 2 * * *", or @daily, @hourly ...')
    preview.add_argument("--tz", default="UTC", metavar="ZONE",
                         help="IANA time zone (default: UTC)")
    preview.add_argument("--from", dest="start", type=_timestamp, metavar="ISO8601",
                         help="start instant, with a UTC offset (default: now)")
    preview.add_argument("--count", type=_positive_int, default=10, help="how many (default 10)")
    preview.set_defaults(func=cmd_schedules_next)
    return parser


# --- commands ------------------------------------------------------------------------------


def cmd_run(ctx: Context, _args: argparse.Namespace) -> int:
    if ctx.config.path is None:
        raise UsageError("jobd run needs a config file: -c FILE (or $JOBD_CONFIG)")
    config = replace(ctx.config, schema=ctx.schema)
    logs.configure(config.log_level, process="supervisor")
    with ctx.connect() as conn:
        problem = schema_problem(conn)
    if problem:
        raise UsageError(problem)
    return Supervisor(config, ctx.url).run()


def cmd_migrate(ctx: Context, _args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        applied = migrate(conn, ctx.schema, max_payload_bytes=ctx.config.max_payload_bytes)
    names = [f"{m.version:04d}_{m.name}" for m in applied]
    if ctx.as_json:
        _print_json({"schema": ctx.schema, "applied": names})
    elif names:
        print(f"applied to schema {ctx.schema}: {', '.join(names)}")
    else:
        print(f"schema {ctx.schema} is up to date")
    return 0


def cmd_enqueue(ctx: Context, args: argparse.Namespace) -> int:
    config = ctx.config
    if config.handlers and args.handler not in config.handlers:
        raise UsageError(f"unknown handler {args.handler!r}; the config allows: "
                         + ", ".join(sorted(config.handlers)))
    if config.lanes and args.lane not in config.lanes:
        raise UsageError(f"unknown lane {args.lane!r}; the config has: "
                         + ", ".join(sorted(config.lanes)))
    # The payload size limit is the database's (jobd.settings), checked there for every
    # entry point alike: a larger payload comes back as an input error (exit 2).
    try:
        spec = queue.JobSpec(args.handler, args.payload, args.lane, args.run_at, args.priority,
                             args.idempotency_key, args.max_attempts).validated()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with ctx.connect() as conn:
        job_id = queue.enqueue(
            conn, spec.handler, spec.payload, lane=spec.lane, run_at=spec.run_at,
            delay=args.delay, priority=spec.priority, idempotency_key=spec.idempotency_key,
            max_attempts=spec.max_attempts, schema=ctx.schema)
    if ctx.as_json:
        _print_json({"id": job_id})
    else:
        print(job_id)
    return 0


def cmd_status(ctx: Context, _args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        lanes = views.lane_status(conn)
        nodes = views.node_status(conn)
        conflicts = schedules.conflicts(conn)
    # Lanes with no jobs still show when the config or a live node names them.
    workers = views.live_workers(nodes)
    missing = (set(ctx.config.lanes) | set(workers)) - {s.lane for s in lanes}
    lanes += [views.LaneStatus(name, 0, 0, 0, 0, 0.0) for name in missing]
    lanes.sort(key=lambda s: s.lane)
    rates = views.lane_rates(nodes)

    def rate(lane: str, *kinds: str) -> float:
        return sum(rates.get(lane, {}).get(kind, 0.0) for kind in kinds)

    if ctx.as_json:
        _print_json({
            "lanes": [{**s.as_dict(), "claim_rate": rate(s.lane, "claimed"),
                       "failure_rate": rate(s.lane, "failed", "dead"),
                       "live_workers": workers.get(s.lane, 0),
                       "served": workers.get(s.lane, 0) > 0} for s in lanes],
            "nodes": [n.as_dict() for n in nodes],
            "schedule_conflicts": [
                {"schedule": c.schedule_id, "stored_by": list(c.stored_by),
                 "differing": list(c.differing)} for c in conflicts],
        })
        return 0
    _print_table(
        ["lane", "pending", "claimed", "failed", "dead (DLQ)", "oldest unclaimed",
         "claims/s", "failures/s", "live workers"],
        [[s.lane, s.pending, s.claimed, s.failed, s.dead, f"{s.oldest_unclaimed_age:.1f}s",
          f"{rate(s.lane, 'claimed'):.1f}", f"{rate(s.lane, 'failed', 'dead'):.1f}",
          _served(workers.get(s.lane, 0))]
         for s in lanes],
        empty="no jobs and no lanes configured",
    )
    print()
    _print_table(
        ["node", "pid", "workers", "last seen"],
        [[n.node, n.pid, ", ".join(f"{lane}: {count}" for lane, count in n.workers.items()),
          n.seen_at] for n in nodes],
        empty="no live nodes (no daemon has reported in the last minute)",
    )
    _print_schedule_conflicts(conflicts)
    return 0


def _print_schedule_conflicts(found: list[schedules.Conflict]) -> None:
    if not found:
        return
    print()
    print("schedules with conflicting definitions on live nodes (the stored one is kept):")
    for conflict in found:
        print(f"  {conflict.schedule_id}: stored by {', '.join(conflict.stored_by) or '-'}; "
              f"differing: {', '.join(conflict.differing)}")


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
        _print_json({**_job_json(job), "effective_max_attempts": limit,
                     "max_attempts_source": source})
        return 0
    history = job["errors"]
    for key, value in job.items():
        if key in ("payload", "payload_text", "payload_problem", "errors"):
            continue
        if key == "max_attempts":
            value = _max_attempts_text(ctx.config, job, limit, source)
        print(f"{key:>16}: {_field(value)}")
    print(f"{'payload':>16}: {_payload_text(job, args.payload)}")
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
    if source == "job":
        return str(limit)
    if source == "lane":
        return f"{limit} (lane default)"
    if config.path is not None:
        return (f"lane default (lane {job['lane']!r} is not in {config.path}; the config of "
                "the daemons that run it decides)")
    return "lane default (from the daemons' config; pass -c FILE to see it)"


def _payload_text(job: dict[str, Any], whole: bool) -> str:
    text = job["payload_text"]
    note = f" ({job['payload_problem']})" if job["payload_problem"] else ""
    if whole or len(text) <= PAYLOAD_PREVIEW_CHARS:
        return text + note
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
            head = (f"  attempt {entry.get('attempt', '?')} at {_when(entry.get('at'))} "
                    f"on worker {entry.get('worker') or '-'}")
            if full:
                lines.append(head + ":")
                lines.extend("    " + line for line in error.splitlines() or [""])
            else:
                lines.append(f"{head}: {_first_line(error)}")
        elif isinstance(entry, dict) and "replayed_at" in entry:
            lines.append(f"  replayed at {_when(entry['replayed_at'])} "
                         "with a fresh attempt budget")
        else:
            lines.append(f"  {_first_line(json.dumps(entry, default=str))}")
    return lines


def _when(value: object) -> str:
    """A timestamp from the error history (ISO text in jsonb) in the CLI's format."""
    if isinstance(value, str):
        try:
            return _cell(datetime.fromisoformat(value))
        except ValueError:
            return value
    return _field(value)


def cmd_jobs_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = views.list_jobs(conn, args.state, args.lane, args.limit)
    if ctx.as_json:
        _print_json(rows)
        return 0
    columns = ["id", "lane", "handler", "state", "priority", "run_at", "attempts", "last_error"]
    _print_table(columns, [[row[c] for c in columns] for row in rows], empty="no jobs")
    return 0


def cmd_dlq_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = views.list_dead(conn, args.lane, args.limit)
    if ctx.as_json:
        _print_json(rows)
        return 0
    columns = ["id", "lane", "handler", "attempts", "died_at", "last_error"]
    _print_table(columns, [[row[c] for c in columns] for row in rows],
                 empty="the dead-letter queue is empty")
    return 0


def cmd_dlq_replay(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        replayed = dlq.replay(conn, args.ids)
    if ctx.as_json:
        _print_json({"replayed": replayed})
    else:
        print(f"replayed {len(replayed)} job(s): {', '.join(map(str, replayed))}")
    return 0


def cmd_dlq_purge(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        if isinstance(args.before, datetime):
            cutoff = args.before
        else:
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            cutoff = row[0] - timedelta(seconds=args.before)
        purged = dlq.purge(conn, cutoff)
    if ctx.as_json:
        _print_json({"purged": purged, "before": cutoff})
    else:
        print(f"purged {purged} dead job(s) that died before {cutoff.isoformat()}")
    return 0


def cmd_schedules_list(ctx: Context, _args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        listing = schedules.listing(conn)
    if ctx.as_json:
        _print_json(listing)
        return 0
    _print_table(["id", "cron", "zone", "next fire (local)", "next fire (UTC)", "last fire",
                  "nodes", "state"],
                 [[item["id"], item["cron"], item["timezone"], _local(item["next_fire_local"]),
                   item["next_fire_utc"], item["last_fire_at"], len(item["declared_by"]),
                   item["state"]] for item in listing], empty="no schedules")
    return 0


def cmd_schedules_toggle(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        try:
            changed, declared = schedules.set_enabled(conn, args.id, args.enabled)
        except schedules.UnknownSchedule:
            known = schedules.schedule_ids(conn)
            raise UsageError(f"no schedule {args.id!r}; known: "
                             + (", ".join(known) if known else "none")) from None
    if ctx.as_json:
        _print_json({"id": args.id, "enabled": args.enabled, "changed": changed,
                     "declared": declared})
        return 0
    word = "enabled" if args.enabled else "disabled"
    if not changed:
        print(f"schedule {args.id} was already {word}")
    elif not args.enabled:
        print(f"schedule {args.id} disabled: no node fires it until "
              f"`jobd schedules enable {args.id}`")
    else:
        print(f"schedule {args.id} enabled; occurrences due while it was disabled are skipped")
    if args.enabled and not declared:
        print(f"(no live node declares {args.id}: it fires once a running node's config has it)")
    return 0


def cmd_schedules_next(ctx: Context, args: argparse.Namespace) -> int:
    try:
        cron = CronSchedule.parse(args.cron, args.tz)
    except CronError as exc:
        raise UsageError(str(exc)) from None
    start = args.start or datetime.now(UTC)
    occurrences = cron.next_after(start, args.count)
    if ctx.as_json:
        _print_json([o.local(cron.zone).isoformat() for o in occurrences])
        return 0
    kind = "wildcard: fires by real time" if cron.wildcard else "fixed time: once per local time"
    print(f"{cron.expression} in {cron.zone.key} ({kind})")
    if len(occurrences) < args.count:
        print(f"(only {len(occurrences)} occurrence(s) within 30 years of the start)")
    _print_table(["local", "UTC", "occurrence key"],
                 [[_local(o.local(cron.zone)), o.fire_at, o.key] for o in occurrences],
                 empty="no occurrence in the next 30 years")
    return 0


# --- output --------------------------------------------------------------------------------


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(data: object) -> None:
    print(json.dumps(data, default=_json_default, indent=2))


def _first_line(text: str) -> str:
    """The first line of a text; "..." marks that more lines follow (tracebacks)."""
    lines = text.strip().splitlines()
    if not lines:
        return ""
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _field(value: object) -> str:
    """A value on one line: jobs show's fields."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return _first_line(str(value))


def _cell(value: object) -> str:
    """A value in a table cell: one line (a traceback must not break the rows), at most 60
    characters."""
    text = _field(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _local(value: object) -> str:
    """A local time with its UTC offset, e.g. 2026-03-29 03:00 +02:00."""
    if not isinstance(value, datetime):
        return _cell(value)
    return value.strftime("%Y-%m-%d %H:%M:%S %z")[:-2] + ":" + value.strftime("%z")[-2:]


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], empty: str) -> None:
    if not rows:
        print(f"({empty})")
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# --- entry point ---------------------------------------------------------------------------


def _context(args: argparse.Namespace) -> Context:
    config_path = args.config or os.environ.get("JOBD_CONFIG")
    config = load(config_path) if config_path else Config()
    schema = validate_schema(args.schema or config.schema)
    url = resolve_url(args.database_url, config.database_url)
    return Context(config=config, url=url, schema=schema, as_json=args.json)


def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    try:
        return metadata.version("jobd")
    except metadata.PackageNotFoundError:
        return str(getattr(jobd, "__version__", "unknown"))


def _refuse_nul(args: argparse.Namespace) -> None:
    """PostgreSQL text cannot hold NUL; psycopg would refuse it with a DataError mid-command,
    so it is refused before anything runs, naming the argument."""
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and "\x00" in v for v in values):
            raise UsageError(f"{dest.replace('_', '-')}: NUL characters are not allowed")


# SQLSTATEs that mean the database refused the user's input rather than failed: class 22
# (data exception: a value out of range, invalid text, a check in jobd.enqueue), a CHECK
# constraint (23514) and a value over a limit such as an index entry's size (54000).
_INPUT_SQLSTATES = ("23514", "54000")


def _is_input_error(exc: psycopg.Error) -> bool:
    state = exc.sqlstate or ""
    return (isinstance(exc, psycopg.DataError) or state.startswith("22")
            or state in _INPUT_SQLSTATES)


def _server_message(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or first_line(exc)


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[Context, argparse.Namespace], int] = args.func
    try:
        _refuse_nul(args)
        return func(_context(args), args)
    except JobdError as exc:
        print(f"jobd: {exc}", file=sys.stderr)
        return exc.exit_code
    except MigrationMismatch as exc:
        print(f"jobd: {exc}", file=sys.stderr)
        return 1
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction,
            psycopg.errors.InvalidSchemaName):
        print("jobd: jobd's schema is missing or incomplete in this database; run "
              "`jobd migrate` first", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        if _is_input_error(exc):
            print(f"jobd: {_server_message(exc)}", file=sys.stderr)
            return 2
        print(f"jobd: database error: {first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            # Flushed here, not at interpreter exit, so a closed pipe is caught below.
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`jobd jobs list | head`): that is not an error worth a
        # traceback. As the Python docs recommend, point stdout at devnull so the final
        # flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
