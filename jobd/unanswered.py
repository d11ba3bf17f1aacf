"""Outcomes sent again after a write whose answer never came.

A batch of outcomes whose connection is lost between the server's COMMIT and its answer may
have committed or not; the worker cannot tell, so it keeps the outcomes and sends them
again. The leases decide what applies: a second write of what committed the first time is
refused by the fence, as a write after a real loss of the lease is. Counted as lost, a job
done once would be logged as "result discarded" and counted in ``lease_lost`` (and in
``jobd_stale_completions_total``), a false alarm after any network blip.

So the attempts of such a batch are looked up when the fence refuses them: an attempt is on
record if the database holds what its outcome wrote, written by this worker at that attempt
(queries.sql, ``outcomes_on_record``). Those count as written, in the state the record
shows; the rest stay lost. The look-up runs only then, never on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
import structlog

from jobd import queue
from jobd.queries import query

log = structlog.get_logger("jobd.worker")

# job id -> (the attempt whose outcome was sent, its error; None: a success)
Attempts = Mapping[int, tuple[int, str | None]]
Written = tuple[queue.WriteOutcome, queue.FailOutcome, queue.Claimed]


def recheck(conn: psycopg.Connection, worker: str, attempts: Attempts, written: Written
            ) -> Written:
    """``written`` (settle_and_claim's answer) with the refused outcomes of ``attempts``
    that are on record as ``worker``'s moved from ``lease_lost`` to what they were written
    as. A look-up that fails leaves them lost (the conservative report: the database is
    right either way) and is logged."""
    if not attempts:
        return written  # every exchange but the one after a lost answer: nothing to do
    completed, failed, _claimed = written
    refused = [job_id for job_id in (*completed.lease_lost, *failed.lease_lost)
               if job_id in attempts]
    if not refused:
        return written
    try:
        on_record = _on_record(conn, worker, {job_id: attempts[job_id] for job_id in refused})
    except psycopg.Error as exc:
        log.warning("could not look up outcomes sent before a lost connection; counted as "
                    "leases lost", job_ids=refused, error=str(exc).strip())
        return written
    for job_id, state in on_record.items():
        if job_id in completed.lease_lost:
            completed.lease_lost.remove(job_id)
            completed.applied.append(job_id)
            if state == "cancelled":
                completed.cancelled.append(job_id)
        else:
            failed.lease_lost.remove(job_id)
            {"dead": failed.dead, "cancelled": failed.cancelled}.get(
                state, failed.retried).append(job_id)
    if on_record:
        log.info("outcomes sent before a lost connection had been written",
                 job_ids=sorted(on_record))
    return written


def _on_record(conn: psycopg.Connection, worker: str, attempts: Attempts) -> dict[int, str]:
    """job id -> 'done', 'cancelled', 'failed' (retried) or 'dead', for the attempts whose
    outcome the database holds as ``worker``'s."""
    ids = list(attempts)
    rows = conn.execute(query("outcomes_on_record"), {
        "worker": worker, "ids": ids,
        "attempts": [attempts[job_id][0] for job_id in ids],
        "errors": [attempts[job_id][1] for job_id in ids]}).fetchall()
    return {job_id: state for job_id, state in rows}
