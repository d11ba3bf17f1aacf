"""Where a benchmark writes its results: ``bench/results/<name>.json`` and its siblings, named by
the day. A second run on the same day gets ``<name>-2`` (then ``-3``...) instead of writing over
the first, whose figures docs/performance.md may already quote."""

from __future__ import annotations

from pathlib import Path


def free_stem(directory: Path, name: str) -> Path:
    """``directory / name``, or with the first ``-N`` suffix (N >= 2) no result file of that
    stem has yet (any extension: ``.json``, ``.md``, ``.png``...)."""
    stem = directory / name
    number = 1
    while any(directory.glob(f"{stem.name}.*")):
        number += 1
        stem = directory / f"{name}-{number}"
    return stem
