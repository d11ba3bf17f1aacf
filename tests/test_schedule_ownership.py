"""Schedule ownership across nodes, through the `jobd.schedules` functions on a real PostgreSQL:
a schedule fires while any live node declares it, one node's config cannot switch off or
rewrite another's, conflicting definitions are reported and do not flap, and retiring is
explicit (the operator's flag) or follows from no live node declaring it."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import jobd.migrate
from jobd import schedules
from jobd.config import ScheduleConfig
from jobd.db import connect
from jobd.migrate import migrate
from jobd.schedules import Conflict, TickResult, tick

TTL = 30.0  # three duty passes of 10 s


def utc(*fields: int) -> datetime:
    return datetime(*fields, tzinfo=UTC)  # type: ignore[misc]


T0 = utc(2026, 10, 20, 12, 0, 30)


def schedule(cron: str = "* * * * *", id: str = "s", **options: Any) -> ScheduleConfig:
    return ScheduleConfig(id=id, cron=cron, handler="report", **options)


@dataclass
class Node:
    """One supervisor instance, doing what Supervisor does with the schedules functions."""

    conn: psycopg.Connection
    instance: str
    configs: Sequence[ScheduleConfig]

    def start(self, at: datetime | None) -> schedules.SyncResult:
        return schedules.sync(self.conn, self.configs, self.instance, TTL, now=at)

    def duty(self, at: datetime) -> TickResult:
        """The duty transaction: the tick, then the refresh."""
        with self.conn.transaction():
            result = tick(self.conn, now=at)
            schedules.refresh(self.conn, self.instance, self.configs, TTL, now=at)
        return result

    def leave(self) -> None:
        schedules.withdraw(self.conn, self.instance)


def fired(conn: psycopg.Connection, schedule_id: str = "s") -> list[datetime]:
    rows = conn.execute("SELECT fire_at FROM schedule_fires WHERE schedule_id = %s"
                        " ORDER BY fire_at", (schedule_id,)).fetchall()
    return [row[0] for row in rows]


def stored(conn: psycopg.Connection, schedule_id: str = "s") -> tuple[str, bool]:
    row = conn.execute("SELECT cron, enabled FROM schedules WHERE id = %s",
                       (schedule_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


def run(nodes: Sequence[Node], start: datetime, end: datetime,
        step: timedelta = timedelta(seconds=10)) -> list[str]:
    """Every node's duty pass every ``step`` from ``start`` to ``end``; the stored cron
    expression after each pass."""
    seen = []
    at = start
    while at <= end:
        for node in nodes:
            node.duty(at)
            seen.append(stored(node.conn)[0])
        at += step
    return seen


# --- any live node keeps a schedule ---------------------------------------------------------


def test_a_node_starting_without_the_schedule_does_not_switch_it_off(
    conn: psycopg.Connection,
) -> None:
    a = Node(conn, "a:1:aa", [schedule()])
    b = Node(conn, "b:2:bb", [])  # an empty or older config
    assert a.start(T0).created == ["s"]
    run([a], T0, T0 + timedelta(minutes=1))
    assert b.start(T0 + timedelta(minutes=1, seconds=5)) == schedules.SyncResult()

    run([a, b], T0 + timedelta(minutes=1, seconds=10), T0 + timedelta(minutes=4))
    assert stored(conn) == ("* * * * *", True)
    assert fired(conn) == [utc(2026, 10, 20, 12, minute) for minute in (1, 2, 3, 4)]
    [listed] = schedules.list_schedules(conn, now=T0 + timedelta(minutes=4))
    assert listed["declared_by"] == ["a:1:aa"] and listed["differing"] == []


def test_a_node_that_leaves_only_withdraws_its_own_declarations(
    conn: psycopg.Connection,
) -> None:
    a = Node(conn, "a:1:aa", [schedule(), schedule(id="t")])
    b = Node(conn, "b:2:bb", [schedule()])
    a.start(T0)
    b.start(T0)
    a.leave()
    run([b], T0 + timedelta(seconds=10), T0 + timedelta(minutes=2))
    assert fired(conn, "s") == [utc(2026, 10, 20, 12, 1), utc(2026, 10, 20, 12, 2)]
    assert fired(conn, "t") == []  # nobody declares t any more
    assert stored(conn, "t") == ("* * * * *", True)  # not disabled: undeclared


# --- retiring follows from no live node declaring it ----------------------------------------


def test_the_schedule_stops_firing_when_its_only_declaring_node_leaves(
    conn: psycopg.Connection,
) -> None:
    a = Node(conn, "a:1:aa", [schedule()])
    b = Node(conn, "b:2:bb", [])
    a.start(T0)
    b.start(T0)
    run([a, b], T0, T0 + timedelta(minutes=1))
    assert fired(conn) == [utc(2026, 10, 20, 12, 1)]

    a.leave()
    results = [b.duty(T0 + timedelta(minutes=minutes)) for minutes in (2, 3, 4)]
    assert all(r.enqueued == [] and r.next_fire_at is None for r in results)
    assert fired(conn) == [utc(2026, 10, 20, 12, 1)]
    assert stored(conn) == ("* * * * *", True)


def test_a_definition_adopted_after_its_node_was_away_fires_what_the_old_one_owed(
    conn: psycopg.Connection,
) -> None:
    # b declares a changed expression; it is away (frozen) past its declarations' expiry
    # while a, the last node of the stored one, leaves. Back at 13:05, b's refresh adopts its
    # expression, which starts at the change: 13:00, due under the stored expression while
    # b was away, was skipped, where the same expression would have caught it up.
    a = Node(conn, "a:1:aa", [schedule("0 * * * *", catchup="all")])
    b = Node(conn, "b:2:bb", [schedule("0,30 * * * *", catchup="all")])
    a.start(T0)
    b.start(T0)
    run([a, b], T0, T0 + timedelta(minutes=1))  # b's last pass at 12:01:30
    a.leave()
    b.duty(utc(2026, 10, 20, 13, 5))
    assert stored(conn) == ("0,30 * * * *", True)
    assert fired(conn) == [utc(2026, 10, 20, 13, 0)]
    # The adopted expression, from the change on.
    run([b], utc(2026, 10, 20, 13, 5, 20), utc(2026, 10, 20, 13, 30, 20),
        step=timedelta(seconds=20))
    assert fired(conn) == [utc(2026, 10, 20, 13, 0), utc(2026, 10, 20, 13, 30)]


def test_a_refresh_given_a_config_without_a_declared_schedule_still_adopts_it(
    conn: psycopg.Connection,
) -> None:
    # Between a reload and the sync that withdraws what the new config lacks, the refresh may
    # meet a declaration of a schedule its configs do not hold: nothing of its config to
    # compare, so nothing owed is fired, and the adoption goes on (it raised KeyError, which
    # ends the supervisor).
    a = Node(conn, "a:1:aa", [schedule("0 * * * *")])
    b = Node(conn, "b:2:bb", [schedule("0,30 * * * *")])
    a.start(T0)
    b.start(T0)
    a.leave()
    assert schedules.refresh(conn, b.instance, [schedule(id="other")], TTL,
                             now=T0 + timedelta(seconds=10)) == ["s"]
    assert stored(conn) == ("0,30 * * * *", True)


def test_declarations_that_expire_stop_counting(conn: psycopg.Connection) -> None:
    a = Node(conn, "a:1:aa", [schedule()])
    a.start(T0)
    run([a], T0, T0 + timedelta(minutes=1))  # last refresh at 12:01:30, live until 12:02:00
    assert fired(conn) == [utc(2026, 10, 20, 12, 1)]

    # The node died without leaving: from its expiry on, nothing fires.
    assert tick(conn, now=utc(2026, 10, 20, 12, 1, 59)).next_fire_at is not None
    for moment in (utc(2026, 10, 20, 12, 2, 1), utc(2026, 10, 20, 12, 5, 1)):
        assert tick(conn, now=moment).enqueued == []
    assert fired(conn) == [utc(2026, 10, 20, 12, 1)]

    # Another node declaring it picks it up from the cursor, under its catch-up policy.
    c = Node(conn, "c:3:cc", [schedule()])
    c.start(utc(2026, 10, 20, 12, 5, 10))
    c.duty(utc(2026, 10, 20, 12, 5, 20))
    assert fired(conn) == [utc(2026, 10, 20, 12, 1), utc(2026, 10, 20, 12, 5)]


# --- conflicts -------------------------------------------------------------------------------


def test_conflicting_definitions_are_reported_and_do_not_flap(conn: psycopg.Connection) -> None:
    a = Node(conn, "a:1:aa", [schedule("*/5 * * * *")])
    b = Node(conn, "b:2:bb", [schedule("*/10 * * * *")])
    assert a.start(T0).conflicts == []
    result = b.start(T0 + timedelta(seconds=1))
    assert result.conflicts == [Conflict("s", ("a:1:aa",), ("b:2:bb",))]
    assert result.changed == []

    # Both keep running, and each one syncs again (a reload) now and then: the stored
    # definition is the first one throughout.
    seen = run([a, b], T0 + timedelta(seconds=10), T0 + timedelta(minutes=10))
    a.start(T0 + timedelta(minutes=10, seconds=1))
    b.start(T0 + timedelta(minutes=10, seconds=2))
    seen += run([b, a], T0 + timedelta(minutes=10, seconds=10), T0 + timedelta(minutes=20))
    assert set(seen) == {"*/5 * * * *"}
    assert fired(conn) == [utc(2026, 10, 20, 12, minute) for minute in (5, 10, 15, 20)]
    assert schedules.conflicts(conn, now=T0 + timedelta(minutes=20)) == [
        Conflict("s", ("a:1:aa",), ("b:2:bb",))]

    # Once no live node declares the stored definition, the other one is adopted, once.
    a.leave()
    assert schedules.refresh(conn, b.instance, b.configs, TTL,
                             now=T0 + timedelta(minutes=20, seconds=5)) == ["s"]
    assert stored(conn) == ("*/10 * * * *", True)
    assert schedules.conflicts(conn, now=T0 + timedelta(minutes=20, seconds=5)) == []

    # A node with the old definition coming back is a conflict again, not a change back.
    old = Node(conn, "a:4:dd", [schedule("*/5 * * * *")])
    assert old.start(T0 + timedelta(minutes=20, seconds=10)).conflicts == [
        Conflict("s", ("b:2:bb",), ("a:4:dd",))]
    seen = run([old, b], T0 + timedelta(minutes=20, seconds=20), T0 + timedelta(minutes=31))
    assert set(seen) == {"*/10 * * * *"}
    assert fired(conn)[-1] == utc(2026, 10, 20, 12, 30)
    assert utc(2026, 10, 20, 12, 25) not in fired(conn)


def test_a_rolling_deploy_converges_once_every_old_node_is_gone(
    conn: psycopg.Connection,
) -> None:
    old = [Node(conn, f"old-{n}:1:aa", [schedule("*/5 * * * *")]) for n in (1, 2)]
    new = [Node(conn, f"new-{n}:2:bb", [schedule("*/5 * * * *", payload={"v": 2})])
           for n in (1, 2)]
    def payload() -> object:
        row = conn.execute("SELECT payload FROM schedules").fetchone()
        assert row is not None
        return row[0]

    for node in old:
        node.start(T0)
    assert new[0].start(T0 + timedelta(seconds=5)).conflicts == [
        Conflict("s", ("old-1:1:aa", "old-2:1:aa"), ("new-1:2:bb",))]
    old[0].leave()  # replaced by new-1
    new[1].start(T0 + timedelta(seconds=10))
    assert payload() == {}
    # old-2 still runs the old definition; its last duty pass is at 12:02:30, then it dies
    # without leaving.
    run([old[1], *new], T0 + timedelta(seconds=20), T0 + timedelta(minutes=2))
    assert payload() == {}
    assert schedules.conflicts(conn, now=T0 + timedelta(minutes=2)) == [
        Conflict("s", ("old-2:1:aa",), ("new-1:2:bb", "new-2:2:bb"))]

    # Its declaration expires 30 s after that refresh, at 12:03:00; the duty pass at that
    # instant adopts the new definition, and nothing is left to disagree about.
    run(new, T0 + timedelta(minutes=2, seconds=10), T0 + timedelta(minutes=2, seconds=20))
    assert payload() == {}
    run(new, T0 + timedelta(minutes=2, seconds=30), T0 + timedelta(minutes=2, seconds=30))
    assert payload() == {"v": 2}
    assert schedules.conflicts(conn, now=T0 + timedelta(minutes=2, seconds=30)) == []


def test_a_reconcile_never_waits_for_a_schedule_lock(
    conn: psycopg.Connection, db_url: str
) -> None:
    a = Node(conn, "a:1:aa", [schedule("*/5 * * * *")])
    a.start(T0)
    a.leave()
    b_configs = [schedule("*/10 * * * *")]
    with connect(db_url, autocommit=False) as holder, \
            connect(db_url, autocommit=False) as duty:
        # Another node's tick holds the schedule's row.
        holder.execute("SELECT 1 FROM schedules WHERE id = 's' FOR UPDATE")
        duty.execute("SET lock_timeout = '5s'")
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(lambda: (
                schedules.refresh(duty, "b:2:bb", b_configs, TTL, now=T0), duty.commit()))
            assert done.result(timeout=3) == ([], None)  # returned without waiting
        holder.rollback()
    assert schedules.refresh(conn, "b:2:bb", b_configs, TTL, now=T0) == ["s"]
    assert stored(conn) == ("*/10 * * * *", True)


# --- the operator's flag ----------------------------------------------------------------------


def test_an_operator_disable_survives_every_sync_and_enable_skips_what_it_missed(
    conn: psycopg.Connection,
) -> None:
    a = Node(conn, "a:1:aa", [schedule()])
    a.start(None)
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '10 minutes'")
    assert schedules.set_enabled(conn, "s", False) == (True, True)
    assert schedules.set_enabled(conn, "s", False) == (False, True)

    a.start(None)
    Node(conn, "b:2:bb", [schedule("*/2 * * * *")]).start(None)
    schedules.refresh(conn, a.instance, a.configs, TTL)
    assert stored(conn) == ("* * * * *", False)
    assert tick(conn).enqueued == [] and fired(conn) == []

    assert schedules.set_enabled(conn, "s", True) == (True, True)
    row = conn.execute("SELECT now() - materialized_until < interval '5 seconds'"
                       "  FROM schedules").fetchone()
    assert row == (True,)
    assert tick(conn).enqueued == []  # the ten minutes while disabled are not caught up
    with pytest.raises(schedules.UnknownSchedule):
        schedules.set_enabled(conn, "nope", False)


# --- the migration ----------------------------------------------------------------------------


def test_the_migration_re_enables_schedules_the_previous_sync_disabled(
    databases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = databases.empty()
    everything = jobd.migrate.available()
    with connect(url) as fresh:
        monkeypatch.setattr(jobd.migrate, "available",
                            lambda: [m for m in everything if m.version < 7])
        migrate(fresh, "jobd")
        fresh.execute("INSERT INTO schedules (id, cron, handler, enabled) VALUES"
                      " ('kept', '* * * * *', 'h', true), ('gone', '* * * * *', 'h', false)")
        monkeypatch.setattr(jobd.migrate, "available", lambda: everything)
        applied = migrate(fresh, "jobd")
        assert 7 in [m.version for m in applied]
        assert fresh.execute("SELECT id, enabled FROM schedules ORDER BY id").fetchall() == [
            ("gone", True), ("kept", True)]
        # Neither fires until a live node declares it.
        assert tick(fresh).enqueued == []


# --- lock order ---------------------------------------------------------------------------------


# Each racing node's share of the work (the test needs more than 20 syncs and 50 duty passes
# in all): the race runs until every node has done its share, not for a fixed time, so a slow
# machine races as long as it needs to.
SHARE = {"syncs": 6, "duties": 13}


def _churn(db_url: str, seed: int, deadline: float) -> dict[str, int]:
    """One node on its own connection: syncs random configs (two definitions of each id),
    runs duty passes (tick, then refresh, in one transaction), rewinds cursors so ticks fire,
    and sometimes leaves; until it has done its share (or the deadline)."""
    rng = random.Random(seed)
    counts = {"syncs": 0, "duties": 0, "enqueued": 0}
    instance = f"churn-{seed}:1:aa"
    with connect(db_url) as own:
        own.execute("SET lock_timeout = '20s'")  # a lock cycle shows up as a deadlock error
        configs: list[ScheduleConfig] = []
        while time.monotonic() < deadline and any(
                counts[kind] < share for kind, share in SHARE.items()):
            roll = rng.random()
            if roll < 0.2:
                configs = [schedule(rng.choice(["* * * * *", "*/2 * * * *"]), id=f"s{n}",
                                    catchup="all")
                           for n in range(6) if rng.random() < 0.7]
                schedules.sync(own, configs, instance, TTL)
                counts["syncs"] += 1
            elif roll < 0.25:
                schedules.withdraw(own, instance)
                configs = []
            elif roll < 0.3:
                own.execute("UPDATE schedules SET materialized_until = now() - interval"
                            " '20 minutes' WHERE id = %s", (f"s{rng.randrange(6)}",))
            else:
                with own.transaction():
                    result = tick(own)
                    schedules.refresh(own, instance, configs, TTL)
                counts["duties"] += 1
                counts["enqueued"] += len(result.enqueued)
    return counts


def test_nodes_syncing_ticking_and_refreshing_at_once_never_deadlock(
    conn: psycopg.Connection, db_url: str
) -> None:
    deadline = time.monotonic() + 120  # a bound for a stuck race, never reached otherwise
    with ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(lambda seed: _churn(db_url, seed, deadline), range(4)))
    assert sum(c["syncs"] for c in counts) > 20 and sum(c["duties"] for c in counts) > 50
    assert sum(c["enqueued"] for c in counts) > 0
    # One job per occurrence, whatever the races.
    assert conn.execute("SELECT count(*) = count(DISTINCT idempotency_key) FROM all_jobs"
                        ).fetchone() == (True,)
    # Every stored definition is one that some node declared.
    assert conn.execute("SELECT count(*) FROM schedules WHERE cron NOT IN"
                        " ('* * * * *', '*/2 * * * *')").fetchone() == (0,)
