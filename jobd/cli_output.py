"""How the ``jobd`` command line prints: JSON for ``--json``, aligned tables and one-line
values for people, and the time formats both use."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def print_json(data: object) -> None:
    print(json.dumps(data, default=_json_default, indent=2))


# C0 controls, DEL and C1 controls: what a terminal may take for a command. Text producers
# control (an error that quotes a payload, an idempotency key) could otherwise clear the
# screen, retitle the window or, with a carriage return, overwrite what the line said.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escaped(text: str) -> str:
    """``text`` with each control character written as its escape (\\x1b, \\r, \\t), on
    one line. ``--json`` needs none of this: JSON escapes them itself."""
    return _CONTROL.sub(lambda match: repr(match[0])[1:-1], text)


def json_escaped(text: str) -> str:
    """JSON text with each control character written as JSON's escape (\\u009b): still
    JSON, with the same value. (jsonb prints C0 controls escaped, but DEL and C1 as they
    are.)"""
    return _CONTROL.sub(lambda match: f"\\u{ord(match[0]):04x}", text)


def text_lines(text: str) -> list[str]:
    """The lines of a text, escaped. Only a newline (or CR LF) ends a line: a lone carriage
    return, a form feed or a NEL is shown as its escape, not taken for a line break."""
    return [escaped(line) for line in _NEWLINE.split(text)]


_NEWLINE = re.compile(r"\r?\n")


def one_line(text: str) -> str:
    """The first line of a text, escaped; "..." marks that more lines follow (tracebacks)."""
    lines = text_lines(text.strip())
    return lines[0] + (" ..." if len(lines) > 1 else "")


def field(value: object) -> str:
    """A value on one line, whole and escaped: jobs show's fields. (An error's text is
    shown by :func:`error_line` instead.)"""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return escaped(str(value))


def error_line(error: str | None) -> str:
    """An error's text as a field or cell shows it: its first line (a traceback's last
    words are in ``jobd jobs show --full-errors``)."""
    return "-" if error is None else one_line(error)


def cell(value: object) -> str:
    """A value in a table cell: escaped onto one line (a line break must not break the
    rows), at most 60 characters."""
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
