"""The pressure benchmark's verdict on claim reads under a held horizon (pure logic): a ramp
up to a plateau is bounded, reads that keep growing with the horizon's age are not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not installed

from bench.pressure_report import bounded


def timeline(values: list[float]) -> list[tuple[float, float]]:
    return [(5.0 * (i + 1), v) for i, v in enumerate(values)]


def test_a_ramp_to_a_plateau_is_bounded() -> None:
    # The shape of every held phase since the claim floors: the bounded scans fill up with
    # dead entries over the first half minute, then stay level.
    ramp = [12, 32, 58, 72, 80, 97]
    plateau = [147, 135, 118, 102, 117, 186, 151, 145, 140, 149, 205, 168, 155, 160, 191,
               177, 159, 142, 148, 128, 158, 166, 82, 143, 118, 90, 189, 94, 60, 61]
    ok, settled, last = bounded(timeline(ramp + plateau))
    assert ok is True
    assert settled > 100 and last < 2 * settled


def test_reads_that_grow_with_the_horizon_are_not() -> None:
    # Claims that scan from the head: every 5 s adds the dead entries of 5 s more.
    ok, settled, last = bounded(timeline([40.0 * i for i in range(1, 37)]))
    assert ok is False
    assert last > 2 * settled


def test_a_few_reads_a_claim_count_as_bounded_whatever_they_grew_from() -> None:
    ok, _, _ = bounded(timeline([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 4, 6, 8, 8, 9]))
    assert ok is True


def test_too_short_a_phase_gets_no_verdict() -> None:
    ok, _, _ = bounded(timeline([3, 90, 120, 140]))
    assert ok is None
