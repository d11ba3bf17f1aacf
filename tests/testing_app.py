"""A small application that uses jobd, for tests/test_testing_helpers.py: its own tables in
the public schema, code that enqueues in the caller's transaction, and its handlers."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

import jobd
from jobd import outbox

SCHEMA = """
CREATE TABLE orders (id bigserial PRIMARY KEY, email text NOT NULL, total int NOT NULL,
                     receipt_sent boolean NOT NULL DEFAULT false);
CREATE TABLE reports (id bigserial PRIMARY KEY, day text NOT NULL);
CREATE TABLE calls (id bigserial PRIMARY KEY, handler text NOT NULL, job_id bigint NOT NULL);
"""


def create_tables(conn: psycopg.Connection) -> None:
    conn.execute(SCHEMA)


def place_order(conn: psycopg.Connection, email: str, total: int) -> int:
    """The code under test: the order and its receipt job commit together."""
    row = conn.execute("INSERT INTO orders (email, total) VALUES (%s, %s) RETURNING id",
                       (email, total)).fetchone()
    assert row is not None
    order_id = int(row[0])
    jobd.enqueue(conn, "send_receipt", {"order": order_id, "email": email},
                 idempotency_key=f"receipt-{order_id}")
    if total >= 1000:
        jobd.enqueue(conn, "review_order", {"order": order_id}, lane="fraud", delay=3600)
    return order_id


@jobd.transactional
def send_receipt(job: jobd.Job, conn: psycopg.Connection) -> None:
    # Unqualified: the handler's connection resolves names as the application's does.
    conn.execute("UPDATE orders SET receipt_sent = true WHERE id = %s",
                 (job.payload["order"],))


class PaymentDeclined(Exception):
    pass


@jobd.transactional
def charge(job: jobd.Job, conn: psycopg.Connection) -> None:
    conn.execute("INSERT INTO calls (handler, job_id) VALUES ('charge', %s)", (job.id,))
    if job.payload.get("declined"):
        raise PaymentDeclined(f"card of order {job.payload['order']} declined")


@jobd.transactional
def nightly_report(job: jobd.Job, conn: psycopg.Connection) -> None:
    conn.execute("INSERT INTO reports (day) VALUES (%s)", (job.run_at.date().isoformat(),))


def review_order(job: jobd.Job) -> None:
    """A plain (non-transactional) handler: nothing to write, it only has to succeed."""


async def notify_async(job: jobd.Job) -> Any:
    await asyncio.sleep(0)
    if job.payload.get("fail"):
        raise RuntimeError("async handler failed")


async def sleep_async(job: jobd.Job) -> None:
    await asyncio.sleep(job.payload["seconds"])


@jobd.transactional
def confirm_order(job: jobd.Job, conn: psycopg.Connection) -> None:
    """Writes the order's state and records the mail to send about it (jobd.outbox)."""
    conn.execute("UPDATE orders SET receipt_sent = true WHERE id = %s", (job.payload["order"],))
    outbox.add(conn, job, "mail", {"order": job.payload["order"]})


SENT: list[tuple[str, Any]] = []  # what send_mail was given: (key, payload)


def send_mail(entry: outbox.OutboxEntry) -> None:
    SENT.append((entry.key, entry.payload))
