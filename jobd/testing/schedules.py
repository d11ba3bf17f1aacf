"""``materialize_schedules``: one step of the daemon's schedule materializer, at the test's
clock.

The step is the materializer duty's (jobd.duties.materializer): declare the configured
schedules, then fire their due occurrences into jobs through the fire ledger. Both judge
time by the :class:`~jobd.testing.Clock`, so a test freezes the clock, advances it past an
occurrence, and finds the job, due at the occurrence, ready for ``run_jobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jobd import schedules
from jobd.config import Config, ScheduleConfig, check_schedules
from jobd.config import load as load_config
from jobd.testing.clock import Clock
from jobd.testing.session import Target, open_session
from jobd.validation import DEFAULT_MAX_PAYLOAD_BYTES

# The instance the declarations are made under. A test's declarations live as long as a
# test can take, whatever the clock is advanced by in between: each step declares again.
INSTANCE = "jobd.testing"
DECLARATION_TTL = 3600.0


@dataclass(frozen=True, slots=True)
class Fired:
    """An occurrence that became a job."""

    schedule_id: str
    occurrence: str
    job_id: int


def _schedules(given: Config | str | Path | Sequence[ScheduleConfig]
               ) -> tuple[list[ScheduleConfig], str | None]:
    """The schedules to declare, held to a config file's rules: a file is checked as it
    loads; a Config or ScheduleConfig values built in Python are checked here, as a file's
    schedules would be (ConfigError), rather than reaching the database unchecked."""
    if isinstance(given, str | Path):
        given = load_config(given)
    if isinstance(given, Config):
        return check_schedules(given.schedules, given.handlers,
                               given.max_payload_bytes or DEFAULT_MAX_PAYLOAD_BYTES
                               ), given.schema
    return check_schedules(given), None


def materialize_schedules(target: Target,
                          schedules_or_config: Config | str | Path | Sequence[ScheduleConfig],
                          *, clock: Clock | None = None,
                          schema: str | None = None) -> list[Fired]:
    """Declare the schedules (a config, a YAML path or ScheduleConfig values) and enqueue
    their occurrences that are due at ``clock`` (default: the database clock).

    A schedule declared for the first time starts at the clock's instant: it fires the
    occurrences after it, on a later call with the clock advanced past them (under its
    catch-up policy: ``latest``, the default, fires the newest missed one only).

    Schedules a config file did not check (ScheduleConfig values, a Config built in Python)
    pass a file's rules first: a value a file would refuse raises ConfigError naming the
    schedule and the key, before anything reaches the database.
    """
    configured, config_schema = _schedules(schedules_or_config)
    clock = clock or Clock()
    with open_session(target, schema or config_schema) as session, \
            session.jobd_statements() as conn:
        now = clock.parameter(conn)
        schedules.sync(conn, configured, INSTANCE, DECLARATION_TTL, now)
        result = schedules.tick(conn, now)
    return [Fired(*fired) for fired in result.enqueued]
