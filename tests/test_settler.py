"""Outcomes on a connection of their own (``jobd.settler``): driven turn by turn in-process,
with real handler threads and a real PostgreSQL. A batch on its way keeps its outcomes
pending until its answer is taken; one that fails goes with the link's next statement and
applies once; shutdown waits for it; ``settle_connection: false`` keeps one connection, and
"auto" (the default) writes apart while the lane's workers leave cores idle."""

from __future__ import annotations

import json
import select
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from daemon_support import wait_until
from worker_support import connected_worker

import jobd
from jobd import handlers, jobs, pipes, protocol, settler, worker
from jobd.config import Config, LaneConfig, load
from jobd.errors import ConfigError
from jobd.eventloop import SelectLoop
from jobd.workerpool import WorkerPool

LANE = "default"
WORKER_ID = "test-node:default#0:settle"
SETTLE_NAME = protocol.backend_prefix(WORKER_ID) + f"{LANE}/0 settle node="
WAIT_S = 10.0  # a bound for what happens at once, never a pause


def ok(job: jobs.Job) -> None:
    """A handler that succeeds at once."""


@pytest.fixture
def subject(db_url: str) -> Iterator[worker.Worker]:
    """A connected worker of two threads whose handler ``ok`` succeeds at once."""
    lane = LaneConfig(LANE, concurrency=2, prefetch=2, settle_connection=True)
    with connected_worker(db_url, lane, WORKER_ID,
                          {"ok": handlers.resolved("ok", ok)}) as (made, _wake):
        yield made


def states(conn: psycopg.Connection) -> dict[int, str]:
    return dict(conn.execute("SELECT id, state FROM all_jobs ORDER BY id").fetchall())


def run_to_outcomes(subject: worker.Worker, conn: psycopg.Connection, count: int) -> list[int]:
    """Enqueue ``count`` jobs, claim them in one turn and wait until all have an outcome."""
    ids = [jobd.enqueue(conn, "ok") for _ in range(count)]
    expected = len(subject.completer.pending) + count
    subject.claimer.maybe_more = True
    subject._settle_and_claim()

    def finished() -> bool:
        select.select([subject.runner.results_r], [], [], 0.05)
        subject._collect_outcomes()
        subject.slots.fill(subject.lifecycle.mode)
        return len(subject.completer.pending) >= expected

    wait_until(finished, WAIT_S, interval=0, message="the handlers to finish")
    return ids


def wait_for_answer(subject: worker.Worker) -> None:
    """Until the settler pokes its pipe, which is then drained (as the worker's loop does):
    a poke left there made the next wait return before the next batch's answer."""
    assert subject.settler is not None
    readable, _, _ = select.select([subject.settler.wake_fd], [], [], WAIT_S)
    assert readable, "the settler never answered"
    pipes.drain(subject.settler.wake_fd)


def settle_backends(conn: psycopg.Connection) -> list[int]:
    return [pid for (pid,) in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (SETTLE_NAME,))]


def test_outcomes_are_written_on_a_connection_of_their_own(
        subject: worker.Worker, conn: psycopg.Connection) -> None:
    ids = run_to_outcomes(subject, conn, 4)
    subject._settle_and_claim()
    assert subject.settler is not None and subject.settler.busy
    # On their way: still pending (so never seen as lost), and no other batch is made.
    assert [o.job.id for o in subject.completer.pending] == ids
    assert subject.completer.handed_over and subject.completer.due_at() is None
    wait_for_answer(subject)
    subject._settle_and_claim()
    assert not subject.completer.pending and not subject.settler.busy
    assert states(conn) == dict.fromkeys(ids, "done")
    assert subject.counters.completed == 4
    assert len(settle_backends(conn)) == 1  # named like the worker's: crash attribution ends it


def test_a_batch_whose_connection_was_lost_goes_with_the_link_and_applies_once(
        subject: worker.Worker, conn: psycopg.Connection) -> None:
    assert subject.settler is not None
    ids = run_to_outcomes(subject, conn, 3)
    # It connects in the background at start.
    wait_until(lambda: settle_backends(conn), WAIT_S, message="the settler to connect")
    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                 " WHERE application_name = %s", (SETTLE_NAME,))
    subject._settle_and_claim()
    wait_for_answer(subject)
    subject.exchange.take_settled()
    # Not written: back in the queue of outcomes, and the next write goes on the link.
    assert [o.job.id for o in subject.completer.pending] == ids
    assert not subject.completer.handed_over
    assert not subject.settler.usable(time.monotonic())
    subject._settle_and_claim()
    assert not subject.completer.pending and not subject.settler.busy
    assert states(conn) == dict.fromkeys(ids, "done")
    assert (subject.counters.completed, subject.counters.lease_lost) == (3, 0)
    # After the pause the settler takes batches again, on a new connection.
    assert subject.settler.usable(time.monotonic() + settler.FALLBACK)


