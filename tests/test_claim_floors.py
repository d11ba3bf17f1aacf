"""Claim floors and the claimer's wake-up states, without a database (the SQL side is in
tests/test_steady.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobd import arming as arming_module
from jobd import claimer as claimer_module
from jobd import queue
from jobd.arming import ARMED_REFRESH, RETRY_DELAYS
from jobd.claim_floors import (
    CAUGHT_UP_MARGIN,
    FLOORS,
    FULL_SCAN_INTERVAL,
    HEAD,
    HEAD_SCAN_SHARE,
    LOOK_BACK,
    MAX_FULL_SCAN_INTERVAL,
    NOT_DRY_AGE,
    ClaimFloors,
    full_scan_params,
    kind,
    look_back_params,
)
from jobd.claimer import Claimer
from jobd.clock_watch import CLOCK_STEP, ClockWatch
from jobd.config import LaneConfig
from jobd.duties.retention import WAITER_STALE_AFTER
from jobd.jobs import Job
from jobd.protocol import WorkerMode

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_first_claim_and_one_a_second_scan_from_the_head() -> None:
    floors = ClaimFloors()
    assert floors.params(0.0) == full_scan_params()
    floors.claimed(full_scan_params(), [(0, at(1), 7)], 1, 0.0)  # full: there may be more
    assert floors.params(0.5)["floor_priorities"] == [0]
    assert floors.params(FULL_SCAN_INTERVAL) == full_scan_params()


def test_the_kind_of_floor_parameters_is_told_by_value_and_none_scans_from_the_head() -> None:
    assert kind(None) == HEAD  # queue.ClaimRequest without floors
    assert kind(dict(full_scan_params())) == HEAD
    assert kind(dict(look_back_params())) == "look back"
    assert kind({**full_scan_params(), "default_floor_age": 3.0}) == FLOORS
    with pytest.raises(TypeError):  # shared by every claim: nobody may change them
        full_scan_params()["default_floor_age"] = 1.0  # type: ignore[index]


def test_slow_scans_from_the_head_are_spaced_out_and_claims_look_back_meanwhile() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(0, at(1), 7)], 10, 0.0)
    # A cheap scan (vacuum keeps up): one a second, and nothing looks back.
    assert floors.head_scan_took(0.001) == FULL_SCAN_INTERVAL
    assert kind(floors.params(0.5)) == FLOORS
    assert kind(floors.params(FULL_SCAN_INTERVAL)) == HEAD
    # One of 20 ms (a held horizon's dead entries): the next one 20 ms / share later.
    spacing = floors.head_scan_took(0.02)
    assert spacing == 0.02 / HEAD_SCAN_SHARE > FULL_SCAN_INTERVAL
    # Meanwhile a claim looks back LOOK_BACK seconds, once a second, past every floor.
    assert look_back_params()["default_floor_age"] == LOOK_BACK
    assert floors.params(0.5) == look_back_params()
    assert kind(floors.params(0.6)) == FLOORS
    assert kind(floors.params(1.4)) == FLOORS
    assert kind(floors.params(1.5)) == "look back"
    assert kind(floors.params(spacing - 0.01)) != HEAD
    assert kind(floors.params(spacing)) == HEAD
    # However slow, at most MAX_FULL_SCAN_INTERVAL apart: a job far below the floors waits
    # that long.
    assert floors.head_scan_took(60.0) == MAX_FULL_SCAN_INTERVAL
    assert kind(floors.params(MAX_FULL_SCAN_INTERVAL)) == HEAD
    # Quick again (the horizon moved on): from the head once a second, no looking back.
    assert floors.head_scan_took(0.001) == FULL_SCAN_INTERVAL
    assert not floors.spaced_out
    assert kind(floors.params(0.5)) == FLOORS


def test_a_worker_working_through_a_backlog_does_not_look_back() -> None:
    # A look back would take the jobs of the last seconds before the older ones its floors
    # lead to; within those seconds the floors themselves find a straggler.
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(0, at(1), job_id) for job_id in range(10)], 10, 0.0)
    floors.head_scan_took(0.02)  # spaced out
    assert kind(floors.params(0.5)) == FLOORS  # full claims: no dry instant yet
    floors.claimed(floors.params(0.6), [(0, at(2), 11)], 10, 0.6)  # short: caught up
    assert kind(floors.params(0.7)) == "look back"
    # Caught up long ago and nothing claimed since: its dry floor is older than LOOK_BACK.
    assert not floors.caught_up(0.6 + LOOK_BACK)


def test_forgetting_the_floors_scans_from_the_head_at_once_however_slow_that_is() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(0, at(1), 7)], 10, 0.0)
    floors.head_scan_took(1.0)  # spaced out to MAX_FULL_SCAN_INTERVAL
    assert kind(floors.params(5.0)) != HEAD
    floors.forget()  # jobs were given back below the floors, a BEHIND wake-up, a resume
    assert kind(floors.params(5.0)) == HEAD


def test_an_armed_worker_looks_past_its_floors_once_more_then_sleeps() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [], 10, 0.0)
    assert floors.recheck_at(HEAD, 0.1) is None
    assert floors.recheck_at(FLOORS, 0.1) == floors.next_full_scan_at() == FULL_SCAN_INTERVAL
    floors.head_scan_took(0.05)  # the next scan from the head is 25 s away
    floors.params(0.2)  # a look back, at 0.2
    # Armed after a probe from its floors: it looks back a second after the last look back;
    # armed after that look back, only when the scan from the head is due.
    assert floors.recheck_at(FLOORS, 0.3) == 0.2 + FULL_SCAN_INTERVAL
    assert (floors.recheck_at("look back", 0.3) == floors.next_full_scan_at()
            == 0.05 / HEAD_SCAN_SHARE)
    # Idle past LOOK_BACK it is no longer caught up: no look back comes, so it looks once
    # more when the scan from the head is due, not at once (an arming a round trip).
    idle = LOOK_BACK + 1.0
    assert kind(floors.params(idle)) == FLOORS
    assert floors.recheck_at(FLOORS, idle) == floors.next_full_scan_at() > idle


def test_a_short_claim_leaves_every_priority_dry_with_a_margin() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(5, at(1), 3), (0, at(2), 9)], 10, 100.0)
    params = floors.params(100.25)
    assert params["default_floor_age"] == CAUGHT_UP_MARGIN + 0.25
    # No position: a job whose transaction began before the ones taken and committed after
    # the claim lies below them, within the margin.
    assert params["floor_priorities"] == []
    assert kind(params) == FLOORS


def test_a_full_claim_stops_at_the_last_job_of_the_lowest_priority_it_reached() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(5, at(1), 3), (0, at(4), 12), (0, at(2), 20)], 3, 50.0)
    params = floors.params(50.1)
    assert params["default_floor_age"] is None  # lower priorities were not reached
    by_priority = dict(zip(params["floor_priorities"],
                           zip(params["floor_run_ats"], params["floor_ids"],
                               params["floor_ages"], strict=True), strict=True))
    # The last by (run_at, id), not by arrival; no dry instant below it holds.
    assert by_priority[0] == (at(4), 12, NOT_DRY_AGE)
    run_at, job_id, age = by_priority[5]
    assert (run_at, job_id) == (at(1), 3)
    assert age is not None and abs(age - (CAUGHT_UP_MARGIN + 0.1)) < 1e-9  # exhausted


def test_work_found_below_the_dry_floor_is_followed_from_its_position() -> None:
    """A lane seen dry, then a herd due in the past (a backfill, a clock that passed the
    run_at of delayed jobs): the full scan finds it below the dry floor, and the claims after
    it go on from the herd's position instead of waiting for the next full scan."""
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [], 10, 0.0)  # dry at 0
    herd = [(0, at(-60), n) for n in range(1, 11)]
    floors.claimed(full_scan_params(), herd, 10, FULL_SCAN_INTERVAL)  # a full claim
    params = floors.params(FULL_SCAN_INTERVAL + 0.1)
    assert params["floor_priorities"] == [0] and params["floor_run_ats"] == [at(-60)]
    assert params["floor_ids"] == [10] and params["floor_ages"] == [NOT_DRY_AGE]


