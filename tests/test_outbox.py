"""The outbox: effects outside PostgreSQL, recorded in a transactional handler's transaction
and delivered by the daemon through a registered sender, at least once, with a stable key.

In-process tests check that an entry commits with its handler or not at all. The daemon tests
run `python -m jobd run` with a handler that records one outbox entry per job and senders that
write every call to files in the test's directory: ``calls.log`` (each call, with the entry id
and key it was given) and ``received.log`` (each request that reached the receiver). The
receiver deduplicates by key, as an external API with idempotency keys does.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, make_config, wait_until

import jobd
from jobd import outbox, queue, recovery
from jobd.backoff import RetryPolicy
from jobd.db import connect
from jobd.exactly_once import LeaseLost, run_transactional
from jobd.jobs import Job

daemons = daemon_support.daemons

HANDLERS_MODULE = '''\
"""Handlers and outbox senders for the outbox tests."""

import json
import os
import random

import jobd
from jobd import outbox

DIRECTORY = {directory!r}


def _append(name, line):
    fd = os.open(os.path.join(DIRECTORY, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


@jobd.transactional
def order(job, conn):
    """Writes the order and records the message to send about it, in one transaction."""
    conn.execute("INSERT INTO public.orders (key, job_id) VALUES (%s, %s)",
                 (job.effect_key, job.id))
    payload = job.payload or {{}}
    outbox.add(conn, job, payload.get("sender", "flaky"), {{"order": payload.get("n")}})


def receive(entry):
    """The receiving side: it notes every request; it deduplicates by key when it applies."""
    _append("received.log", json.dumps({{"key": entry.key, "payload": entry.payload}}))


def flaky(entry):
    """Fails half the time: before the request reaches the receiver, or after (the answer
    is lost, so the sender cannot know the receiver has it)."""
    _append("calls.log", json.dumps({{"id": entry.id, "key": entry.key,
                                      "attempt": entry.attempt}}))
    draw = random.random()
    if draw < 0.25:
        raise ConnectionError("connection refused before the request was sent")
    receive(entry)
    if draw < 0.5:
        raise TimeoutError("the receiver took the request, but its answer was lost")


def broken(entry):
    """Fails every call until the file "fixed" exists."""
    _append("calls.log", json.dumps({{"id": entry.id, "key": entry.key,
                                      "attempt": entry.attempt}}))
    if not os.path.exists(os.path.join(DIRECTORY, "fixed")):
        raise ConnectionError("the receiver is down")
    receive(entry)
'''

SENDERS = {"flaky": "outboxhandlers:flaky", "broken": "outboxhandlers:broken"}

Daemons = Callable[..., Daemon]


# --- helpers -------------------------------------------------------------------------------


def create_tables(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE public.orders (id bigserial PRIMARY KEY, key text NOT NULL,"
                 " job_id bigint NOT NULL)")


def outbox_config(*, outbox_lane: str = "outbox", max_attempts: int = 60) -> dict[str, Any]:
    config = make_config(
        {
            "default": {"workers": 1, "concurrency": 4},
            outbox_lane: {"workers": 1, "concurrency": 4, "max_attempts": max_attempts,
                          "backoff": {"base": "20ms", "cap": "100ms"}},
        },
        handlers={"order": "outboxhandlers:order"},
    )
    config["outbox"] = {"lane": outbox_lane, "senders": dict(SENDERS)}
    return config


def start_daemon(daemons: Daemons, tmp_path: Path, config: dict[str, Any]) -> Daemon:
    (tmp_path / "outboxhandlers.py").write_text(HANDLERS_MODULE.format(directory=str(tmp_path)))
    return daemons(config)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def outbox_rows(conn: psycopg.Connection) -> list[dict[str, Any]]:
    cursor = conn.execute(
        "SELECT o.id, o.key, o.sender, o.payload, o.state, o.delivery_job_id, o.last_error,"
        "       o.source_job_id, s.idempotency_key AS source_key"
        "  FROM outbox AS o LEFT JOIN all_jobs AS s ON s.id = o.source_job_id ORDER BY o.id")
    assert cursor.description is not None
    names = [column.name for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def scalar(conn: psycopg.Connection, sql: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


# --- in-process: the entry commits with the handler or not at all --------------------------


def run_adding(conn: psycopg.Connection, db_url: str, job: Job, *, fail: bool = False,
               key: str | None = None) -> str:
    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        tx.execute("INSERT INTO public.orders (key, job_id) VALUES (%s, %s)",
                   (job.effect_key, job.id))
        outbox.add(tx, job, "mailer", {"to": "a@example.com"}, key=key)
        if fail:
            raise RuntimeError("the handler failed after adding to the outbox")

    with connect(db_url) as tx_conn:
        return run_transactional(tx_conn, job, handler)


def test_an_outbox_entry_commits_with_the_handler_and_gets_a_delivery_job(
    conn: psycopg.Connection, db_url: str
) -> None:
    create_tables(conn)
    keyed = jobd.enqueue(conn, "order", idempotency_key="order-17")
    keyless = jobd.enqueue(conn, "order")
    jobs = queue.claim(conn, "default", "w", 2, 30)
    assert [run_adding(conn, db_url, job) for job in jobs] == ["done", "done"]
    rows = outbox_rows(conn)
    # The default key: the job's effect key and the sender's name.
    assert [(r["key"], r["sender"], r["state"], r["source_job_id"]) for r in rows] == [
        ("order-17:mailer", "mailer", "pending", keyed),
        (f"jobd:job:{keyless}:mailer", "mailer", "pending", keyless),
    ]
    delivery = conn.execute(
        "SELECT id, lane, handler, payload, idempotency_key FROM jobs ORDER BY id").fetchall()
    assert delivery == [
        (rows[0]["delivery_job_id"], "outbox", "jobd.outbox:mailer", {"outbox_id": rows[0]["id"]},
         "jobd:outbox:order-17:mailer"),
        (rows[1]["delivery_job_id"], "outbox", "jobd.outbox:mailer", {"outbox_id": rows[1]["id"]},
         f"jobd:outbox:jobd:job:{keyless}:mailer"),
    ]


def test_an_outbox_payload_meets_a_jobs_payload_rules(
    conn: psycopg.Connection, db_url: str
) -> None:
    # The payload went to psycopg's own JSON dump: {1: "a", "1": "b"} reached the sender as
    # {"1": "b"}, a JsonText was a TypeError and a NaN a server error aborting the handler.
    create_tables(conn)
    payloads: list[Any] = [{1: "a", "1": "b"}, {"amount": float("nan")},
                           jobd.JsonText('{"amount": 19.90}')]
    for _ in payloads:
        jobd.enqueue(conn, "order")
    claimed = queue.claim(conn, "default", "w", len(payloads), 30)

    def adding(payload: Any) -> Callable[[Job, psycopg.Connection], None]:
        @jobd.transactional
        def handler(job: Job, tx: psycopg.Connection) -> None:
            outbox.add(tx, job, "mailer", payload)
        return handler

    with connect(db_url) as tx_conn:
        for job, payload in zip(claimed[:2], payloads[:2], strict=True):
            with pytest.raises(ValueError, match="payload"):
                run_transactional(tx_conn, job, adding(payload))
            assert tx_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert run_transactional(tx_conn, claimed[2], adding(payloads[2])) == "done"
    assert [r["payload"] for r in outbox_rows(conn)] == [{"amount": 19.9}]
    assert scalar(conn, "SELECT payload::text FROM outbox") == '{"amount": 19.90}'


def test_an_outbox_entry_of_a_failed_or_stale_handler_is_rolled_back(
    conn: psycopg.Connection, db_url: str
) -> None:
    create_tables(conn)
    job_id = jobd.enqueue(conn, "order", idempotency_key="order-18")
    now = scalar(conn, "SELECT now()")
    [job] = queue.claim(conn, "default", "w", 1, 30, now=now)
    with pytest.raises(RuntimeError):
        run_adding(conn, db_url, job, fail=True)
    assert outbox_rows(conn) == []
    # Only the order job itself is queued: no delivery job was left behind.
    assert scalar(conn, "SELECT count(*) FROM jobs") == 1

    # The lease runs out and another worker re-claims it: the first worker's commit fails.
    later = job.lease_until + timedelta(seconds=1)
    assert recovery.expire_leases(conn, lambda _lane: RetryPolicy(), now=later).retried == [job_id]
    [fresh] = queue.claim(conn, "default", "w2", 1, 30, now=later + timedelta(minutes=10))
    with pytest.raises(LeaseLost):
        run_adding(conn, db_url, job)
    assert outbox_rows(conn) == []
    assert run_adding(conn, db_url, fresh) == "done"
    assert [r["key"] for r in outbox_rows(conn)] == ["order-18:mailer"]
    assert scalar(conn, "SELECT count(*) FROM public.orders") == 1


@pytest.mark.parametrize("running", [False, True], ids=["pending", "running"])
def test_a_cancelled_delivery_marks_its_entry_dead(
    conn: psycopg.Connection, db_url: str, running: bool
) -> None:
    # Cancelled, the delivery job was archived and its entry stayed 'pending' for good:
    # never delivered, never dead, and neither a replay nor a rerun could deliver it.
    create_tables(conn)
    jobd.enqueue(conn, "order")
    [job] = queue.claim(conn, "default", "w", 1, 30)
    assert run_adding(conn, db_url, job) == "done"
    [entry] = outbox_rows(conn)
    delivery_id = entry["delivery_job_id"]
    if running:
        [delivery] = queue.claim(conn, "outbox", "w", 1, 30)
        assert jobd.cancel(conn, [delivery_id]).requested == [delivery_id]
        assert outbox_rows(conn)[0]["state"] == "pending"  # it may still deliver
        # Its run ends without delivering (the sender's error, or the cancel's own).
        failed = queue.fail(conn, [queue.Failure(delivery.lease, "CancelledError", 1.0, 8)])
        assert failed.cancelled == [delivery_id]
    else:
        assert jobd.cancel(conn, [delivery_id]).cancelled == [delivery_id]
    [entry] = outbox_rows(conn)
    assert (entry["state"], entry["last_error"]) == ("dead", "cancelled before delivery")
    assert scalar(conn, "SELECT state FROM all_jobs WHERE id = %s", (delivery_id,)) == "cancelled"


def test_adding_a_key_twice_keeps_the_first_entry(conn: psycopg.Connection, db_url: str
                                                  ) -> None:
    create_tables(conn)
    jobd.enqueue(conn, "order")
    jobd.enqueue(conn, "order")
    first, second = queue.claim(conn, "default", "w", 2, 30)
    run_adding(conn, db_url, first, key="welcome-mail:user-5")
    run_adding(conn, db_url, second, key="welcome-mail:user-5")
    rows = outbox_rows(conn)
    assert [(r["key"], r["source_job_id"]) for r in rows] == [("welcome-mail:user-5", first.id)]
    assert scalar(conn, "SELECT count(*) FROM jobs WHERE starts_with(handler, 'jobd.outbox:')") == 1


# --- the daemon: delivery --------------------------------------------------------------------


@pytest.mark.slow
def test_a_flaky_sender_delivers_every_entry_with_its_key_and_the_receiver_dedups(
    tmp_path: Path, db_url: str, conn: psycopg.Connection, daemons: Daemons
) -> None:
    create_tables(conn)
    count = 40
    for n in range(count):
        # Half of the jobs carry an idempotency key, half use the key derived from the id.
        jobd.enqueue(conn, "order", {"n": n}, idempotency_key=f"order-{n}" if n % 2 else None)
    daemon = start_daemon(daemons, tmp_path, outbox_config(max_attempts=60))

    def undelivered() -> int:
        return int(scalar(conn, "SELECT count(*) FROM outbox WHERE state <> 'delivered'"))

    wait_until(lambda: scalar(conn, "SELECT count(*) FROM outbox") == count
               and undelivered() == 0 and scalar(conn, "SELECT count(*) FROM jobs") == 0,
               60, interval=0.1,
               message=lambda: f"{count} delivered entries; {undelivered()} are not\n"
                               f"{daemon.tail()}")

    rows = outbox_rows(conn)
    assert len(rows) == count and {r["state"] for r in rows} == {"delivered"}
    assert scalar(conn, "SELECT count(*) FROM public.orders") == count
    for row in rows:
        effect_key = row["source_key"] or f"jobd:job:{row['source_job_id']}"
        assert row["key"] == f"{effect_key}:flaky"
    keys = {row["id"]: row["key"] for row in rows}

    calls = read_json_lines(tmp_path / "calls.log")
    calls_per_entry = collections.Counter(call["id"] for call in calls)
    keys_per_entry: dict[int, set[str]] = collections.defaultdict(set)
    for call in calls:
        keys_per_entry[call["id"]].add(call["key"])
    assert set(calls_per_entry) == set(keys)  # every entry was sent, at least once
    assert {entry: {key} for entry, key in keys.items()} == keys_per_entry  # same key always
    assert len(calls) > count, "the sender never failed: nothing was retried"
    # Attempts count up per entry: a retry is a new attempt of the same delivery job.
    for entry_id in keys:
        attempts = [c["attempt"] for c in calls if c["id"] == entry_id]
        assert attempts == list(range(1, len(attempts) + 1))

    received = read_json_lines(tmp_path / "received.log")
    applied: dict[str, Any] = {}
    for request in received:
        applied.setdefault(request["key"], request["payload"])  # the receiver's dedup
    assert sorted(applied) == sorted(keys.values())
    assert len(received) > len(applied), (
        "no request reached the receiver twice: the dedup was never needed")
    payloads = {row["key"]: row["payload"] for row in rows}
    assert applied == payloads
    assert scalar(conn, "SELECT count(*) FROM dead_letter") == 0


@pytest.mark.slow
def test_a_sender_that_keeps_failing_dead_letters_the_entry_and_a_replay_delivers_it(
    tmp_path: Path, db_url: str, conn: psycopg.Connection, daemons: Daemons
) -> None:
    create_tables(conn)
    source = jobd.enqueue(conn, "order", {"n": 1, "sender": "broken"},
                          idempotency_key="order-broken")
    daemon = start_daemon(daemons, tmp_path, outbox_config(max_attempts=3))

    wait_until(lambda: scalar(conn, "SELECT count(*) FROM dead_letter") == 1, 30,
               interval=0.1, message=lambda: f"the delivery job to die\n{daemon.tail()}")
    [row] = outbox_rows(conn)
    assert row["key"] == "order-broken:broken"
    assert row["source_job_id"] == source
    # The dead-letter trigger marks the entry in the statement that buries its job.
    assert row["state"] == "dead"
    assert "the receiver is down" in row["last_error"]
    dead = conn.execute("SELECT id, handler, attempts FROM dead_letter").fetchone()
    assert dead == (row["delivery_job_id"], "jobd.outbox:broken", 3)
    calls = read_json_lines(tmp_path / "calls.log")
    assert [(c["key"], c["attempt"]) for c in calls] == [
        ("order-broken:broken", 1), ("order-broken:broken", 2), ("order-broken:broken", 3)]
    assert not (tmp_path / "received.log").exists()

    (tmp_path / "fixed").touch()
    replay = subprocess.run(
        [sys.executable, "-m", "jobd", "dlq", "replay", str(row["delivery_job_id"]),
         "--database-url", db_url],
        capture_output=True, text=True, timeout=60, env=daemon.env())
    assert replay.returncode == 0, replay.stderr
    assert f"replayed 1 job(s): {row['delivery_job_id']}" in replay.stdout

    wait_until(lambda: outbox_rows(conn)[0]["state"] == "delivered", 30, interval=0.1,
               message=lambda: f"the replayed entry to be delivered\n{daemon.tail()}")
    assert read_json_lines(tmp_path / "received.log") == [
        {"key": "order-broken:broken", "payload": {"order": 1}}]
    calls = read_json_lines(tmp_path / "calls.log")
    assert {c["key"] for c in calls} == {"order-broken:broken"} and len(calls) == 4
    wait_until(lambda: scalar(conn, "SELECT count(*) FROM jobs") == 0, 10,
               message="the delivery job to finish")
    assert scalar(conn, "SELECT count(*) FROM dead_letter") == 0
    assert scalar(conn, "SELECT state FROM all_jobs WHERE id = %s",
                  (row["delivery_job_id"],)) == "done"


@pytest.mark.slow
def test_delivery_jobs_go_to_the_configured_outbox_lane(
    tmp_path: Path, db_url: str, conn: psycopg.Connection, daemons: Daemons
) -> None:
    create_tables(conn)
    source = jobd.enqueue(conn, "order", {"n": 1})
    daemon = start_daemon(daemons, tmp_path, outbox_config(outbox_lane="mail"))
    wait_until(lambda: scalar(conn, "SELECT count(*) FROM all_jobs WHERE id = %s"
                                    " AND state = 'done'", (source,)) == 1,
               30, interval=0.1, message=lambda: f"the order job to finish\n{daemon.tail()}")
    [row] = outbox_rows(conn)
    lane = scalar(conn, "SELECT lane FROM all_jobs WHERE id = %s", (row["delivery_job_id"],))
    assert lane == "mail"


@pytest.mark.slow
def test_a_node_without_a_sender_leaves_its_deliveries_to_the_node_that_has_it(
    tmp_path: Path, conn: psycopg.Connection, daemons: Daemons
) -> None:
    # A rolling deploy that adds the sender "sms": the old node runs the outbox lane with the
    # senders it has. It used to claim the sms deliveries too, fail each ("no outbox sender
    # named 'sms'") and spend its attempts, so the entries went dead before the new node,
    # which has the sender, could deliver them.
    create_tables(conn)
    old_config = outbox_config(max_attempts=2)
    old_config["node"]["name"] = "old"
    old_config["outbox"]["senders"] = {"receive": "outboxhandlers:receive"}
    (tmp_path / "outboxhandlers.py").write_text(HANDLERS_MODULE.format(directory=str(tmp_path)))
    old = daemons(old_config, name="old")
    sms = [jobd.enqueue(conn, "order", {"n": n, "sender": "sms"}) for n in range(5)]
    plain = [jobd.enqueue(conn, "order", {"n": n, "sender": "receive"}) for n in range(5, 8)]

    def entries(sender: str) -> list[tuple[str, int | None, str | None]]:
        return conn.execute(
            "SELECT o.state, j.attempts, j.state FROM outbox AS o"
            "  LEFT JOIN jobs AS j ON j.id = o.delivery_job_id"
            " WHERE o.sender = %s ORDER BY o.id", (sender,)).fetchall()

    wait_until(lambda: [state for state, _, _ in entries("receive")] == ["delivered"] * 3, 30,
               interval=0.1, message=lambda: f"the old node's own deliveries\n{old.tail()}")
    wait_until(lambda: len(entries("sms")) == len(sms) and (
                   scalar(conn, "SELECT count(*) FROM dead_letter") > 0
                   or old.events("this node has no such handler: its jobs are given back for "
                                 "the nodes that have it, and this worker no longer claims "
                                 "them", process="worker outbox#0")),
               30, interval=0.1, message=lambda: f"the old node to meet an sms delivery\n"
                                                 f"{old.tail()}")
    assert scalar(conn, "SELECT count(*) FROM dead_letter") == 0
    # Given back with their attempt each: the sender's entries wait for a node that has it.
    assert entries("sms") == [("pending", 0, "pending")] * len(sms)

    new_config = outbox_config(max_attempts=2)
    new_config["node"]["name"] = "new"
    new_config["outbox"]["senders"] = {"receive": "outboxhandlers:receive",
                                       "sms": "outboxhandlers:receive"}
    new = daemons(new_config, name="new")
    wait_until(lambda: [state for state, _, _ in entries("sms")] == ["delivered"] * len(sms),
               30, interval=0.1,
               message=lambda: f"the new node to deliver the sms entries\n{new.tail()}")
    received = [r["key"] for r in read_json_lines(tmp_path / "received.log")]
    assert sorted(received) == sorted(
        [f"jobd:job:{i}:sms" for i in sms] + [f"jobd:job:{i}:receive" for i in plain])
    assert scalar(conn, "SELECT count(*) FROM dead_letter") == 0
