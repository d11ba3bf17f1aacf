"""The ``jobd`` argument parser: :func:`build_parser`, and the parser that reports usage
errors in one line with exit code 2. The argument types are in :mod:`jobd.cli_types`.

Each subcommand's parser names the function that implements it (``func``), in
:mod:`jobd.commands`, :mod:`jobd.commands_jobs`, :mod:`jobd.commands_controls` or
:mod:`jobd.commands_schedules`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import TYPE_CHECKING, Any

import jobd
from jobd import views
from jobd.cli_output import print_json
from jobd.cli_types import (
    delay,
    int32,
    interval,
    lane_name,
    not_empty,
    payload_argument,
    positive_int,
    timestamp,
    timestamp_or_age,
    up_to,
    where,
)
from jobd.commands import cmd_enqueue, cmd_migrate, cmd_run, cmd_top
from jobd.commands_controls import (
    cmd_dlq_quarantine,
    cmd_jobs_cancel,
    cmd_lanes_pause,
    cmd_lanes_resume,
)
from jobd.commands_jobs import (
    PAYLOAD_PREVIEW_CHARS,
    cmd_dlq_list,
    cmd_dlq_purge,
    cmd_dlq_replay,
    cmd_jobs_list,
    cmd_jobs_show,
    cmd_status,
)
from jobd.commands_schedules import cmd_schedules_list, cmd_schedules_next, cmd_schedules_toggle
from jobd.db import DEFAULT_SCHEMA
from jobd.errors import printable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from _typeshed import SupportsWrite  # what argparse's print_help takes

# schedules next builds its answer in memory: a bound on what it may be asked for.
MAX_PREVIEW = 10_000

EPILOG = """\
connection: --database-url, else $JOBD_DATABASE_URL, else database.url in the config file
(-c FILE or $JOBD_CONFIG), else postgresql://postgres@127.0.0.1:5432/postgres.
exit codes: 0 ok, 1 runtime failure, 2 usage or input error, 3 (jobd run) a handler
cannot be imported."""



def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    try:
        return metadata.version("jobd")
    except metadata.PackageNotFoundError:
        return str(getattr(jobd, "__version__", "unknown"))


class _Parser(argparse.ArgumentParser):
    """Reports usage errors in one line with exit code 2."""

    def error(self, message: str, prog: str | None = None) -> None:  # type: ignore[override]
        prog = prog or self.prog
        self.exit(2, f"{prog}: {printable(message)} (see {prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        # argparse reports arguments no parser took from the top parser ("jobd: ... see
        # jobd --help", whose help lists the commands); the command's own help lists the
        # options that were meant.
        parsed, extras = self.parse_known_args(args, namespace)
        if getattr(parsed, PRINTS_NO_DATA, False) and parsed.json:
            # `jobd --json run`: the top parser took it, for a command that would ignore it.
            extras = ["--json", *extras]
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}",
                       getattr(parsed, COMMAND_PROG, None))
        return parsed

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        # argparse ignores a write that fails: the help is output like any other, and a
        # full disk is reported as for --version (jobd.cli.main), not an exit code 0.
        (file or sys.stdout).write(self.format_help())


# --- parser --------------------------------------------------------------------------------


def _common_options(default: Any, *, prints_data: bool = True) -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("-c", "--config", metavar="FILE", default=default, type=not_empty,
                        help="configuration file (default: $JOBD_CONFIG if set)")
    common.add_argument("--database-url", metavar="URL", default=default, type=not_empty,
                        help="PostgreSQL connection URL (default: $JOBD_DATABASE_URL, else "
                             "database.url in the config, else "
                             "postgresql://postgres@127.0.0.1:5432/postgres)")
    common.add_argument("--schema", metavar="NAME", default=default, type=not_empty,
                        help=f"schema holding jobd's tables (default: database.schema in the "
                             f"config, else {DEFAULT_SCHEMA})")
    if prints_data:
        common.add_argument("--json", action="store_true",
                            default=False if default is None else default,
                            help="print data as JSON (default: text for people)")
    return common


class _Version(argparse.Action):
    """--version: the version as text, or as JSON when --json came before it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, "json", False):
            print_json({"version": version()})
        else:
            print(f"jobd {version()}")
        parser.exit()