def test_a_fair_claim_that_finds_work_scans_from_the_head_until_it_comes_back_short() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [], 10, 0.0, fair=True)
    assert floors.params(0.1)["default_floor_age"] is not None  # dry
    floors.claimed(full_scan_params(), [(0, at(-60), 1)] * 10, 10, 1.0, fair=True)
    assert floors.params(1.1) == full_scan_params()
    floors.claimed(full_scan_params(), [(0, at(-60), 1)], 10, 1.2, fair=True)
    assert floors.params(1.3)["default_floor_age"] is not None


def test_giving_jobs_back_sends_the_next_claim_to_the_head() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(0, at(1), 1)], 10, 0.0)
    floors.forget()
    assert floors.params(0.1) == full_scan_params()


def test_a_step_of_the_database_clock_is_told_from_drift() -> None:
    watch = ClockWatch()
    assert watch.step(at(0), 100.0, 100.0) is None  # the first look: nothing to compare
    # 0.3 s on both clocks, give or take less than a step: no step.
    assert watch.step(at(0.3 + CLOCK_STEP / 2), 100.3, 100.3) is None
    # The database's clock an hour ahead, then back.
    step = watch.step(at(3600.5), 100.5, 100.5)
    assert step is not None and abs(step - 3600) < CLOCK_STEP
    step = watch.step(at(0.8), 100.8, 100.8)
    assert step is not None and step < -3590


