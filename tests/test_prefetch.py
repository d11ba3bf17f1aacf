"""How much a worker claims ahead (``jobd.prefetch``): pure logic, no database."""

from __future__ import annotations

from jobd.config import LaneConfig
from jobd.prefetch import (
    BYTES_AHEAD,
    HOLD_AFTER_CRASH,
    HORIZON,
    IDLE_RESET,
    MAX_JOBS,
    ORDERED_HORIZON,
    STORED_BYTES_AHEAD,
    WINDOW,
    Prefetch,
)


def run_at_rate(prefetch: Prefetch, per_second: float, seconds: float,
                start: float = 100.0, started: int = 0) -> tuple[int, float, int]:
    """Ask every millisecond while jobs start at ``per_second``; the last answer."""
    now, size, total = start, prefetch.floor, float(started)
    for _ in range(round(seconds * 1000)):
        now += 0.001
        total += per_second * 0.001
        size = prefetch.current(int(total), now)
    return size, now, int(total)


def test_jobs_that_take_microseconds_fill_a_buffer_up_to_the_cap() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    assert prefetch.floor == 30 and prefetch.cap == 500
    assert prefetch.current(0, 100.0) == 30  # nothing measured yet: the floor
    size, _, _ = run_at_rate(prefetch, 20_000, 0.5)
    assert size == 500


def test_jobs_in_between_get_the_horizon_of_their_rate() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    size, _, _ = run_at_rate(prefetch, 1_600, 0.5)  # ten slots of ~6 ms jobs
    assert size == round(1_600 * HORIZON)


def test_slow_jobs_keep_the_floor() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    size, _, _ = run_at_rate(prefetch, 10, 3.0)  # one-second jobs in ten slots
    assert size == 30


def test_a_worker_idle_for_a_while_starts_again_from_the_floor() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    size, now, started = run_at_rate(prefetch, 20_000, 0.5)
    assert size == 500
    assert prefetch.current(started, now + WINDOW / 2) == 500  # a window still open
    assert prefetch.current(started, now + IDLE_RESET) == 30


def test_the_cap_is_bounded_in_jobs_and_a_lane_can_fix_the_size() -> None:
    # In jobs, whatever the concurrency: claims of 50 at concurrency 1 kept a worker of
    # no-op jobs at half the rate of one with a claim of 500.
    assert Prefetch(LaneConfig("l", concurrency=1)).cap == MAX_JOBS
    assert Prefetch(LaneConfig("l", concurrency=4)).cap == MAX_JOBS
    assert Prefetch(LaneConfig("l", concurrency=100)).cap == MAX_JOBS
    assert Prefetch(LaneConfig("l", concurrency=400)).cap == 1200  # the floor wins
    fixed = Prefetch(LaneConfig("l", concurrency=10, prefetch=5))
    assert run_at_rate(fixed, 20_000, 0.5)[0] == 5
    limited = Prefetch(LaneConfig("l", concurrency=10, max_running=4))
    assert run_at_rate(limited, 20_000, 0.5)[0] == 0


def test_a_fixed_buffer_stays_fixed_but_says_whether_the_jobs_are_short() -> None:
    """The deck (jobd.slots) needs to know that jobs take microseconds; an adapted buffer
    says so by growing past its floor, a fixed one (the lane's prefetch) by ``short``."""
    fixed = Prefetch(LaneConfig("l", concurrency=10, prefetch=500))
    assert not fixed.short  # nothing measured yet
    size, now, started = run_at_rate(fixed, 20_000, 0.5)  # 1,000 jobs in the horizon
    assert (size, fixed.short) == (500, True)
    assert (fixed.current(started, now + IDLE_RESET), fixed.short) == (500, False)
    slow = Prefetch(LaneConfig("l", concurrency=10, prefetch=500))
    assert (run_at_rate(slow, 1_600, 0.5)[0], slow.short) == (500, False)  # 80 in 50 ms
    limited = Prefetch(LaneConfig("l", concurrency=10, max_running=4))
    assert (run_at_rate(limited, 20_000, 0.5)[0], limited.short) == (0, False)
    adapted = Prefetch(LaneConfig("l", concurrency=10))
    run_at_rate(adapted, 20_000, 0.5)
    assert adapted.short and adapted.size > adapted.floor
    adapted.hold(now)
    assert not adapted.short


def test_after_a_crash_in_the_lane_the_floor_holds_for_a_while() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    size, now, started = run_at_rate(prefetch, 20_000, 0.5)
    assert size == 500
    prefetch.hold(now)
    size, now, started = run_at_rate(prefetch, 20_000, HOLD_AFTER_CRASH - 1, now, started)
    assert size == 30
    size, _, _ = run_at_rate(prefetch, 20_000, 2.0, now, started)
    assert size == 500


def test_a_fair_lane_buffers_less_work_ahead() -> None:
    for lane in (LaneConfig("l", concurrency=10, fair_by="handler"),
                 LaneConfig("l", concurrency=10, max_wait=5.0)):
        # Its shares are decided at the claim: a job of another key that arrives just after
        # waits behind no more than ORDERED_HORIZON of buffered work.
        assert run_at_rate(Prefetch(lane), 20_000, 0.5)[0] == round(20_000 * ORDERED_HORIZON)
        assert run_at_rate(Prefetch(lane), 4_000, 0.5)[0] == 30  # the floor


