"""Structured logging: JSON lines when stderr is not a terminal, readable text when it is."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def configure(level: str = "info", **static: object) -> None:
    """Configure structlog for this process; ``static`` fields go into every event.

    Static fields (process role, worker id, pid) are added by a processor rather than bound
    in context variables, so events logged from handler threads carry them too.
    """

    def add_static(_logger: Any, _method: str, event: MutableMapping[str, Any]
                   ) -> MutableMapping[str, Any]:
        for key, value in static.items():
            event.setdefault(key, value)
        return event

    renderer: structlog.types.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_static,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per line: the supervisor and its workers share stderr, and two lines
        # written piecemeal by two processes would interleave.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
