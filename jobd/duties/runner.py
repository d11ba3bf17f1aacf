"""Runs the due duties on the supervisor's loop (see :mod:`jobd.duties`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import psycopg

from jobd.db import ManagedConnection
from jobd.duties import Duty


class DutyRunner:
    def __init__(self, duties: Sequence[Duty]) -> None:
        self.duties = list(duties)

    def next_at(self) -> float:
        return min((duty.next_at for duty in self.duties), default=math.inf)

    def run_due(self, link: ManagedConnection, now: float | None = None) -> None:
        """Run what is due: the shared ones in one transaction, each ``alone`` one apart.
        A failure is logged by ``link`` and the duty tries again on its next turn."""
        now = time.monotonic() if now is None else now
        due = [duty for duty in self.duties if duty.due(now)]
        if not due or link.conn is None:
            return
        shared = [duty for duty in due if not duty.alone]
        if shared:
            link.run(", ".join(duty.name for duty in shared),
                     lambda conn: self._together(conn, shared, now))
        for duty in due:
            if duty.alone:
                link.run(duty.name, lambda conn, duty=duty: duty.run(conn, now))

    @staticmethod
    def _together(conn: psycopg.Connection, duties: Sequence[Duty], now: float) -> None:
        try:
            with conn.transaction():
                for duty in duties:
                    duty.run(conn, now)
        except BaseException:
            for duty in duties:
                duty.rolled_back()
            raise

    def stop(self, link: ManagedConnection) -> None:
        for duty in self.duties:
            link.run(f"{duty.name} (stop)", duty.stop)