def test_claims_stop_while_a_workers_worth_of_outcomes_waits_behind_a_stuck_batch(
        subject: worker.Worker, conn: psycopg.Connection, db_url: str) -> None:
    assert subject.claimer.capacity == 4  # two slots, a buffer of two
    stuck = run_to_outcomes(subject, conn, 2)
    with psycopg.connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT 1 FROM jobd.jobs WHERE id = ANY(%s) FOR UPDATE", [stuck])
        subject._settle_and_claim()  # the batch goes, and waits for the lock
        wait_until(lambda: conn.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock'", (SETTLE_NAME,)).fetchone(), WAIT_S,
            message="the batch to wait for the lock")
        behind = run_to_outcomes(subject, conn, 2)  # claimed and run meanwhile: 4 waiting
        later = jobd.enqueue(conn, "ok")
        subject.claimer.maybe_more = True
        subject._settle_and_claim()
        assert states(conn)[later] == "pending"  # no claim while they wait
        holder.rollback()
    wait_for_answer(subject)
    subject._settle_and_claim()  # the answer taken: the next batch goes, and a claim
    assert states(conn)[later] == "claimed"
    assert {i: states(conn)[i] for i in stuck} == dict.fromkeys(stuck, "done")
    wait_for_answer(subject)
    subject.exchange.take_settled()
    assert {i: states(conn)[i] for i in behind} == dict.fromkeys(behind, "done")


def test_shutdown_waits_for_the_batch_on_its_way(
        subject: worker.Worker, conn: psycopg.Connection) -> None:
    ids = run_to_outcomes(subject, conn, 2)
    subject._settle_and_claim()
    assert subject.settler is not None and subject.settler.busy
    subject._shutdown()
    assert states(conn) == dict.fromkeys(ids, "done")
    assert not subject.completer.pending
    assert subject.settler.link.conn is None


def test_one_connection_when_settle_connection_is_off(db_url: str,
                                                      conn: psycopg.Connection) -> None:
    lane = LaneConfig(LANE, concurrency=2, prefetch=2, settle_connection=False)
    with connected_worker(db_url, lane, WORKER_ID,
                          {"ok": handlers.resolved("ok", ok)}) as (made, _wake):
        assert made.settler is None
        ids = run_to_outcomes(made, conn, 2)
        made._settle_and_claim()  # the outcomes go now, on the link
        assert not made.completer.pending
        assert states(conn) == dict.fromkeys(ids, "done")
        assert settle_backends(conn) == []


def test_settle_connection_is_true_false_or_auto(tmp_path: Path) -> None:
    path = tmp_path / "jobd.yaml"
    path.write_text("lanes:\n  default:\n    settle_connection: 1\n")
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert ("lanes.default.settle_connection: must be true, false or auto, not 1"
            in str(raised.value))
    for text, expected in (("false", False), ("true", True), ("auto", None), ("Auto", None)):
        path.write_text(f"lanes:\n  default:\n    settle_connection: {text}\n")
        assert load(path).lanes["default"].settle_connection is expected
    path.write_text("lanes:\n  default: {}\n")
    assert load(path).lanes["default"].settle_connection is None  # auto by default


@pytest.mark.parametrize(("node_workers", "cores", "setting", "apart"), [
    (1, 2, None, True),  # a worker and its backend leave a core idle
    (2, 4, None, True),
    (2, 2, None, False),  # the cores are busy anyway
    (4, 2, None, False),
    (4, 2, True, True),  # said outright, it holds
    (1, 8, False, False),
])
def test_auto_writes_outcomes_apart_while_the_nodes_workers_leave_cores_idle(
        node_workers: int, cores: int, setting: bool | None, apart: bool) -> None:
    lane = LaneConfig(LANE, workers=1, settle_connection=setting)
    assert lane.settles_apart(cores, node_workers) is apart