def test_a_slow_claim_is_not_a_step_of_the_clock() -> None:
    """The database reads its clock somewhere between a claim's send and its answer: a
    claim answered 3 s after it was sent (a loaded server) read it up to 3 s earlier than
    the answer, and that is no step."""
    watch = ClockWatch()
    watch.step(at(0), 100.0, 100.01)
    assert watch.step(at(0.5), 100.5, 103.5) is None  # read as it began: no step
    assert watch.step(at(6.4), 104.0, 106.5) is None  # read as it ended: no step
    # Beyond the range by more than a step, either way: a step, by what lies outside.
    step = watch.step(at(6.4 + 3600), 107.0, 107.5)
    assert step is not None and abs(step - 3596.5) < 0.01
    step = watch.step(at(6.4), 108.0, 110.0)
    assert step is not None and abs(step + 3600.5) < 0.01


def job_leased(job_id: int, lease_until: datetime) -> Job:
    return Job(job_id, 1, "default", "h", "{}", 0, T0, 1, None, None, T0, lease_until)


def test_a_slow_short_claim_is_dry_as_of_its_send(monkeypatch) -> None:
    """A claim's snapshot may be as old as its send: a short claim answered 2 s after it was
    sent proves the lane dry as of the send, so a job enqueued meanwhile is above the
    floor it leaves (the floor at the answer less the margin would be above that job)."""
    clock = [500.0]
    monkeypatch.setattr(claimer_module.time, "monotonic", lambda: clock[0])
    claimer = Claimer(LaneConfig("default", concurrency=4), "w")
    claimer.suspects_possible = False
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None
    clock[0] += 2.0
    claimer.took(queue.Claimed([]), request, sent_at=clock[0] - 2.0)
    assert claimer.floors.params(clock[0])["default_floor_age"] == 2.0 + CAUGHT_UP_MARGIN


def test_the_claimer_reads_the_database_clock_from_the_leases(monkeypatch) -> None:
    clock = [500.0]
    monkeypatch.setattr(claimer_module.time, "monotonic", lambda: clock[0])
    lane = LaneConfig("default", concurrency=4)
    claimer = Claimer(lane, "w")
    claimer.suspects_possible = False
    vt = timedelta(seconds=lane.visibility_timeout)

    def claim(job_id: int, db_now: datetime, took: float = 0.0) -> dict:
        request = claimer.request(WorkerMode.RUNNING, 0)
        assert request is not None
        claimer.took(queue.Claimed([job_leased(job_id, db_now + vt)]), request,
                     sent_at=clock[0] - took)
        claimer.buffer.clear()
        claimer.maybe_more = True
        return claimer.floors.params(clock[0])

    claim(1, at(0))
    clock[0] += 0.3
    assert kind(claim(2, at(0.3))) == FLOORS  # clocks agree: the floors stay
    clock[0] += 2.5
    # Answered 2.5 s after it was sent, its now() read as it was sent: no step.
    assert kind(claim(3, at(0.3), took=2.5)) == FLOORS
    clock[0] += 0.3
    assert claim(4, at(3603.1)) == full_scan_params()  # the database's clock stepped an hour


