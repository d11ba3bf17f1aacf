"""Example handlers used by config/jobd.example.yaml (and handy for trying jobd out)."""

from __future__ import annotations

import time

import structlog

from jobd.queue import Job

log = structlog.get_logger("jobd.examples")


def echo(job: Job) -> None:
    """Logs the job's id and payload keys, and succeeds."""
    log.info("echo", job_id=job.id, attempt=job.attempt, keys=sorted(job.payload or {}))


def sleep(job: Job) -> None:
    """Sleeps ``payload["seconds"]`` (default 1) seconds, then succeeds."""
    time.sleep(float((job.payload or {}).get("seconds", 1)))


def fail(job: Job) -> None:
    """Fails every attempt: watch it back off and land in the dead-letter queue."""
    raise RuntimeError(f"example failure on attempt {job.attempt}")
