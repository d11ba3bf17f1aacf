"""The ``jobd`` subcommands an operator reaches for during an incident: ``lanes pause`` and
``lanes resume``, ``jobs cancel`` and ``dlq quarantine``. With a config (``-c``), lanes and
handlers it does not name are refused (exit code 2), as ``enqueue`` refuses them; by resume,
quarantine and ``dlq replay --handler`` only when there was nothing to act on."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jobd import cancelling, dlq, pauses, validation
from jobd.cli_context import Context
from jobd.cli_output import field, print_json
from jobd.config import Config
from jobd.errors import UsageError


def checked_names(config: Config, lane: str | None, handler: str | None) -> None:
    """UsageError for a name that breaks the name rule, or that the config does not know."""
    name_rule(lane, handler)
    # The config is the check against typos; a lane or handler only other nodes have is
    # reached with their config, or with none.
    other_node = (" (another node's? give its config, or none: leave out -c and unset "
                  "$JOBD_CONFIG)")
    if lane is not None and config.lanes and lane not in config.lanes:
        raise UsageError(f"unknown lane {lane!r}; the config has: "
                         + ", ".join(sorted(config.lanes)) + other_node)
    known = config.worker_handlers()
    if handler is not None and config.handlers and handler not in known:
        raise UsageError(f"unknown handler {handler!r}; the config allows: "
                         + ", ".join(sorted(known)) + other_node)


def name_rule(lane: str | None, handler: str | None) -> None:
    """UsageError for a name no lane or handler can have, whatever the config says."""
    try:
        if lane is not None:
            validation.name("lane", lane)
        if handler is not None:
            validation.name("handler", handler)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _target(lane: str, handler: str | None) -> str:
    return f"lane {lane}" if handler is None else f"handler {handler} in lane {lane}"


def _resume_command(lane: str, handler: str | None) -> str:
    return f"jobd lanes resume {lane}" + ("" if handler is None else f" --handler {handler}")


def cmd_lanes_pause(ctx: Context, args: argparse.Namespace) -> int:
    checked_names(ctx.config, args.lane, args.handler)
    with ctx.connect() as conn:
        changed = pauses.pause(conn, args.lane, args.handler, schema=ctx.schema)
        now_paused = pauses.pauses(conn, args.lane)
        known = bool(ctx.config.lanes) or pauses.lane_known(conn, args.lane)
    if not known:
        # Without a config nothing checked the name: a typo during an incident would leave
        # the lane meant running while the operator believes it paused.
        print(f"note: no node runs lane {args.lane!r} and it has no jobs or schedules: is the"
              " name right? (`jobd lanes pause` checks names against a config given with -c)",
              file=sys.stderr)
    if ctx.as_json:
        print_json({"lane": args.lane, "handler": args.handler, "paused": True,
                    "changed": changed, "lane_known": known,
                    "pauses": [p.as_dict() for p in now_paused]})
        return 0
    target = _target(args.lane, args.handler)
    if changed:
        print(f"paused {target}: no node starts its jobs until "
              f"`{_resume_command(args.lane, args.handler)}`; running jobs finish")
    else:
        since = next((p for p in now_paused if p.handler == args.handler), None)
        print(f"{target} was paused already" + (
            "" if since is None else f" (since {field(since.paused_at)} by {since.paused_by})"))
    return 0


def cmd_lanes_resume(ctx: Context, args: argparse.Namespace) -> int:
    # A pause is lifted whatever the config says: the lane may have left it since (or been
    # paused without one). The config's names only tell a typo from a lane not paused.
    name_rule(args.lane, args.handler)
    with ctx.connect() as conn:
        changed = pauses.resume(conn, args.lane, args.handler, schema=ctx.schema)
        if not changed:
            checked_names(ctx.config, args.lane, args.handler)
        left = pauses.pauses(conn, args.lane)
    if ctx.as_json:
        print_json({"lane": args.lane, "handler": args.handler, "paused": False,
                    "changed": changed, "pauses": [p.as_dict() for p in left]})
        return 0
    target = _target(args.lane, args.handler)
    print(f"resumed {target}" if changed else f"{target} was not paused")
    if left:
        print(f"still paused in lane {args.lane}: "
              + ", ".join("the whole lane" if p.handler is None else f"handler {p.handler}"
                          for p in left))
    return 0


def cmd_jobs_cancel(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.connect(autocommit=False) as conn:
        result = cancelling.cancel(conn, args.ids, schema=ctx.schema)
        if result.unknown:
            conn.rollback()
            raise UsageError("no job " + ", ".join(map(str, result.unknown))
                             + " (live, finished or dead); nothing cancelled")
        conn.commit()
    if ctx.as_json:
        print_json({"cancelled": result.cancelled, "requested": result.requested,
                    "finished": [{"id": job_id, "state": state}
                                 for job_id, state in sorted(result.finished.items())]})
        return 0
    if result.cancelled:
        print(f"cancelled {len(result.cancelled)} job(s): "
              + ", ".join(map(str, result.cancelled)))
    if result.requested:
        print(f"asked {len(result.requested)} running job(s) to stop: "
              + ", ".join(map(str, result.requested))
              + " (recorded cancelled when their run ends)")
    if result.finished:
        print("finished already, left as they are: "
              + ", ".join(f"{job_id} ({state})"
                          for job_id, state in sorted(result.finished.items())))
    return 0


def _payload_match(pairs: list[tuple[str, Any]]) -> dict[str, Any] | None:
    match: dict[str, Any] = {}
    for key, value in pairs:
        if key in match:
            raise UsageError(f"--where {key}: given twice")
        match[key] = value
    return match or None


def cmd_dlq_quarantine(ctx: Context, args: argparse.Namespace) -> int:
    # Jobs of a handler no config has (a typo in a producer, a removed handler) are what an
    # operator quarantines too (docs/operations.md): as resume, the config's names only tell
    # a typo from a handler with no jobs to move.
    name_rule(args.lane, args.handler)
    match = _payload_match(args.where)
    with ctx.connect() as conn:
        moved = dlq.quarantine(conn, args.handler, args.lane, match)
    total = sum(moved.values())
    if not total:
        checked_names(ctx.config, args.lane, args.handler)
    if ctx.as_json:
        print_json({"handler": args.handler, "lane": args.lane, "where": match,
                    "quarantined": total, "by_lane": moved})
        return 0
    scope = f"handler {args.handler}" + (f" in lane {args.lane}" if args.lane else "")
    if match:
        scope += " with payload " + ", ".join(f"{k}={v!r}" for k, v in match.items())
    if not total:
        print(f"no pending or failed job of {scope}; nothing quarantined")
        return 0
    print(f"quarantined {total} job(s) of {scope} into the dead-letter queue: "
          + ", ".join(f"{lane} {count}" for lane, count in sorted(moved.items())))
    print(f"running jobs of it finish (cancel them with `jobd jobs cancel ID`); bring "
          f"them back after the fix with `jobd dlq replay --handler {args.handler}`")
    return 0
