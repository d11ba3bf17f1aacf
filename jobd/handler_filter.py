"""Which handlers' jobs a worker starts now: not a paused handler's (``jobd pause``, which
the worker learns from the database: ``jobd.worker_controls``), and not one this node does
not have. Pure logic over what the claims brought.

Nodes of one lane may load different handlers: a rolling deploy that adds one, a second
node's own config. A job of a handler this worker does not have is given back unstarted,
its attempt returned, and from then on the worker's claims and arming probe step over that
handler's jobs as over a paused handler's (``queue.ClaimRequest.lacking_handlers``): they
wait for a node that has it. Each such handler is logged once.
"""

from __future__ import annotations

import structlog

from jobd import queue
from jobd.claim_buffer import RunsHere

log = structlog.get_logger("jobd.claimer")


class HandlerFilter:
    def __init__(self, lane: str, known: frozenset[str] | None) -> None:
        self.lane = lane
        # The handlers this worker can run (None: any), and those of claimed jobs it could
        # not, in the order it met them.
        self.known = known
        self.lacking: tuple[str, ...] = ()
        self.paused: frozenset[str] = frozenset()
        # runs_here while some handler does not run here, else None: the buffer's common
        # case then skips the call per job (claim_buffer.RunsHere).
        self.filter: RunsHere = None

    def runs_here(self, handler: str) -> bool:
        """Whether this worker starts jobs of ``handler`` now: it has the handler, and the
        handler is not paused."""
        return handler not in self.paused and handler not in self.lacking

    def set_paused(self, paused: frozenset[str]) -> bool:
        """The lane's paused handlers as the database has them now. Returns whether one of
        those paused before was resumed."""
        resumed = not paused >= self.paused
        self.paused = paused
        self._refilter()
        return resumed

    def learn(self, claimed: queue.Claimed) -> None:
        """Note the handlers of claimed jobs this worker does not have."""
        if self.known is None:
            return
        handlers = {job.handler for job in claimed.jobs}
        if claimed.suspect is not None:
            handlers.add(claimed.suspect.handler)
        unknown = handlers - self.known
        if not unknown:
            return  # every claim: the common case costs one set
        taken = [*claimed.jobs, *([claimed.suspect] if claimed.suspect else [])]
        for handler in sorted(unknown.difference(self.lacking)):
            self.lacking += (handler,)
            log.warning("this node has no such handler: its jobs are given back for the "
                        "nodes that have it, and this worker no longer claims them",
                        lane=self.lane, handler=handler,
                        job_id=next(job.id for job in taken if job.handler == handler),
                        known_handlers=sorted(self.known))
        self._refilter()

    def _refilter(self) -> None:
        self.filter = self.runs_here if self.paused or self.lacking else None
