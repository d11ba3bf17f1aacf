"""The outbox: effects outside PostgreSQL, recorded in the handler's transaction, delivered
afterwards with a stable key.

A transactional handler calls :func:`add`; the entry and a delivery job (handler
``jobd.outbox:<sender>``, :func:`jobd.validation.outbox_handler`, on the configured outbox
lane) commit with the handler's own writes. The config maps that handler to :func:`deliver`
on the nodes that have the sender (others leave the job to them), which calls the registered
sender (config ``outbox.senders``) with the entry, whose ``key`` the sender
passes to the receiving API. Delivery is at-least-once with the lane's retries and backoff; a
receiver that deduplicates by key sees each entry exactly once. An entry whose delivery job
runs out of attempts is marked ``dead`` (the job is in the dead-letter queue, and replaying
it retries the delivery).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from jobd import validation
from jobd.db import DEFAULT_SCHEMA
from jobd.handlers import transactional
from jobd.jobs import Job
from jobd.queries import qualified


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    id: int
    key: str  # pass this to the receiving API as its idempotency key
    sender: str
    payload: Any
    attempt: int


Sender = Callable[[OutboxEntry], Any]

@dataclass(slots=True)
class _Settings:
    """Set by the worker process at start from the config's outbox section."""

    senders: dict[str, Sender]
    lane: str
    schema: str  # handlers' connections keep the user's search_path: statements name it


_settings = _Settings({}, "outbox", DEFAULT_SCHEMA)


def install(senders: Mapping[str, Sender], lane: str, schema: str = DEFAULT_SCHEMA) -> None:
    _settings.senders = dict(senders)
    _settings.lane = lane
    _settings.schema = schema


@contextlib.contextmanager
def installed(senders: Mapping[str, Sender], lane: str,
              schema: str = DEFAULT_SCHEMA) -> Iterator[None]:
    """:func:`install` for the length of a block, then the settings from before it (for
    in-process runs, jobd.testing, which must not leave a test's config behind)."""
    before = _Settings(dict(_settings.senders), _settings.lane, _settings.schema)
    install(senders, lane, schema)
    try:
        yield
    finally:
        install(before.senders, before.lane, before.schema)


def add(conn: psycopg.Connection, job: Job, sender: str, payload: Any, *,
        key: str | None = None) -> int:
    """Record an outbox entry in the handler's transaction; returns its id.

    ``payload`` meets the rules of a job's payload (:func:`jobd.validation.encode_payload`;
    ValueError), the size limit aside; a :class:`jobd.JsonText` keeps its numbers as written.
    ``key`` defaults to ``<job's effect key>:<sender>``; a handler that sends several
    messages through one sender gives each its own key. Adding a key twice keeps the first.
    The delivery job goes to the configured ``outbox.lane``.
    """
    # Checked here, where the handler can be told: its deliveries' handler names it.
    validation.sender(sender)
    # A job's payload rules, so the sender gets the value the handler gave ({1: "a"} would
    # arrive as {"1": "a"}), a JsonText keeps its digits, and a refusal is a ValueError here
    # rather than a server error that aborts the handler's transaction.
    encoded = validation.encode_payload(payload)
    entry_key = key if key is not None else f"{job.effect_key}:{sender}"
    # A tuple whatever row factory the handler gave its connection (or a test's, under
    # jobd.testing).
    row = conn.cursor(row_factory=tuple_row).execute(qualified("outbox_add", _settings.schema), {
        "key": entry_key, "sender": sender, "payload": Jsonb(encoded, dumps=str),
        "lane": _settings.lane, "source_job_id": job.id,
    }).fetchone()
    assert row is not None
    return int(row[0])


@transactional
def deliver(job: Job, conn: psycopg.Connection) -> None:
    """The delivery job: hand the entry to its sender, then mark it delivered."""
    row = conn.cursor(row_factory=tuple_row).execute(  # tuples, as in add
        qualified("outbox_entry_for_delivery", _settings.schema),
        {"id": job.payload["outbox_id"]}).fetchone()
    if row is None:
        raise LookupError(f"outbox entry {job.payload['outbox_id']} does not exist")
    entry_id, key, sender_name, payload, state = row
    if state == "delivered":
        return
    sender = _settings.senders.get(sender_name)
    if sender is None:
        raise LookupError(f"no outbox sender named {sender_name!r} on this worker "
                          "(config outbox.senders)")
    sender(OutboxEntry(entry_id, key, sender_name, payload, job.attempt))
    conn.execute(qualified("outbox_delivered", _settings.schema), {"id": entry_id})
