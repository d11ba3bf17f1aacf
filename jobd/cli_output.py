"""How the ``jobd`` command line prints: JSON for ``--json``, aligned tables and one-line
values for people, and the time formats both use."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def print_json(data: object) -> None:
    print(json.dumps(data, default=_json_default, indent=2))


def one_line(text: str) -> str:
    """The first line of a text; "..." marks that more lines follow (tracebacks)."""
    lines = text.strip().splitlines()
    if not lines:
        return ""
    return lines[0] + (" ..." if len(lines) > 1 else "")


def field(value: object) -> str:
    """A value on one line: jobs show's fields."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return one_line(str(value))


def cell(value: object) -> str:
    """A value in a table cell: one line (a traceback must not break the rows), at most 60
    characters."""
    text = field(value)
    return text if len(text) <= 60 else text[:57] + "..."


def local_time(value: object) -> str:
    """A local time with its UTC offset, e.g. 2026-03-29 03:00 +02:00."""
    if not isinstance(value, datetime):
        return cell(value)
    return value.strftime("%Y-%m-%d %H:%M:%S %z")[:-2] + ":" + value.strftime("%z")[-2:]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], empty: str) -> None:
    if not rows:
        print(f"({empty})")
        return
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def seconds(value: float | None) -> str:
    """A duration in a few characters, as `jobd status` and `jobd top` print them: 850us,
    12ms, 4.2s, 3m12s, 2h05m, 3d04h."""
    if value is None:
        return "-"
    if value < 0.001:
        return f"{value * 1e6:.0f}us"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 60:
        return f"{value:.1f}s"
    whole = int(value)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
