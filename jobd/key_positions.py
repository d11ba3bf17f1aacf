"""A fair lane's positions per share key: where a worker's scan of each key starts. Pure
logic; ``claim_order`` takes them as four arrays, which it turns into one lookup per claim
(``key_positions`` in migrations/0028).

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
from typing import Any

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
