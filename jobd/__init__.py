"""jobd: a durable job scheduler whose queue is a PostgreSQL table."""

from jobd.cancelling import cancel
from jobd.handlers import transactional
from jobd.jobs import Job, JobSpec
from jobd.pauses import pause, resume
from jobd.producer import enqueue, enqueue_many
from jobd.validation import JsonText

__all__ = ["Job", "JobSpec", "JsonText", "cancel", "enqueue", "enqueue_many", "pause", "resume",
           "transactional"]
__version__ = "0.2.0"