def test_a_reload_decides_auto_again_for_the_whole_node() -> None:
    """Two lanes of one worker on four cores settle apart; a reload that gives one of them a
    second worker leaves both lanes' workers too many: each is replaced, and each slot kept
    spawns with the new lane config."""
    def config(default_workers: int) -> Config:
        return Config(lanes={"default": LaneConfig("default", workers=default_workers),
                             "mail": LaneConfig("mail", workers=1)})

    pool = WorkerPool(config(1), "", SelectLoop())
    pool.cores = 4
    pool.build()
    before = dict(pool.slots)
    assert all(pool._settles_apart(pool.config, slot.lane) for slot in before.values())
    before[("mail", 0)].backoff.failures = 3  # its worker has been crashing
    pool.apply(config(2))
    assert sorted(pool.slots) == [("default", 0), ("default", 1), ("mail", 0)]
    assert not any(pool.slots[key] is before[key] for key in before)  # replaced: auto flipped
    assert not any(pool._settles_apart(pool.config, s.lane) for s in pool.slots.values())
    # Nothing about the mail lane changed: its restart backoff stands.
    assert {key: s.backoff.failures for key, s in pool.slots.items()} == {
        ("default", 0): 0, ("default", 1): 0, ("mail", 0): 3}
    # The same count again: nothing flips, the slots stay, and carry the new lane config.
    kept = dict(pool.slots)
    pool.apply(config(2))
    assert all(pool.slots[key] is kept[key] for key in kept)
    pool.apply(config(1))  # back to two workers on four cores: auto flips back
    assert sorted(pool.slots) == [("default", 0), ("mail", 0)]
    assert all(pool._settles_apart(pool.config, s.lane) for s in pool.slots.values())
    assert pool.slots[("default", 0)].lane.workers == 1
    assert pool.slots[("mail", 0)].backoff.failures == 3
    # A change to the lane itself starts its slots afresh, as before.
    pool.apply(Config(lanes={"default": LaneConfig("default", workers=1),
                             "mail": LaneConfig("mail", workers=1, concurrency=4)}))
    assert pool.slots[("mail", 0)].backoff.failures == 0


def test_a_slot_replaced_because_auto_flipped_keeps_waiting_out_its_restart_delay() -> None:
    """A crash-looping slot waits out its delay across a reload that replaces it only because
    another lane's worker count flipped auto: it spawns no sooner, and a crash pinned on its
    last worker's one job is still forgiven."""
    def config(mail_workers: int) -> Config:
        return Config(lanes={"default": LaneConfig("default", workers=1),
                             "mail": LaneConfig("mail", workers=mail_workers)})

    pool = WorkerPool(config(1), "", SelectLoop())
    pool.cores = 4  # two workers settle apart, three do not
    pool.build()
    waiting = pool.slots[("default", 0)]
    waiting.backoff.failures = 6
    waiting.spawn_at = time.monotonic() + 32.0  # its sixth crash in a row: half a minute
    waiting.last_worker, waiting.exited_at = "test-node:default#0:dead", time.monotonic()
    pool.apply(config(2))
    slot = pool.slots[("default", 0)]
    assert slot is not waiting  # replaced: auto flipped
    assert (slot.backoff.failures, slot.spawn_at) == (6, waiting.spawn_at)
    assert pool.next_spawn_at() == pool.slots[("mail", 1)].spawn_at  # the new slot, at once
    pool.forgive_crash("test-node:default#0:dead")
    assert slot.backoff.failures == 5
    assert slot.spawn_at == pytest.approx(waiting.exited_at + slot.backoff.base)


def test_a_reload_changing_only_workers_respawns_with_the_new_lane_config() -> None:
    pool = WorkerPool(Config(lanes={"default": LaneConfig("default", workers=3)}), "",
                      SelectLoop())
    pool.cores = 64  # auto stays on either way
    pool.build()
    slot = pool.slots[("default", 0)]
    pool.apply(Config(lanes={"default": LaneConfig("default", workers=2)}))
    assert pool.slots[("default", 0)] is slot and slot.lane.workers == 2


def test_a_spec_from_a_supervisor_older_than_the_decision_lets_the_worker_decide() -> None:
    lane = LaneConfig(LANE, workers=1, settle_connection=True)
    spec = protocol.WorkerSpec(
        worker_id=WORKER_ID, lane=lane, handlers={}, database_url="postgresql:///unused",
        schema="jobd", slot=0, generation=1, status_fd=-1, wake_fd=-1, shutdown_timeout=1.0,
        settles_apart=False)
    data = json.loads(spec.to_json())
    del data["settles_apart"]  # as an older supervisor writes it
    older = protocol.WorkerSpec.from_json(json.dumps(data))
    assert older.settles_apart is None and settler.settles_apart(older) is True
    assert settler.settles_apart(spec) is False  # the supervisor's answer holds
