"""The ``jobd`` subcommands that set jobd up and feed it: ``run`` (the supervisor daemon),
``migrate`` and ``enqueue``; and ``top``, the live view of what it does.

The subcommands that inspect and operate the queue are in :mod:`jobd.commands_jobs`, those
for recurring schedules in :mod:`jobd.commands_schedules`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import psycopg

from jobd import jobs, logs, producer, top, top_screen
from jobd.cli_context import Context
from jobd.cli_output import print_json
from jobd.errors import JobdError, UsageError
from jobd.grants import RefusedGrant
from jobd.migrate import ForeignSchema, NotOwner, Upgrade, schema_problem, upgrade
from jobd.supervisor import Supervisor


def cmd_run(ctx: Context, _args: argparse.Namespace) -> int:
    if ctx.config.path is None:
        raise UsageError("jobd run needs a config file: -c FILE (or $JOBD_CONFIG)")
    config = replace(ctx.config, schema=ctx.schema)
    logs.configure(config.log_level, reconfigurable=True, process="supervisor")
    with ctx.connect() as conn:
        problem = schema_problem(conn, ctx.schema)
    if problem:
        # A runtime failure, as for every other command: the same `jobd run` starts once
        # `jobd migrate` has run.
        raise JobdError(problem)
    return Supervisor(config, ctx.url, file_config=ctx.config).run()


def cmd_migrate(ctx: Context, args: argparse.Namespace) -> int:
    runtime, producer = args.grant_runtime or [], args.grant_producer or []
    with ctx.connect() as conn:
        try:
            done = upgrade(conn, ctx.schema, max_payload_bytes=ctx.config.max_payload_bytes,
                           grant_runtime=runtime, grant_producer=producer)
        except (RefusedGrant, NotOwner, ForeignSchema) as exc:
            raise UsageError(str(exc)) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise UsageError(
                f"{_server_message(exc)}: run jobd migrate as the role that owns schema "
                f"{ctx.schema} (the runtime and producer roles cannot change it)") from None
    names = [f"{m.version:04d}_{m.name}" for m in done.applied]
    if ctx.as_json:
        print_json({"schema": ctx.schema, "applied": names,
                    "max_payload_bytes_set": done.payload_limit,
                    "max_payload_bytes_was": done.payload_limit_was,
                    "granted": [{"role": r, "kind": k} for r, k in done.roles.granted],
                    "forgotten": [{"role": r, "kind": k} for r, k in done.roles.forgotten],
                    "repinned": [{"function": f, "search_path": p} for f, p in done.repinned]})
        return 0
    if names:
        print(f"applied to schema {ctx.schema}: {', '.join(names)}")
    else:
        print(f"schema {ctx.schema} is up to date")
    if done.repinned:
        old = sorted({path for _function, path in done.repinned})
        print(f"pinned the search_path of {len(done.repinned)} functions to schema "
              f"{ctx.schema} (they named {', '.join(old)})")
    if done.payload_limit is not None:
        print(_limit_line(done, ctx.config.path))
    for role, kind in done.roles.granted:
        print(f"granted {kind} privileges to {role}")
    for role, kind in done.roles.forgotten:
        print(f"forgot the {kind} grant of {role}: the role no longer exists")
    return 0


def _limit_line(done: Upgrade, path: str | None) -> str:
    """The one line a changed payload limit gets: the limit is the fleet's, and nodes whose
    files differ set it back and forth at each start (the systemd unit migrates before it),
    so the journal shows the old value beside the new."""
    new = f"{done.payload_limit:,}"
    change = (f"set to {new}" if done.payload_limit_was is None
              else f"changed from {done.payload_limit_was:,} to {new}")
    return (f"max_payload_bytes {change} (limits.max_payload_bytes in {path or 'the config'}; "
            "one limit for every node)")


def _server_message(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or str(exc).strip().splitlines()[0]


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
        spec = jobs.JobSpec(args.handler, args.payload, args.lane, args.run_at, args.priority,
                             args.idempotency_key, args.max_attempts,
                             args.fairness_key).validated()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with ctx.connect() as conn:
        job_id = producer.enqueue(
            conn, spec.handler, spec.payload, lane=spec.lane, run_at=spec.run_at,
            delay=args.delay, priority=spec.priority, idempotency_key=spec.idempotency_key,
            max_attempts=spec.max_attempts, fairness_key=spec.fairness_key, schema=ctx.schema)
    if ctx.as_json:
        print_json({"id": job_id})
    else:
        print(job_id)
    return 0


def cmd_top(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        # The first read happens before the screen opens, so a database that cannot answer
        # (no schema, refused) ends the command with its usual message and exit code.
        first = top.collect(conn, ctx.config)
        if ctx.as_json:
            print_json(first.as_dict())
            return 0
        live = (not args.once and sys.stdin.isatty() and sys.stdout.isatty()
                and top_screen.usable_terminal())
        if not live:
            print(top.plain(first))
            return 0
        # The feed takes the connection over (and may replace it after a loss).
        feed = top_screen.Feed(ctx.connect, ctx.config, conn, first)
        try:
            return top_screen.run(feed, args.interval)
        finally:
            feed.close()