# --- the claimer's wake-up states ----------------------------------------------------------


def claim_nothing(claimer: Claimer) -> None:
    """Feed the claimer a claim that came back empty."""
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None
    claimer.took(queue.Claimed([]), request)


def test_a_worker_lingers_then_arms_and_retries_while_enqueues_commit(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(claimer_module.time, "monotonic", lambda: clock[0])
    linger = (0.001, 0.002, 0.004)  # the default is none; the mechanism is tested with some
    monkeypatch.setattr(arming_module, "LINGER", linger)
    claimer = Claimer(LaneConfig("default", concurrency=2), "w")
    claimer.suspects_possible = False
    claim_nothing(claimer)
    for delay in linger:
        assert not claimer.wants_arm(WorkerMode.RUNNING, clock[0])
        assert claimer.arming.next_try_at == clock[0] + delay
        assert not claimer.try_due(clock[0])  # not yet
        clock[0] += delay
        assert claimer.try_due(clock[0])
        claim_nothing(claimer)
    assert claimer.wants_arm(WorkerMode.RUNNING, clock[0])
    assert not claimer.wants_arm(WorkerMode.DRAINING, clock[0])

    claimer.arm_result("contended", clock[0], FLOORS)
    assert claimer.arming.next_try_at == clock[0] + RETRY_DELAYS[0]
    clock[0] += RETRY_DELAYS[0]
    assert claimer.try_due(clock[0])
    claim_nothing(claimer)
    assert claimer.wants_arm(WorkerMode.RUNNING, clock[0])  # lingered already: arm again at once
    claimer.arm_result("contended", clock[0], FLOORS)
    assert claimer.arming.next_try_at == clock[0] + RETRY_DELAYS[1]

    clock[0] += RETRY_DELAYS[1]
    claimer.try_due(clock[0])
    claim_nothing(claimer)
    claimer.arm_result("armed", clock[0], FLOORS)
    assert claimer.arming.armed and not claimer.wants_arm(WorkerMode.RUNNING, clock[0])
    # Armed after a look above the floors: one more look, from the head, once a full scan
    # is due; armed after that one, it sleeps until woken.
    recheck = claimer.floors.last_full_scan + FULL_SCAN_INTERVAL
    assert claimer.arming.recheck_at == recheck == claimer.floors.next_full_scan_at()
    assert claimer.wants_arm(WorkerMode.RUNNING, recheck)
    claimer.arm_result("armed", recheck, HEAD)
    assert not claimer.wants_arm(WorkerMode.RUNNING, recheck + 100)

    # A wake-up whose claim comes back short: the worker stays armed (every enqueue since
    # its arming notified) and sleeps again without arming.
    claimer.maybe_more = True
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and not request.disarm
    assert kind(request.floors) == FLOORS
    claimer.took(queue.Claimed([]), request)
    assert claimer.arming.armed and not claimer.wants_arm(WorkerMode.RUNNING, clock[0])
    # That claim started at the floors, as a probe would: one more look from the head when
    # it is due, as after an arming.
    assert claimer.arming.recheck_at == claimer.floors.next_full_scan_at()


def test_an_armed_worker_disarms_after_a_full_claim_and_refreshes_its_row(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(claimer_module.time, "monotonic", lambda: clock[0])
    claimer = Claimer(LaneConfig("default", concurrency=2, prefetch=0), "w")
    claimer.suspects_possible = False
    claimer.arm_result("armed", clock[0], HEAD)
    # Woken into a backlog: the claim comes back full, so the next one removes the row and
    # enqueues into the busy lane stop notifying.
    claimer.maybe_more = True
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and not request.disarm and request.limit == 2
    claimer.took(queue.Claimed([job_leased(1, T0), job_leased(2, T0)]), request)
    for _ in range(2):
        assert claimer.next_to_start(WorkerMode.RUNNING, 0) is not None  # ran and done
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and request.disarm
    claimer.took(queue.Claimed([]), request)
    assert not claimer.arming.armed and claimer.wants_arm(WorkerMode.RUNNING, clock[0])
    # Armed for long without a reason to write its row again: it does, well before the
    # retention duty would take the row for a dead worker's.
    claimer.arm_result("armed", clock[0], HEAD)
    assert not claimer.wants_arm(WorkerMode.RUNNING, clock[0] + ARMED_REFRESH - 1)
    assert ARMED_REFRESH < WAITER_STALE_AFTER / 2
    assert claimer.wants_arm(WorkerMode.RUNNING, clock[0] + ARMED_REFRESH)


def test_an_arming_that_finds_work_leaves_the_worker_armed_and_contention_changes_nothing(
) -> None:
    claimer = Claimer(LaneConfig("default"), "w")
    claimer.suspects_possible = False
    claimer.arm_result("contended", 0.0, HEAD)  # nothing was written
    assert not claimer.arming.armed
    claimer.arm_result("work", 1.0, HEAD)  # registered; the row stays (migration 0024)
    assert claimer.arming.armed
    claimer.try_due(2.0)
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and not request.disarm
    claimer.took(queue.Claimed([]), request)  # short: armed, asleep until woken
    assert claimer.arming.armed and not claimer.wants_arm(WorkerMode.RUNNING, 2.0)
    claimer.arm_result("contended", 3.0, HEAD)
    assert claimer.arming.armed


def test_a_limited_lanes_worker_disarms_after_work_and_polls_for_budget() -> None:
    # 'work' in a limited lane is often due work without budget: the claim removes the row
    # and the worker goes on claiming after RETRY_DELAYS, not asleep.
    claimer = Claimer(LaneConfig("default", max_running=1), "w")
    claimer.suspects_possible = False
    claimer.arm_result("work", 1.0, HEAD)
    assert claimer.arming.next_try_at == 1.0 + RETRY_DELAYS[0]
    claimer.try_due(2.0)
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and request.disarm
    claimer.took(queue.Claimed([]), request)
    assert not claimer.arming.armed and claimer.wants_arm(WorkerMode.RUNNING, 2.0)
    # Armed and woken, its claim disarms too: a short claim there says nothing of due work.
    claimer.arm_result("armed", 3.0, HEAD)
    claimer.maybe_more = True
    request = claimer.request(WorkerMode.RUNNING, 0)
    assert request is not None and request.disarm


def test_a_new_connection_forgets_the_arming() -> None:
    claimer = Claimer(LaneConfig("default"), "w")
    claimer.arm_result("armed", 0.0, HEAD)
    claimer.arming.disconnected()
    assert not claimer.arming.armed


def test_without_linger_a_short_claim_arms_at_once() -> None:
    claimer = Claimer(LaneConfig("default"), "w")
    claimer.suspects_possible = False
    claim_nothing(claimer)
    assert claimer.arming.next_try_at is None
    assert claimer.wants_arm(WorkerMode.RUNNING, 0.0)


def test_a_fair_lane_keeps_a_position_per_key() -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [(0, at(1), 1)] * 10, 10, 0.0, fair=True)
    taken = [(0, "herd", at(1), 1), (0, "herd", at(1), 9), (0, "mail", at(2), 4)]
    floors.keys.claimed(taken, 3)  # a full claim
    params = floors.params(0.5)
    assert list(zip(params["key_floor_priorities"], params["key_floor_keys"],
                    params["key_floor_run_ats"], params["key_floor_ids"], strict=True)) == [
        (0, "herd", at(1), 9), (0, "mail", at(2), 4)]
    # A short claim leaves every key dry: the claims start at that instant, less the margin,
    # as a priority's do, not at the keys' positions.
    floors.claimed(params, taken[:1], 10, 0.5, fair=True)
    floors.keys.claimed(taken[:1], 10)
    after_short = floors.params(0.6)
    assert after_short["key_floor_keys"] == [] and kind(after_short) == FLOORS
    assert floors.params(FULL_SCAN_INTERVAL + 0.1) == full_scan_params()
    floors.forget()
    assert floors.params(0.7) == full_scan_params()
