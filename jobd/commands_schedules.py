"""The ``jobd schedules`` subcommands: ``list``, ``disable``, ``enable`` and ``next`` (a cron
expression's occurrences, DST included)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from jobd import schedules
from jobd.cli_context import Context
from jobd.cli_output import local_time, print_json, print_table
from jobd.cron import CronError, CronSchedule
from jobd.errors import UsageError


def cmd_schedules_list(ctx: Context, _args: argparse.Namespace) -> int:
    with ctx.connect() as conn:
        listing = schedules.listing(conn)
    if ctx.as_json:
        print_json(listing)
        return 0
    print_table(["id", "cron", "zone", "next fire (local)", "next fire (UTC)", "last fire",
                  "nodes", "state"],
                 [[item["id"], item["cron"], item["timezone"], local_time(item["next_fire_local"]),
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
        print_json({"id": args.id, "enabled": args.enabled, "changed": changed,
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
    try:
        occurrences = cron.next_after(start, args.count)
    except OverflowError:  # the search runs past year 9999 (or before year 1)
        raise UsageError(f"--from {start.isoformat()} is too close to the calendar's end for "
                         "a search of the next 30 years") from None
    if ctx.as_json:
        print_json([o.local(cron.zone).isoformat() for o in occurrences])
        return 0
    kind = "wildcard: fires by real time" if cron.wildcard else "fixed time: once per local time"
    print(f"{cron.expression} in {cron.zone.key} ({kind})")
    if len(occurrences) < args.count:
        print(f"(only {len(occurrences)} occurrence(s) within 30 years of the start)")
    print_table(["local", "UTC", "occurrence key"],
                 [[local_time(o.local(cron.zone)), o.fire_at, o.key] for o in occurrences],
                 empty="no occurrence in the next 30 years")
    return 0
