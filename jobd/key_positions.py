"""A fair lane's positions per share key: where a worker's scan of each key starts. Pure
logic; ``claim_order`` takes them as four arrays, which it turns into one lookup per claim
(``key_positions`` in migrations/0028). And the key cursor: where the next fair claim
starts its walk from key to key.

A fair claim shares a priority's jobs across share keys and takes each key's oldest jobs,
not a prefix of the priority, so a position per priority (:mod:`jobd.claim_floors`) says
nothing of where each key's due jobs begin. The worker keeps one per (priority, share key)
instead: the last job of the key a full claim took. Without them a herd's scans walked the
dead index entries of every herd job claimed since the last vacuum, and a fair drain of
50,000 jobs slowed as it went. A short claim (every key dry) drops them, as it drops the
priorities' positions: the claims then start at the dry instant less its margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobd import jobs

# The share keys a fair lane's worker keeps a position for (the most recently taken).
MAX_KEY_FLOORS = 256


@dataclass(slots=True)
class KeyPositions:
    # (priority, share key) -> the last (run_at, id) taken of the key by a full claim, the
    # most recently recorded last.
    by_key: dict[tuple[int, str], tuple[datetime, int]] = field(default_factory=dict)

    def claimed(self, taken: list[tuple[int, str, datetime, int]], limit: int) -> None:
        """Record the positions a fair claim of ``limit`` reached: (priority, share key,
        run_at, id) per job. The oldest positions go first when there are more than
        MAX_KEY_FLOORS. A short claim records none (the floors drop them all)."""
        if len(taken) < limit:
            return
        for priority, key, run_at, job_id in sorted(taken, key=lambda t: (t[2], t[3])):
            position = (run_at, job_id)
            known = self.by_key.pop((priority, key), None)
            self.by_key[(priority, key)] = max(known, position) if known else position
        while len(self.by_key) > MAX_KEY_FLOORS:
            del self.by_key[next(iter(self.by_key))]

    def clear(self) -> None:
        self.by_key.clear()

    def params(self) -> dict[str, list[Any]]:
        """The positions as the claim's four parallel arrays."""
        keys = list(self.by_key.items())
        return {"key_floor_priorities": [priority for (priority, _key), _at in keys],
                "key_floor_keys": [key for (_priority, key), _at in keys],
                "key_floor_run_ats": [at[0] for _key, at in keys],
                "key_floor_ids": [at[1] for _key, at in keys]}


def next_key_cursor(cursor: str | None, taken: list[jobs.Job],
                    overdue_before: datetime | None = None) -> str:
    """Where the next fair claim starts: the last share key this one reached in the last
    level it visited (last_level). claim_order visits keys in order after ``cursor`` and
    then wraps to the start, so the last key reached is the greatest at or below the cursor
    when the claim wrapped, else the greatest. Keys compare as the claim compares them
    (COLLATE "C": code point order)."""
    keys = {job.fairness_key or job.handler for job in last_level(taken, overdue_before)}
    wrapped = [key for key in keys if cursor is not None and key <= cursor]
    return max(wrapped or keys)


def last_level(taken: list[jobs.Job], overdue_before: datetime | None) -> list[jobs.Job]:
    """The jobs a fair claim took in the last level it visited. claim_order visits, with
    max_wait, each priority's jobs due before ``overdue_before`` (the highest priority's
    due jobs all at once, migration 0048) in the order of their oldest, then each priority's
    other due jobs, highest first; every level before the last one came back short,
    drained, so only the last one's keys have more to rotate through. A cursor taken over
    all the levels stuck at a key of another level (a high priority's key sorting after the
    tenants', an overdue job's), and the last level started at its first keys again at
    every claim: the keys after them starved."""
    if overdue_before is None:
        lowest = min(job.priority for job in taken)
        return [job for job in taken if job.priority == lowest]
    top = max(job.priority for job in taken)
    later = [job for job in taken if job.run_at > overdue_before]
    if any(job.priority < top for job in later):
        # The second pass reached a lower priority: its lowest is the last level.
        lowest = min(job.priority for job in later)
        return [job for job in later if job.priority == lowest]
    # Every level the claim visited was an overdue one, or the top priority's: the top's
    # holds its younger jobs too, and comes last if none of them is overdue.
    heads: dict[int, datetime] = {}
    for job in taken:
        if job.run_at <= overdue_before:
            heads[job.priority] = min(heads.get(job.priority, job.run_at), job.run_at)
    if top not in heads:
        return [job for job in taken if job.priority == top]
    last = max(heads, key=heads.__getitem__)
    return [job for job in taken if job.priority == last]
