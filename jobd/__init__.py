"""jobd: a durable job scheduler whose queue is a PostgreSQL table."""

from jobd.handlers import transactional
from jobd.jobs import Job, JobSpec
from jobd.producer import enqueue, enqueue_many

__all__ = ["Job", "JobSpec", "enqueue", "enqueue_many", "transactional"]
__version__ = "0.1.0"
