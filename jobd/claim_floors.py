"""Where a worker's claims start scanning: per priority, a floor below which it knows no job
is due. Pure logic; ``claim_jobs`` and ``arm_waiter`` take the floors as arrays.

Every claimed or finished job leaves a dead entry in the claim index. Vacuum removes them
within seconds, unless a transaction holds the xmin horizon back (an idle-in-transaction
session, a long report, a replication slot): then a scan from the head of a lane walks every
job claimed since, and claims slow down as the horizon ages (docs/design/queue.md, "Claim
floors"). A floor keeps the scan above them:

- a claim stopped, in each priority it took from, at the last job it took: the scan of that
  priority starts there next time, and no earlier dry instant counts for it (the jobs it
  took may lie below one: a herd due in the past, found by a scan from the head, is then
  followed claim after claim rather than one full scan a second);
- a claim that came back full left nothing due unclaimed in each priority above the lowest
  it took from: those are dry as of "now, less :data:`CAUGHT_UP_MARGIN`", and the scan
  starts at the later of the two;
- a claim that came back short left nothing due unclaimed in any priority: every scan then
  starts at that dry instant, positions dropped, since the margin is what finds a job whose
  transaction began before the last one taken and committed after the claim;
- a job can still become due below a floor: an enqueue whose transaction began more than
  the margin before it committed, or in a backlog before the position's job (``run_at``
  defaults to the transaction's start), a job released or whose lease expired (it keeps its
  ``run_at``), a claim that skipped a locked row that another claimer then gave up. So at
  least every :data:`FULL_SCAN_INTERVAL` a claim scans from the head, and such a job waits
  at most that long;
- unless those scans grow costly: a scan from the head walks every dead entry the held
  horizon keeps, so its cost grows with the horizon's age. The worker times each round trip
  that carried one (:meth:`ClaimFloors.head_scan_took`) and spaces the next so that such
  scans take at most :data:`HEAD_SCAN_SHARE` of its time, up to
  :data:`MAX_FULL_SCAN_INTERVAL` apart. While they are spaced out, a worker that is caught
  up (its floors are dry instants of the last seconds) once a second looks back
  :data:`LOOK_BACK` seconds instead (the floors at the database's clock less that): it walks
  the dead entries of those seconds only, whatever the horizon's age, and finds what usually
  lands below the floors (an enqueue whose transaction took seconds). A job below that, due
  for longer, waits up to the spacing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from jobd.key_positions import KeyPositions

# How far below the database's clock at a short claim a floor is set: an enqueue whose
# transaction is younger than this when it commits is never below a caught-up worker's floor.
CAUGHT_UP_MARGIN = 0.5
# The longest a job below a floor waits for a claim that scans from the head, while such
# scans are cheap (vacuum keeps up).
FULL_SCAN_INTERVAL = 1.0
# The share of a worker's time that scans from the head may take: one that took longer than
# this share of FULL_SCAN_INTERVAL (2 ms beyond the usual round trip; from the head of a
# lane that vacuum keeps clean, a scan costs about what one from the floors does) spaces the
# next one out, to seconds / share. A held horizon's dead entries cost some 0.35 us each to
# step over (bench/pressure.py), so this bounds what they add to about 80 entries per claim
# at 75 claims/s, until the spacing reaches its cap (a scan of some 120 ms) ...
HEAD_SCAN_SHARE = 0.002
# ... but never further apart than this: the longest a job far below the floors then waits.
MAX_FULL_SCAN_INTERVAL = 60.0
# Meanwhile, once every FULL_SCAN_INTERVAL, a claim looks this far back (seconds before the
# database's now()) from every priority, past the floors: its cost is the entries of those
# seconds, not of the horizon's whole age.
LOOK_BACK = 10.0
# A priority's dry instant when a claim took jobs from it: not dry at all below its position
# (the age sent makes the dry floor decades old, so the position alone counts).
NOT_DRY = -math.inf
NOT_DRY_AGE = 1e9


@dataclass(slots=True)
class Floor:
    """A priority's floor: the position of the last job taken from it, and the instant it was
    last seen dry (monotonic; sent as an age, since the database's clock sets ``now``). The
    claim starts at the later of the two."""

    run_at: datetime | None = None
    job_id: int = 0
    dry_at: float | None = None


@dataclass(slots=True)
class ClaimFloors:
    by_priority: dict[int, Floor] = field(default_factory=dict)
    # When every priority was last seen dry (a short claim): the dry instant of priorities
    # without a later one of their own.
    dry_at: float | None = None
    last_full_scan: float = -math.inf
    # How far apart scans from the head are now: FULL_SCAN_INTERVAL, or longer while the
    # last one took long (head_scan_took); the claims look back LOOK_BACK meanwhile.
    full_scan_spacing: float = FULL_SCAN_INTERVAL
    last_look_back: float = -math.inf
    # A fair lane's positions per (priority, share key).
    keys: KeyPositions = field(default_factory=KeyPositions)

    def head_scan_took(self, seconds: float) -> float:
        """A round trip that scanned from the head took ``seconds``: space the next such scan
        so that they take at most HEAD_SCAN_SHARE of the time. Returns the new spacing."""
        self.full_scan_spacing = min(MAX_FULL_SCAN_INTERVAL,
                                     max(FULL_SCAN_INTERVAL, seconds / HEAD_SCAN_SHARE))
        return self.full_scan_spacing

    @property
    def spaced_out(self) -> bool:
        """Scans from the head are spaced out: the claims look back once a second instead."""
        return self.full_scan_spacing > FULL_SCAN_INTERVAL

    def caught_up(self, now: float) -> bool:
        """Every priority's floor is its dry instant (the last claim came back short) and
        later than LOOK_BACK ago: a look back then starts below every floor, so it only adds
        to what the claim sees. A worker working through a backlog does not look back, which
        would take jobs of the last seconds before the older ones its floors lead to (and
        within those seconds its floors find a straggler anyway)."""
        return (self.dry_at is not None
                and now - self.dry_at <= LOOK_BACK - CAUGHT_UP_MARGIN
                and all(floor.dry_at is None for floor in self.by_priority.values()))

    def next_full_scan_at(self) -> float:
        """When the next claim scans from the head (monotonic)."""
        return self.last_full_scan + self.full_scan_spacing

    def recheck_at(self, probe: str, now: float) -> float | None:
        """When a worker that armed itself after a probe of this kind (:func:`kind`) at
        ``now`` looks once more, past its floors: never after one from the head; after a
        look back, when the next scan from the head is due; after one from the floors, at
        the next look past them of either kind. A worker that is not caught up makes no
        look back (params), so its next look past the floors is the scan from the head;
        the time of the last look back, long past, would have it arm again at once, over and
        over until then."""
        if probe == HEAD:
            return None
        if probe == BACK or not self.spaced_out or not self.caught_up(now):
            return self.next_full_scan_at()
        return min(self.next_full_scan_at(), self.last_look_back + FULL_SCAN_INTERVAL)

    def params(self, now: float) -> Mapping[str, Any]:
        """The floor parameters of the next claim; from the head when one is due, looking
        back LOOK_BACK when one of those is due while scans from the head are spaced out."""
        if now >= self.next_full_scan_at():
            return full_scan_params()
        if (self.spaced_out and now >= self.last_look_back + FULL_SCAN_INTERVAL
                and self.caught_up(now)):
            self.last_look_back = now
            return look_back_params()
        priorities, run_ats, ids, ages = [], [], [], []
        for priority, floor in self.by_priority.items():
            priorities.append(priority)
            run_ats.append(floor.run_at)
            ids.append(floor.job_id)
            ages.append(None if floor.dry_at is None else
                        NOT_DRY_AGE if floor.dry_at == NOT_DRY else _age(floor.dry_at, now))
        return {"floor_priorities": priorities, "floor_run_ats": run_ats, "floor_ids": ids,
                "floor_ages": ages,
                "default_floor_age": None if self.dry_at is None else _age(self.dry_at, now),
                **self.keys.params()}

    def claimed(self, params: Mapping[str, Any], taken: list[tuple[int, datetime, int]],
                limit: int, now: float, *, sent_at: float | None = None, fair: bool = False,
                aged: bool = False) -> None:
        """Record what a claim sent with ``params`` at ``sent_at`` (default ``now``) took:
        (priority, run_at, id) per job. What it saw dry was dry as of its send: its snapshot
        is no older, and may be seconds older than its answer on a loaded server, past the
        margin. The next scan from the head is due a spacing after ``now``.

        A fair claim (``fair``: shares across keys, claim_order) takes from each key its
        oldest jobs, not a prefix of the priority's, so its positions prove nothing and only
        a short claim (every priority dry) sets floors. An age-promoting claim (``aged``,
        max_wait) takes a prefix of each priority, but it may have filled up with overdue
        jobs of a low priority before it looked at the higher ones: a full claim says
        nothing of those.
        """
        if kind(params) == HEAD:
            self.last_full_scan = now
        dry = now if sent_at is None else sent_at
        if fair:
            if len(taken) < limit:
                self._all_dry(dry)
            elif taken:
                # Work was found, maybe below the dry floor (a herd due in the past): scan
                # from the head until a claim comes back short.
                self.dry_at = None
            return
        last: dict[int, tuple[datetime, int]] = {}
        for priority, run_at, job_id in taken:
            last[priority] = max(last.get(priority, (run_at, job_id)), (run_at, job_id))
        for priority, (run_at, job_id) in last.items():
            floor = self.by_priority.setdefault(priority, Floor())
            # The priority had due work up to here, maybe below its dry floor (jobs due in
            # the past: a backfill, a herd whose run_at the clock passed, jobs given back):
            # from now on the position alone says where its scan starts.
            floor.run_at, floor.job_id, floor.dry_at = run_at, job_id, NOT_DRY
        if not last and len(taken) >= limit:
            return  # nothing taken, nothing asked for (a claim capped at zero)
        if len(taken) < limit:
            self._all_dry(dry)
            return
        if aged:
            return
        # Full: the scan went through each priority above the lowest it took from.
        lowest = min(last)
        for priority in last:
            if priority > lowest:
                self.by_priority[priority].dry_at = dry

    def _all_dry(self, now: float) -> None:
        """Every priority was scanned to its end: nothing due is left unclaimed as of now, so
        each scan starts at that dry instant, not at the last job taken (of the priority, of
        a fair lane's share key). A position has no
        margin: a transaction that began before the job there and committed after the claim
        would be below it (a bulk enqueue beside a trickle of single ones, a job enqueued in
        a request's transaction), left for the next scan from the head."""
        self.dry_at = now
        self.by_priority.clear()
        self.keys.clear()

    def forget(self) -> None:
        """Scan from the head next time: this worker gave jobs back below its floors, or the
        database's clock stepped (``jobd.clock_watch``)."""
        self.by_priority.clear()
        self.keys.clear()
        self.dry_at = None
        self.last_full_scan = -math.inf


# The floor parameters of a scan from the head and of a look back: built once and read-only,
# since every claim's round trip asks which kind it sent (kind()).
_FULL_SCAN: Mapping[str, Any] = MappingProxyType({
    "floor_priorities": [], "floor_run_ats": [], "floor_ids": [], "floor_ages": [],
    "default_floor_age": None, "key_floor_priorities": [], "key_floor_keys": [],
    "key_floor_run_ats": [], "key_floor_ids": []})
_LOOK_BACK: Mapping[str, Any] = MappingProxyType({**_FULL_SCAN, "default_floor_age": LOOK_BACK})

# What a claim's floor parameters are (kind()).
HEAD, BACK, FLOORS = "head", "look back", "floors"


def kind(params: Mapping[str, Any] | None) -> str:
    """Whether floor parameters scan from the head (so do none: ``queue.ClaimRequest``), look
    back LOOK_BACK, or start at floors."""
    if params is None or params == _FULL_SCAN:
        return HEAD
    if params == _LOOK_BACK:
        return BACK
    return FLOORS


def look_back_params() -> Mapping[str, Any]:
    return _LOOK_BACK


def full_scan_params() -> Mapping[str, Any]:
    return _FULL_SCAN


def _age(dry_at: float, now: float) -> float:
    return max(0.0, now - dry_at) + CAUGHT_UP_MARGIN