def test_a_worker_that_runs_dry_doubles_its_buffer_until_the_first_window_is_measured(
) -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    prefetch.ran_dry(99.0)  # nothing asked yet: no window, nothing to double
    assert prefetch.current(0, 100.0) == 30
    sizes = []
    for step in range(1, 6):  # a claim every 2 ms, each one full and finding the worker empty
        now = 100.0 + step * 0.002
        prefetch.ran_dry(now)
        sizes.append(prefetch.current(step, now))
    assert sizes == [60, 120, 240, 480, 500]  # at most the cap
    # Then the window's measure decides, as without the doubling: ten starts in 20 ms are
    # slow jobs, so back to the floor, and no more doubling until an idle reset.
    measured_at = 100.001 + WINDOW
    assert prefetch.current(10, measured_at) == 30
    prefetch.ran_dry(measured_at + 0.001)
    assert prefetch.current(10, measured_at + 0.001) == 30
    later = measured_at + IDLE_RESET
    assert prefetch.current(10, later) == 30
    prefetch.ran_dry(later + 0.001)
    assert prefetch.current(10, later + 0.001) == 60


def test_fixed_fair_and_held_buffers_do_not_double() -> None:
    fixed = Prefetch(LaneConfig("l", concurrency=10, prefetch=5))
    fair = Prefetch(LaneConfig("l", concurrency=10, fair_by="handler"))
    aging = Prefetch(LaneConfig("l", concurrency=10, max_wait=5.0))
    for prefetch in (fixed, fair, aging):
        # A fair lane's buffer bounds how long another key's job waits behind it.
        floor = prefetch.current(0, 100.0)
        prefetch.ran_dry(100.001)
        assert prefetch.current(0, 100.001) == floor
    held = Prefetch(LaneConfig("l", concurrency=10))
    held.current(0, 100.0)
    held.hold(100.0)  # a crash in the lane: every job it held becomes a suspect
    held.ran_dry(100.001)
    assert held.current(0, 100.001) == 30


# --- large payloads: a bound in bytes (BYTES_AHEAD) -------------------------------------------


def test_large_payloads_bound_the_buffer_by_bytes_not_only_by_jobs() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    size, now, started = run_at_rate(prefetch, 20_000, 0.5)
    assert size == MAX_JOBS
    prefetch.claimed(250, 250 * 1_000_000)  # jobs of 1 MB each
    assert prefetch.byte_cap == BYTES_AHEAD // 1_000_000
    assert prefetch.current(started, now + WINDOW / 2) == BYTES_AHEAD // 1_000_000
    size, _, _ = run_at_rate(prefetch, 20_000, 0.5, start=now, started=started)
    assert size == BYTES_AHEAD // 1_000_000  # however fast they start


def test_the_byte_bound_never_takes_the_buffer_below_one_refill_of_the_slots() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=100))
    prefetch.claimed(400, 400 * 1_000_000)
    assert prefetch.current(0, 100.0) == 100  # not the floor of 300 jobs of 1 MB


def test_small_payloads_never_meet_the_byte_bound() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    prefetch.claimed(30, 30 * 2_000)  # a drain of 2 KB payloads still reaches the cap
    size, _, _ = run_at_rate(prefetch, 20_000, 0.5)
    assert size == MAX_JOBS


def test_payloads_that_shrink_reopen_the_buffer_gradually() -> None:
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    prefetch.claimed(40, 40 * 1_000_000)
    prefetch.claimed(40, 40 * 100)  # one small claim among large ones
    assert prefetch.byte_cap <= 2 * BYTES_AHEAD // 1_000_000
    for _ in range(20):
        prefetch.claimed(40, 40 * 100)
    assert prefetch.byte_cap == MAX_JOBS


def test_a_lanes_own_prefetch_is_not_bounded_by_bytes() -> None:
    fixed = Prefetch(LaneConfig("l", concurrency=10, prefetch=200))
    fixed.claimed(200, 200 * 1_000_000)
    assert fixed.current(0, 100.0) == 200
    assert fixed.claim_bound() is None


def test_a_claim_the_database_bounded_sizes_the_next_ones_to_the_bound() -> None:
    # Payloads that compress 8 to 1 on disk: their text alone would allow 32 jobs of 1 MB
    # ahead, but a claim the database cut at the bound took 16 of them, so they hold about
    # STORED_BYTES_AHEAD / 16 each on disk, and the next claims ask for about 16.
    prefetch = Prefetch(LaneConfig("l", concurrency=10))
    assert prefetch.claim_bound() == STORED_BYTES_AHEAD
    prefetch.claimed(16, 16 * 1_000_000, bounded=True)
    assert prefetch.byte_cap == 16
    # Each claim within the bound halves the estimate: after two, the text binds.
    prefetch.claimed(16, 16 * 1_000_000)
    assert prefetch.byte_cap == 32
    prefetch.claimed(16, 16 * 1_000_000)
    assert prefetch.byte_cap == BYTES_AHEAD // 1_000_000
    # Payloads that shrink open the buffer again, to the cap.
    for _ in range(30):
        prefetch.claimed(40, 40 * 100)
    assert prefetch.byte_cap == MAX_JOBS
