"""The ``jobd`` command line. It only wires arguments to the modules that do the work.

Exit codes: 0 ok, 1 runtime failure, 2 usage or input error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from jobd import dlq, inspect, logs, queue, schedules
from jobd.config import Config, load, parse_duration
from jobd.cron import CronError, CronSchedule
from jobd.db import DEFAULT_SCHEMA, connect, first_line, resolve_url, validate_schema
from jobd.errors import JobdError, UsageError
from jobd.migrate import MigrationMismatch, migrate
from jobd.supervisor import Supervisor, schema_problem

EPILOG = """\
connection: --database-url, else $JOBD_DATABASE_URL, else database.url in the config file
(-c FILE or $JOBD_CONFIG), else postgresql://postgres@127.0.0.1:5432/postgres.
exit codes: 0 ok, 1 runtime failure, 2 usage or input error."""


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def _int32(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"out of range for a 32-bit integer: {value}")
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
                        help="PostgreSQL connection URL")
    common.add_argument("--schema", metavar="NAME", default=default,
                        help=f"schema holding jobd's tables (default: {DEFAULT_SCHEMA})")
    common.add_argument("--json", action="store_true",
                        default=False if default is None else default,
                        help="print data as JSON")
    return common


def build_parser() -> argparse.ArgumentParser:
    # The connection options work before or after the subcommand. Below the subcommand they
    # default to SUPPRESS, so an option given before it is not overwritten by a default.
    common = _common_options(argparse.SUPPRESS)

    parser = _Parser(
        prog="jobd", description="A durable job scheduler whose queue is a PostgreSQL table.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common_options(None)])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)

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
    enqueue_cmd.add_argument("--payload", default="{}", metavar="JSON",
                             help="JSON payload (default: {})")
    enqueue_cmd.add_argument("--lane", default="default", help="lane (default: default)")
    enqueue_cmd.add_argument("--priority", type=_int32, default=0,
                             help="higher runs first (default: 0)")
    when = enqueue_cmd.add_mutually_exclusive_group()
    when.add_argument("--run-at", type=_timestamp, metavar="ISO8601",
                      help="when the job becomes due, with a UTC offset")
    when.add_argument("--delay", type=_duration, metavar="DURATION",
                      help="due after this long by the database clock (e.g. 30s, 5m)")
    enqueue_cmd.add_argument("--idempotency-key", metavar="KEY",
                             help="enqueue at most once per key; repeats print the first id")
    enqueue_cmd.add_argument("--max-attempts", type=_positive_int, metavar="N",
                             help="attempt budget (default: the lane's max_attempts)")
    enqueue_cmd.set_defaults(func=cmd_enqueue)

    status_cmd = add("status", "Per lane: jobs by state, oldest unclaimed age, DLQ depth.")
    status_cmd.set_defaults(func=cmd_status)

    jobs_cmd = add("jobs", "Inspect jobs, live or finished.")
    jobs_sub = jobs_cmd.add_subparsers(dest="jobs_command", metavar="ACTION", required=True,
                                       parser_class=_Parser)
    show = jobs_sub.add_parser("show", parents=[common], help="show one job with its history")
    show.add_argument("id", type=_positive_int)
    show.set_defaults(func=cmd_jobs_show)
    listing = jobs_sub.add_parser("list", parents=[common], help="list jobs, newest first")
    listing.add_argument("--state", choices=inspect.JOB_STATES)
    listing.add_argument("--lane")
    listing.add_argument("--limit", type=_positive_int, default=50)
    listing.set_defaults(func=cmd_jobs_list)

    dlq_cmd = add("dlq", "Operate the dead-letter queue.")
    dlq_sub = dlq_cmd.add_subparsers(dest="dlq_command", metavar="ACTION", required=True,
                                     parser_class=_Parser)
    dlq_list = dlq_sub.add_parser("list", parents=[common], help="list dead jobs, newest first")
    dlq_list.add_argument("--lane")
    dlq_list.add_argument("--limit", type=_positive_int, default=50)
    dlq_list.set_defaults(func=cmd_dlq_list)
    replay = dlq_sub.add_parser("replay", parents=[common],
                                help="requeue dead jobs with a fresh attempt budget")
    replay.add_argument("ids", type=_positive_int, nargs="+", metavar="ID")
    replay.set_defaults(func=cmd_dlq_replay)
    purge = dlq_sub.add_parser("purge", parents=[common],
                               help="delete dead jobs that died before a time")
    purge.add_argument("--before", type=_timestamp_or_age, required=True,
                       metavar="ISO8601|AGE", help="an instant, or an age such as 30d")
    purge.set_defaults(func=cmd_dlq_purge)
    schedules_cmd = add("schedules", "Recurring schedules: list them, or preview a cron "
                                     "expression's occurrences (DST included).")
    schedules_sub = schedules_cmd.add_subparsers(dest="schedules_command", metavar="ACTION",
                                                 required=True, parser_class=_Parser)
    schedules_list = schedules_sub.add_parser(
        "list", parents=[common], help="the schedules in the database with their next fire")
    schedules_list.set_defaults(func=cmd_schedules_list)
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
        applied = migrate(conn, ctx.schema)
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
    size = len(args.payload.encode("utf-8"))
    if size > config.max_payload_bytes:
        raise UsageError(f"payload is {size} bytes, over the limit of "
                         f"{config.max_payload_bytes} (limits.max_payload_bytes)")
    try:
        payload = queue.decode_payload(args.payload)
        spec = queue.JobSpec(args.handler, payload, args.lane, args.run_at, args.priority,
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
        lanes = inspect.lane_status(conn)
        nodes = inspect.node_status(conn)
    # Lanes with no jobs still show when the config or a live node names them.
    served = {lane for node in nodes for lane in node.workers}
    missing = (set(ctx.config.lanes) | served) - {s.lane for s in lanes}
    lanes += [inspect.LaneStatus(name, 0, 0, 0, 0, 0.0) for name in missing]
    lanes.sort(key=lambda s: s.lane)
    rates = inspect.lane_rates(nodes)

    def rate(lane: str, *kinds: str) -> float:
        return sum(rates.get(lane, {}).get(kind, 0.0) for kind in kinds)

    if ctx.as_json:
        _print_json({
            "lanes": [{**s.as_dict(), "claim_rate": rate(s.lane, "claimed"),
                       "failure_rate": rate(s.lane, "failed", "dead")} for s in lanes],
            "nodes": [n.as_dict() for n in nodes],
        })
        return 0
    _print_table(
        ["lane", "pending", "claimed", "failed", "dead (DLQ)", "oldest unclaimed",
         "claims/s", "failures/s"],
        [[s.lane, s.pending, s.claimed, s.failed, s.dead, f"{s.oldest_unclaimed_age:.1f}s",
          f"{rate(s.lane, 'claimed'):.1f}", f"{rate(s.lane, 'failed', 'dead'):.1f}"]
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
    return 0


def cmd_jobs_show(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        job = inspect.get_job(conn, args.id)
    if job is None:
        raise JobdError(f"no job {args.id}")
    if ctx.as_json:
        _print_json(job)
        return 0
    history = job.pop("errors")
    for key, value in job.items():
        rendered = json.dumps(value) if key == "payload" else _cell(value)
        print(f"{key:>16}: {rendered}")
    for entry in history:
        print(f"{'':>16}  {json.dumps(entry, default=str)}")
    return 0


def cmd_jobs_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = inspect.list_jobs(conn, args.state, args.lane, args.limit)
    if ctx.as_json:
        _print_json(rows)
        return 0
    columns = ["id", "lane", "handler", "state", "priority", "run_at", "attempts", "last_error"]
    _print_table(columns, [[row[c] for c in columns] for row in rows], empty="no jobs")
    return 0


def cmd_dlq_list(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        rows = inspect.list_dead(conn, args.lane, args.limit)
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
        rows = schedules.list_schedules(conn)
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    now = row[0]
    listing = []
    for entry in rows:
        cursor = entry["materialized_until"]
        assert isinstance(cursor, datetime)
        local = utc = None
        try:
            cron = CronSchedule.parse(str(entry["cron"]), str(entry["timezone"]))
        except CronError:
            cron = None  # written by another jobd version; list it without a next fire
        if cron is not None and entry["enabled"]:
            following = cron.next_after(max(now, cursor))
            if following:
                local, utc = following[0].local(cron.zone), following[0].fire_at
        listing.append({**entry, "state": "enabled" if entry["enabled"] else "disabled",
                        "next_fire_local": local, "next_fire_utc": utc})
    if ctx.as_json:
        _print_json(listing)
        return 0
    columns = ["id", "cron", "timezone", "next_fire_local", "next_fire_utc", "last_fire_at",
               "state"]
    _print_table(["id", "cron", "zone", "next fire (local)", "next fire (UTC)", "last fire",
                  "state"],
                 [[_local(item[c]) if c == "next_fire_local" else item[c] for c in columns]
                  for item in listing], empty="no schedules")
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


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    text = str(value)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[Context, argparse.Namespace], int] = args.func
    try:
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
        print(f"jobd: database error: {first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
