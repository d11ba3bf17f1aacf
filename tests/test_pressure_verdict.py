"""The pressure benchmark's verdicts (pure logic): on claim reads under a held horizon, a ramp
up to a plateau is bounded, reads that keep growing with the horizon's age are not; the
overload's backlog drain is judged against the clean drain, the same-size drain beside it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not installed

from bench.pressure_report import bounded, verdicts


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


def overload_results(backlog_per_s: float, **extra: Any) -> dict[str, dict[str, Any]]:
    phases = [
        {"phase": "overload", "offered_per_s": 60_000.0, "done_per_s": 20_000.0,
         "backlog_end": 500_000},
        {"phase": "backlog", "seconds": 12.0, "done_per_s": backlog_per_s},
    ]
    return {"overload": {"phases": phases, "check": {"ok": True},
                         "extra": {"clean_drain_per_s": 50_000.0, **extra}}}


def overload_verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return next(v for v in verdicts(results, 400.0) if v["target"].startswith(
        "overload: backlog drains"))


def test_a_backlog_drain_slower_than_the_clean_drain_is_not_met() -> None:
    found = overload_verdict(overload_results(41_000.0))
    assert found["met"] is False
    assert "same" not in found["figures"]


def test_the_same_size_drain_is_reported_beside_the_verdict() -> None:
    results = overload_results(52_000.0, same_size_drain_per_s=43_210.0,
                               same_size_drain_jobs=500_000)
    found = overload_verdict(results)
    assert found["met"] is True
    assert "same 500,000 jobs after the recovery: 43,210/s" in found["figures"]


def test_the_drain_beside_the_standing_load_is_reported_and_judges_nothing() -> None:
    results = overload_results(41_000.0, loaded_drain_per_s=40_500.0,
                               same_size_drain_per_s=43_210.0, same_size_drain_jobs=500_000)
    found = overload_verdict(results)
    assert found["met"] is False  # still judged against the clean drain without a producer
    assert "beside the producer's standing load: 40,500/s; a drain of the same" in found["figures"]


def test_server_settings_on_the_command_line(capsys: Any) -> None:
    from bench.pressure import parse_args

    args = parse_args(["--server-setting", "shared_buffers=4GB",
                       "--server-setting", "max_wal_size=8GB"])
    assert dict(args.server_settings) == {"shared_buffers": "4GB", "max_wal_size": "8GB"}
    assert parse_args([]).server_settings == []
    for wrong in ("shared_buffers", "=4GB", "shared_buffers=", "shared buffers=4GB",
                  "work_mem=4 MB", "search_path='a'"):
        with pytest.raises(SystemExit) as exited:
            parse_args(["--server-setting", wrong])
        assert exited.value.code == 2
        assert "expected NAME=VALUE" in capsys.readouterr().err
