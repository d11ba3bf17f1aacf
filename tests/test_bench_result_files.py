"""A benchmark run does not write over an earlier run's results of the same day."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not installed

from bench.result_files import free_stem


def test_the_first_run_of_a_day_takes_the_plain_name(tmp_path: Path) -> None:
    assert free_stem(tmp_path, "pressure-2026-12-05") == tmp_path / "pressure-2026-12-05"


def test_a_later_run_takes_the_next_free_number(tmp_path: Path) -> None:
    (tmp_path / "2026-12-05.json").write_text("{}")
    (tmp_path / "2026-12-05.chart.json").write_text("{}")
    assert free_stem(tmp_path, "2026-12-05") == tmp_path / "2026-12-05-2"
    (tmp_path / "2026-12-05-2.md").write_text("")
    assert free_stem(tmp_path, "2026-12-05") == tmp_path / "2026-12-05-3"


def test_a_longer_name_sharing_the_prefix_is_not_taken_for_it(tmp_path: Path) -> None:
    (tmp_path / "pressure-2026-12-05-quick.json").write_text("{}")
    assert free_stem(tmp_path, "pressure-2026-12-05") == tmp_path / "pressure-2026-12-05"