# The parsed arguments name the innermost command given (its parser's prog, "jobd jobs
# list"), for a usage error that only the top parser sees.
COMMAND_PROG = "_command_prog"
# Set by a command that prints no data (jobd run): --json before it is refused too.
PRINTS_NO_DATA = "_prints_no_data"


def _named(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.set_defaults(**{COMMAND_PROG: parser.prog})
    return parser


def build_parser() -> argparse.ArgumentParser:
    # The connection options work before or after the subcommand. Below the subcommand they
    # default to SUPPRESS, so an option given before it is not overwritten by a default.
    common = _common_options(argparse.SUPPRESS)
    # A command that prints no data does not offer --json: given, it is a usage error.
    no_data = _common_options(argparse.SUPPRESS, prints_data=False)

    parser = _Parser(
        prog="jobd", description="A durable job scheduler whose queue is a PostgreSQL table.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common_options(None)])
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print jobd's version and exit ({\"version\": ...} after --json)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser, help="what to do")

    def add(name: str, help_text: str, *, prints_data: bool = True) -> argparse.ArgumentParser:
        command = _named(commands.add_parser(
            name, parents=[common if prints_data else no_data], help=help_text,
            description=help_text, epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter))
        if not prints_data:
            command.set_defaults(**{PRINTS_NO_DATA: True})
        return command

    def leaf(actions: Any, name: str, help_text: str) -> argparse.ArgumentParser:
        """An action of a command (jobs show, dlq replay ...), explained in its own --help."""
        return _named(actions.add_parser(
            name, parents=[common], help=help_text, description=help_text, epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter))

    run_cmd = add("run", "Run the supervisor daemon in the foreground: lane-pinned worker "
                         "processes, wake-ups, lease sweeps. SIGHUP reloads the config, "
                         "SIGTERM/SIGINT drain (a second one stops fast). Needs a config "
                         "file (-c FILE or $JOBD_CONFIG). Exit code 3: a handler cannot be "
                         "imported.", prints_data=False)
    run_cmd.set_defaults(func=cmd_run)

    migrate_cmd = add("migrate", "Create or upgrade jobd's schema (safe to run on many nodes at "
                                 "once).")
    migrate_cmd.add_argument(
        "--grant-runtime", action="append", metavar="ROLE", type=not_empty,
        help="give ROLE what the daemon and the CLI need: rows, sequences, functions; no "
             "DDL (repeatable; default: none). Every later migrate grants it again")
    migrate_cmd.add_argument(
        "--grant-producer", action="append", metavar="ROLE", type=not_empty,
        help="let ROLE call enqueue and nothing else (repeatable; default: none)")
    migrate_cmd.set_defaults(func=cmd_migrate)

    enqueue_cmd = add("enqueue", "Enqueue one job and print its id.")
    enqueue_cmd.add_argument("handler", help="handler name (from the config's handlers)")
    enqueue_cmd.add_argument("--payload", type=payload_argument, default="{}", metavar="JSON",
                             help="JSON payload; @FILE reads it from a file, - from standard "
                                  "input (default: {})")
    enqueue_cmd.add_argument("--lane", default="default", help="lane (default: default)")
    enqueue_cmd.add_argument("--priority", type=int32, default=0,
                             help="higher runs first (default: 0)")
    when = enqueue_cmd.add_mutually_exclusive_group()
    when.add_argument("--run-at", type=timestamp, metavar="ISO8601",
                      help="when the job becomes due, with a UTC offset (default: now)")
    when.add_argument("--delay", type=delay, metavar="DURATION",
                      help="due after this long by the database clock, e.g. 30s, 5m "
                           "(default: due now)")
    enqueue_cmd.add_argument("--idempotency-key", metavar="KEY",
                             help="enqueue at most once per key; repeats print the first id "
                                  "(default: no key)")
    enqueue_cmd.add_argument("--max-attempts", type=up_to(2**31 - 1), metavar="N",
                             help="attempt budget (default: the lane's max_attempts)")
    enqueue_cmd.add_argument("--fairness-key", metavar="KEY",
                             help="the job's share key in a fair lane (fair_by), e.g. a "
                                  "tenant id (default: its handler)")
    enqueue_cmd.set_defaults(func=cmd_enqueue)

    status_cmd = add("status", "Per lane: jobs by state, oldest unclaimed age, DLQ depth, "
                               "rates and live workers (lanes no live worker serves are "
                               "marked), pauses, and with -c the handlers with jobs waiting "
                               "that the config does not list; every node, live or gone.")
    status_cmd.set_defaults(func=cmd_status)

    top_cmd = add("top", "A live view of the queue, refreshed every --interval: per lane "
                         "depth, due/scheduled/claimed/retrying, rates, claim-to-finish and "
                         "pickup percentiles, oldest unclaimed age against the lane's SLO "
                         "(highlighted when over it), DLQ depth, workers; live nodes. q or "
                         "Ctrl-C quits. Reads the database alone. Prints one plain snapshot "
                         "when stdout is not a terminal (or one that cannot place its cursor: "
                         "$TERM unset, unknown or dumb), with --once, or as JSON with --json.")
    top_cmd.add_argument("--interval", type=interval, default=1.0, metavar="DURATION",
                         help="time between refreshes, e.g. 1s, 500ms, 5s (default: 1s, at "
                              "least 100ms)")
    top_cmd.add_argument("--once", action="store_true",
                         help="print one plain snapshot and exit, even on a terminal "
                              "(default: live on a terminal)")
    top_cmd.set_defaults(func=cmd_top)

    jobs_cmd = add("jobs", "Inspect jobs, live or finished.")
    jobs_sub = jobs_cmd.add_subparsers(dest="jobs_command", metavar="ACTION", required=True,
                                       parser_class=_Parser, help="what to do with jobs")
    show = leaf(jobs_sub, "show", "show one job with its history")
    show.add_argument("id", type=positive_int, help="the job's id")
    show.add_argument("--payload", action="store_true",
                      help=f"print the payload however long (default: only payloads of at "
                           f"most {PAYLOAD_PREVIEW_CHARS} characters, else their size)")
    show.add_argument("--full-errors", action="store_true",
                      help="print each attempt's whole error text, traceback included "
                           "(default: its first line)")
    show.set_defaults(func=cmd_jobs_show)
    listing = leaf(jobs_sub, "list", "list jobs, newest first")
    listing.add_argument("--state", choices=views.JOB_STATES,
                         help="only jobs in this state (default: any)")
    listing.add_argument("--lane", type=lane_name, help="only jobs of this lane (default: any)")
    listing.add_argument("--limit", type=positive_int, default=50,
                         help="at most this many (default: 50)")
    listing.add_argument("--before", type=positive_int, metavar="ID",
                         help="only jobs with a lower id: the next page starts below the "
                              "last id shown (default: from the newest job)")
    listing.set_defaults(func=cmd_jobs_list)
    cancel = leaf(
        jobs_sub, "cancel",
        "cancel jobs: pending or failed ones become cancelled at once (archived, shown "
        "by jobs show and all_jobs); running ones are asked to stop and are recorded "
        "cancelled when their run ends, whatever it returns")
    cancel.add_argument("ids", type=positive_int, nargs="+", metavar="ID",
                        help="ids of jobs; an id that names no job cancels nothing at all")
    cancel.set_defaults(func=cmd_jobs_cancel)

    dlq_cmd = add("dlq", "Operate the dead-letter queue.")
    dlq_sub = dlq_cmd.add_subparsers(dest="dlq_command", metavar="ACTION", required=True,
                                     parser_class=_Parser, help="what to do with dead jobs")
    dlq_list = leaf(dlq_sub, "list", "list dead jobs, newest first")
    dlq_list.add_argument("--lane", type=lane_name,
                          help="only dead jobs of this lane (default: any)")
    dlq_list.add_argument("--limit", type=positive_int, default=50,
                          help="at most this many (default: 50)")
    dlq_list.set_defaults(func=cmd_dlq_list)
    replay = leaf(
        dlq_sub, "replay",
        "requeue dead jobs with a fresh attempt budget, by id or every dead job of a "
        "handler; each is due at once, or at its own run_at if later (a quarantined "
        "job scheduled for later)")
    replay.add_argument("ids", type=positive_int, nargs="*", metavar="ID",
                        help="ids of dead jobs; all are replayed or none")
    replay.add_argument("--handler", metavar="H",
                        help="replay every dead job of this handler instead of ids "
                             "(default: by id)")
    replay.add_argument("--lane", metavar="L", type=lane_name,
                        help="with --handler: only its dead jobs of this lane (default: any)")
    replay.set_defaults(func=cmd_dlq_replay)
    quarantine = leaf(
        dlq_sub, "quarantine",
        "move every pending or failed job of a handler to the dead-letter queue in one "
        "statement (a poison payload that keeps arriving); running jobs are left to "
        "finish; dlq replay --handler brings them back")
    quarantine.add_argument("--handler", required=True, metavar="H", help="the handler")
    quarantine.add_argument("--lane", metavar="L",
                            help="only its jobs of this lane (default: every lane)")
    quarantine.add_argument("--where", type=where, action="append", default=[],
                            metavar="KEY=VALUE",
                            help="only jobs whose payload has this top-level field (JSON "
                                 "containment; VALUE is JSON if it parses, else text: "
                                 "customer=42, email=a@example.com, 'code=\"42\"'); "
                                 "repeat to require several (default: every payload)")
    quarantine.set_defaults(func=cmd_dlq_quarantine)
    purge = leaf(
        dlq_sub, "purge",
        "delete dead jobs that died before a time")
    purge.add_argument("--before", type=timestamp_or_age, required=True,
                       metavar="ISO8601|AGE",
                       help="an instant with its UTC offset (2024-01-01T00:00:00Z), or an "
                            "age with its unit such as 30d or 12h (a number without a unit "
                            "is refused: it could be either)")
    purge.set_defaults(func=cmd_dlq_purge)
    lanes_cmd = add("lanes", "Pause and resume a lane, or one handler of a lane, on every "
                             "node at once (kept in the database: restarts keep it).")
    lanes_sub = lanes_cmd.add_subparsers(dest="lanes_command", metavar="ACTION",
                                         required=True, parser_class=_Parser)
    for action, summary in (
            ("pause", "stop starting the lane's jobs (or one handler's) on every node within "
                      "about a second; running jobs finish, jobs claimed ahead go back to "
                      "the queue"),
            ("resume", "end a pause made with the same arguments: the lane's own, or with "
                       "--handler that handler's (other pauses stay)")):
        control = leaf(lanes_sub, action, summary)
        control.add_argument("lane", metavar="LANE", help="the lane")
        control.add_argument("--handler", metavar="H",
                             help="only this handler's jobs in the lane (default: the whole "
                                  "lane)")
        control.set_defaults(func=cmd_lanes_pause if action == "pause" else cmd_lanes_resume)
    schedules_cmd = add("schedules", "Recurring schedules: list them, disable or enable one, "
                                     "or preview a cron expression's occurrences (DST "
                                     "included).")
    schedules_sub = schedules_cmd.add_subparsers(dest="schedules_command", metavar="ACTION",
                                                 required=True, parser_class=_Parser)
    schedules_list = leaf(
        schedules_sub, "list",
        "the schedules in the database with their next fire, the live nodes declaring "
        "them and their state (enabled, conflict, undeclared, disabled)")
    schedules_list.set_defaults(func=cmd_schedules_list)
    for action, summary in (
            ("disable", "retire a schedule: no node fires it, whatever the configs declare, "
                        "until it is enabled again"),
            ("enable", "let a disabled schedule fire again while a live node declares it; "
                       "occurrences due while it was disabled are skipped")):
        toggle = leaf(schedules_sub, action, summary)
        toggle.add_argument("id", metavar="ID", help="the schedule's id (see schedules list)")
        toggle.set_defaults(func=cmd_schedules_toggle, enabled=action == "enable")
    preview = leaf(
        schedules_sub, "next",
        "occurrences of an expression strictly after --from, with the materializer's "
        "DST policy")
    preview.add_argument("--cron", required=True, metavar="EXPR",
                         help='five fields, e.g. "30 2 * * *", or @daily, @hourly ...')
    preview.add_argument("--tz", default="UTC", metavar="ZONE",
                         help="IANA time zone (default: UTC)")
    preview.add_argument("--from", dest="start", type=timestamp, metavar="ISO8601",
                         help="start instant, with a UTC offset (default: now)")
    preview.add_argument("--count", type=up_to(MAX_PREVIEW), default=10,
                         help=f"how many (default 10, at most {MAX_PREVIEW:,})")
    preview.set_defaults(func=cmd_schedules_next)
    return parser
