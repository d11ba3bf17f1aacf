"""Example handlers used by config/jobd.example.yaml (and handy for trying jobd out)."""

from __future__ import annotations

import time

import psycopg
import structlog

from jobd import outbox
from jobd.handlers import transactional
from jobd.jobs import Job

log = structlog.get_logger("jobd.examples")


def echo(job: Job) -> None:
    """Logs the job's id and its payload's keys (or, for a payload that is not an object,
    its JSON type: a payload is any JSON value), and succeeds."""
    if isinstance(job.payload, dict):
        log.info("echo", job_id=job.id, attempt=job.attempt, keys=sorted(job.payload))
    else:
        log.info("echo", job_id=job.id, attempt=job.attempt,
                 payload_type=_JSON_TYPES[type(job.payload)])


# A decoded payload's Python type -> its JSON type.
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def sleep(job: Job) -> None:
    """Sleeps ``payload["seconds"]`` (default 1) seconds, then succeeds; returns early once
    the job is asked to stop (``jobd jobs cancel``), as a long handler should."""
    deadline = time.monotonic() + float((job.payload or {}).get("seconds", 1))
    while not job.cancelled and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def fail(job: Job) -> None:
    """Fails every attempt: watch it back off and land in the dead-letter queue."""
    raise RuntimeError(f"example failure on attempt {job.attempt}")


@transactional
def record_order(job: Job, conn: psycopg.Connection) -> None:
    """A transactional handler: its write, its effect key and the job's completion commit
    together, and it asks for a receipt mail through the outbox in the same transaction.

    Payload: {"order": 123, "email": "a@example.com"}.
    """
    conn.execute(
        "CREATE TABLE IF NOT EXISTS jobd_example_orders "
        "(effect_key text, order_id bigint, recorded_at timestamptz DEFAULT now())")
    payload = job.payload or {}
    conn.execute("INSERT INTO jobd_example_orders (effect_key, order_id) VALUES (%s, %s)",
                 (job.effect_key, payload.get("order")))
    outbox.add(conn, job, "mail", {"to": payload.get("email"), "order": payload.get("order")})


def log_mail(entry: outbox.OutboxEntry) -> None:
    """An outbox sender: a real one passes entry.key to its API as the idempotency key."""
    log.info("mail sent", key=entry.key, to=(entry.payload or {}).get("to"),
             attempt=entry.attempt)
