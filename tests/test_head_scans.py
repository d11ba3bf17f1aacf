"""When the lane poll and the lease sweep read their index from the head (jobd/head_scans.py):
pure rules, no database."""

from __future__ import annotations

from jobd.claim_floors import LOOK_BACK, MAX_FULL_SCAN_INTERVAL
from jobd.head_scans import DUTY_HEAD_SCAN_SHARE, LOOK_BACK_MARGIN, HeadScans


def test_the_first_run_and_every_run_after_a_quick_one_read_from_the_head() -> None:
    scans = HeadScans()
    assert scans.look_back(100.0) is None
    scans.ran(100.0, None, 0.0005)  # a clean index: half a millisecond
    assert scans.look_back(101.0) is None


def test_a_slow_read_from_the_head_spaces_the_next_and_the_runs_between_look_back() -> None:
    scans = HeadScans()
    scans.ran(100.0, None, 0.010)  # 10 ms: the next read from the head 20 s later
    spacing = 0.010 / DUTY_HEAD_SCAN_SHARE
    assert scans.look_back(105.0) == LOOK_BACK
    scans.ran(105.0, LOOK_BACK, 0.001)
    assert scans.look_back(110.0) == LOOK_BACK
    assert scans.look_back(100.0 + spacing) is None


def test_the_spacing_stops_at_its_cap() -> None:
    scans = HeadScans()
    scans.ran(0.0, None, 10.0)
    assert scans.look_back(MAX_FULL_SCAN_INTERVAL - 1) is not None
    assert scans.look_back(MAX_FULL_SCAN_INTERVAL) is None


def test_the_look_back_covers_the_whole_gap_since_the_last_run() -> None:
    # A duty that runs every 30 s (or was held up) must overlap its previous run.
    scans = HeadScans()
    scans.ran(0.0, None, 1.0)  # spaced to the cap
    assert scans.look_back(30.0) == 30.0 + LOOK_BACK_MARGIN


def test_a_run_long_after_the_last_reads_from_the_head() -> None:
    scans = HeadScans()
    scans.ran(0.0, None, 1.0)
    scans.ran(50.0, LOOK_BACK, 0.001)
    scans.next_from_head = 1e9  # as if still spaced out: a stopped process wakes up
    assert scans.look_back(50.0 + MAX_FULL_SCAN_INTERVAL + 1) is None


def test_a_run_that_stopped_at_its_row_limit_reads_from_the_head_next() -> None:
    scans = HeadScans()
    scans.ran(0.0, None, 1.0)
    scans.ran(5.0, LOOK_BACK, 0.001, complete=False)
    assert scans.look_back(6.0) is None
