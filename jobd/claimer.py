"""The claim side of a worker: what to claim and when, the buffer of jobs claimed ahead of
free slots (the lane's ``prefetch``), and the rules for suspects. Decisions only: the
worker's loop does the round trips.

- A worker claims up to ``concurrency + prefetch`` jobs and tops its buffer up once it is
  half empty, so claims come in batches while handlers see ``concurrency`` jobs at a time.
  Unless the lane sets ``prefetch`` (or is limited), the size follows how fast the worker
  starts jobs (``jobd.prefetch``): from 3 x concurrency for slow jobs to 500 jobs
  for jobs that take microseconds, and at most 32 MB of payload beyond one refill of the
  slots, learned from each claim's payloads; a fair or age-promoting lane holds a tenth as
  much work. A plain or rate-limited lane's claim also carries the byte bound (8 MB of
  payload on disk in all, but never fewer jobs than start at once): the database stops
  taking jobs there, so the claim that first meets large payloads is bounded too. The same
  claim takes a job on its last attempt only into a free slot (a whole node's death would
  spend that attempt unrun: docs/design/queue.md). A claim cut short is not dry; neither is
  an empty claim ahead of full slots, after which the worker claims again once a job can
  start at once.
- Buffered jobs (``jobd.claim_buffer``) go back to the queue when the worker stops taking
  work (a drain, a retirement, a suspect to run alone) and after ``BUFFER_MAX_AGE``
  unstarted; a buffer given back for its age is not claimed back until a slot frees.
- A suspect (see ``recovery.settle_crashed_worker``) runs alone: it is asked for only by a
  worker that holds nothing, and nothing else is claimed while it runs.
- Claims start at the worker's floors (``jobd.claim_floors``), not at the head of the lane;
  a step of the database's clock (``jobd.clock_watch``) sends the next one to the head.
- Wake-ups (``jobd.arming``): a worker whose claim came back short arms itself
  (``queue.arm``): enqueues notify only while some worker is armed. An enqueue in flight at
  that moment makes the arming 'contended': the worker claims again shortly instead of
  sleeping. A woken worker stays armed while its claims come back short; the claim after a
  full one disarms it.
- Pauses (``jobd.pause``): a worker of a paused lane claims nothing and does not arm; the
  buffered jobs of a paused lane or handler go back to the queue unstarted. The claim itself
  skips paused work, so this is what the worker knows, not what decides (see
  :meth:`Claimer.set_controls`).
- Handlers the node does not have (``jobd.handler_filter``): their jobs go back unstarted,
  their attempt returned, and the claims step over them as over a paused handler's.
- Limits (``max_running``, ``rate``): the claim takes its turn and is capped by the lane's
  budget across nodes (``claim_jobs_limited``). A short claim may then mean "no budget" as
  well as "nothing due", so it does not mark the lane dry; with due work left, the worker's
  arming answers 'work' and it claims again after ``arming.RETRY_DELAYS``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import structlog

from jobd import claim_floors, jobs, queue
from jobd.arming import Arming
from jobd.claim_buffer import ClaimBuffer, Entry, any_to_give_back
from jobd.claim_floors import ClaimFloors
from jobd.clock_watch import ClockWatch
from jobd.config import LaneConfig
from jobd.handler_filter import HandlerFilter
from jobd.key_positions import next_key_cursor
from jobd.prefetch import Prefetch
from jobd.protocol import WorkerMode

log = structlog.get_logger("jobd.claimer")


class Claimer:
    def __init__(self, lane: LaneConfig, worker_id: str,
                 known_handlers: frozenset[str] | None = None) -> None:
        self.lane = lane
        self.worker_id = worker_id
        self.handlers = HandlerFilter(lane.name, known_handlers)
        self.maybe_more = True  # there may be due work: claim when capacity allows
        self.buffer = ClaimBuffer()
        # Jobs taken out of the buffer to be given back, until a release's answer says what
        # became of them: a release whose answer was lost may have committed, so they must
        # never start here, and the release is sent again (fenced, so it applies once).
        self.releasing: list[jobs.Job] = []
        # Whether a suspect may be due in the lane: a new worker looks once; the supervisor
        # says so again (a SUSPECTS byte) when it makes some or one falls due.
        self.suspects_possible = True
        self.isolating: int | None = None  # the suspect this worker runs alone
        self.held_back = False  # the buffer went back for its age; no claim until a slot frees
        # A claim ahead of full slots came back empty: the next one waits until a job can
        # start at once (a job on its last attempt may head the lane, see took()).
        self.ahead_came_back_empty = False
        self.floors = ClaimFloors()
        self.clock = ClockWatch()
        self.arming = Arming()
        # The share key this worker's last fair claim ended at: the next one starts after it
        # (claim_order), so the keys of a lane with more keys than a claim takes rotate.
        self.key_cursor: str | None = None
        self.lane_paused = False  # the whole lane is paused (lane_pauses)
        self.prefetch = Prefetch(lane)
        self.buffer_target = self.prefetch.floor  # the size the last claim was made for

    @property
    def capacity(self) -> int:
        """All the worker holds at most now: its slots and the buffer it claims for."""
        return self.lane.concurrency + self.buffer_target

    def set_controls(self, lane_paused: bool, paused_handlers: frozenset[str]) -> bool:
        """The lane's pauses as the database has them now. Returns whether something was
        resumed: the worker then claims again, from the head of the lane, where the jobs
        it stepped over while they were paused wait."""
        handler_resumed = self.handlers.set_paused(paused_handlers)
        resumed = (self.lane_paused and not lane_paused) or handler_resumed
        self.lane_paused = lane_paused
        if resumed:
            self.maybe_more = True
            self.floors.forget()
        return resumed

    def request(self, mode: WorkerMode, running: int) -> queue.ClaimRequest | None:
        """What to claim now, given ``running`` jobs in the slots, or None."""
        if (mode != WorkerMode.RUNNING or not self.maybe_more or self.isolating is not None
                or self.lane_paused):
            return None
        if self.held_back and running >= self.lane.concurrency:
            return None
        if self.ahead_came_back_empty and running + len(self.buffer) >= self.lane.concurrency:
            return None
        if self.suspects_possible and (running or self.buffer):
            # A suspect is due and runs only on a worker that holds nothing: claim nothing
            # more until the jobs in flight are done (the buffer goes back to the queue), so
            # it cannot wait behind a busy lane.
            return None
        prefetch = self.buffer_target = self.prefetch.current(self.buffer.started,
                                                              time.monotonic())
        free = self.lane.concurrency + prefetch - running - len(self.buffer)
        if free <= 0 or len(self.buffer) > prefetch // 2:
            return None
        # The jobs that start at once (the buffer's start first): never held back by the
        # byte bound, and the only ones that may be on their last attempt.
        starting = max(0, min(free, self.lane.concurrency - running - len(self.buffer)))
        least = max(1, min(free, self.lane.concurrency - running))
        return queue.ClaimRequest(self.lane.name, self.worker_id,
                                  self.prefetch.claim_limit(free, least),
                                  self.lane.visibility_timeout,
                                  suspect_first=self.suspects_possible and not running,
                                  floors=self.floors.params(time.monotonic()),
                                  # A limited lane's worker disarms at every claim: a
                                  # short claim there may mean "no budget" as well as
                                  # "nothing due", so it must not sleep with due work,
                                  # and arms again to learn which.
                                  disarm=self.arming.armed and (self.arming.disarm_due
                                                                or self.lane.limited),
                                  budget=self.lane.budget() if self.lane.limited else None,
                                  order=(self.lane.claim_order(self.key_cursor)
                                         if self.lane.ordered else None),
                                  lacking_handlers=self.handlers.lacking,
                                  # claim_jobs_ordered has none (docs/design/daemon.md)
                                  payload_bytes=(None if self.lane.ordered
                                                 else self.prefetch.claim_bound()),
                                  least=least, starting=starting,
                                  lane_max_attempts=self.lane.max_attempts)

    def took(self, claimed: queue.Claimed, request: queue.ClaimRequest,
             slots_free: bool = False, sent_at: float | None = None) -> list[jobs.Job]:
        """Record what a claim brought; returns the jobs to start at once (a suspect).
        ``slots_free``: the slots had room when it came back (jobs on deck fill them too).
        ``sent_at``: the monotonic instant the claim was sent (default: now, as if it took
        no time)."""
        if request.suspect_first and claimed.suspect is None:
            self.suspects_possible = False  # none due now; the supervisor says when again
        now = time.monotonic()
        self.handlers.learn(claimed)
        if request.disarm:
            self.arming.disarmed()
        assert request.floors is not None
        taken = [(job.priority, job.run_at, job.id) for job in claimed.jobs]
        fair = self.lane.fair_by != "none"
        # Capped by the budget or cut (the byte bound, the last attempts), a short claim is
        # not dry: the positions hold, the rest of the lane waits. So is an empty claim ahead
        # of full slots: a job on its last attempt may head the lane (a cut claim that took
        # nothing returns no row to say so), and the worker claims again once a slot frees.
        ahead_only = request.starting == 0 and not claimed.jobs and claimed.suspect is None
        short_not_dry = request.budget is not None or claimed.bounded or ahead_only
        limit = len(taken) if short_not_dry else request.limit
        self.floors.claimed(request.floors, taken, limit, now, sent_at=sent_at, fair=fair,
                            aged=self.lane.max_wait is not None)
        if fair and claimed.jobs:
            self.key_cursor = next_key_cursor(self.key_cursor, claimed.jobs,
                                              self._overdue_before(claimed.jobs[0], request))
            self.floors.keys.claimed([(job.priority, job.fairness_key or job.handler,
                                       job.run_at, job.id) for job in claimed.jobs], limit)
        # A suspect runs alone; once it is done the worker is idle and asks for the next.
        self._watch_clock(claimed, request, now if sent_at is None else sent_at, now)
        self.maybe_more = (len(claimed.jobs) == request.limit or claimed.bounded
                           or claimed.suspect is not None or ahead_only)
        self.ahead_came_back_empty = ahead_only
        if claimed.jobs:
            # Once per claim: a len() of each row's payload text (about 0.03 us a job).
            self.prefetch.claimed(len(claimed.jobs), jobs.payload_chars(claimed.jobs),
                                  claimed.bytes_bounded)
        if slots_free and not self.buffer and len(claimed.jobs) == request.limit:
            # Full, and the worker had nothing left to start: it ran dry.
            self.prefetch.ran_dry(now)
        if self.arming.armed and self.maybe_more:
            self.arming.disarm_due = True  # it has work: the next claim removes its row
        elif self.arming.armed:
            # Its claim looked past the floors as a probe would: it looks once more when
            # that probe would have.
            self.arming.stay_armed(self.floors.recheck_at(claim_floors.kind(request.floors),
                                                          now))
        self.arming.claimed(bool(claimed.jobs) or claimed.suspect is not None,
                            self.maybe_more, now)
        if claimed.suspect is not None and self.handlers.runs_here(claimed.suspect.handler):
            self.isolating = claimed.suspect.id
            log.info("running a suspect alone", job_id=claimed.suspect.id,
                     handler=claimed.suspect.handler)
            return [claimed.suspect]
        if claimed.suspect is not None:
            # Not runnable here: it goes back (to_release) and stays a suspect.
            self.buffer.append((claimed.suspect, now))
        self.buffer.add(claimed.jobs, now)
        return []

    def _overdue_before(self, job: jobs.Job, request: queue.ClaimRequest) -> datetime | None:
        """Where the claim's overdue pass ended (claim_order's overdue_before): its clock is
        the one that set the leases."""
        if self.lane.max_wait is None:
            return None
        claimed_at = job.lease_until - timedelta(seconds=request.visibility_timeout)
        return claimed_at - timedelta(seconds=self.lane.max_wait)

    def _watch_clock(self, claimed: queue.Claimed, request: queue.ClaimRequest,
                     sent_at: float, answered_at: float) -> None:
        step = self.clock.step_at_claim(claimed, request.visibility_timeout, sent_at,
                                        answered_at)
        if step is not None:
            self.floors.forget()
            log.warning("the database's clock stepped; claims scan from the head of the lane",
                        lane=self.lane.name, step_seconds=round(step, 3))

    # --- wake-ups (jobd.arming) --------------------------------------------------------------

    def try_due(self, now: float) -> bool:
        """A LINGER or retry claim is due: claim if capacity allows."""
        if self.arming.due(now):
            self.maybe_more = True
            return True
        return False

    def wants_arm(self, mode: WorkerMode, now: float) -> bool:
        if (mode != WorkerMode.RUNNING or self.isolating is not None or self.maybe_more
                or self.lane_paused):
            return False
        return self.arming.wants(now)

    def arm_result(self, result: str, now: float, probe: str) -> None:
        """What arming answered: sleep until woken, or claim again (now or shortly), or wait
        unarmed for the lane's resume ('paused': the worker looks at the lane's pauses).
        ``probe``: the kind of floors its probe for work used (``claim_floors.kind``)."""
        if result == "paused":
            self.lane_paused = True
            self.arming.paused()
        elif result == "armed":
            self.arming.armed_now(now, self.floors.recheck_at(probe, now))
        else:
            self.arming.claim_again(result, now)

    def next_to_start(self, mode: WorkerMode, running: int,
                      room: int | None = None) -> Entry | None:
        """The next buffered job to hand to the handlers and when it was claimed, given
        ``running`` handed over already and ``room`` for them (the lane's concurrency unless
        jobs may wait on deck: ``jobd.slots``), or None."""
        room = self.lane.concurrency if room is None else room
        buffer = self.buffer
        if (not buffer or running >= room or mode != WorkerMode.RUNNING
                or self.isolating is not None or self.lane_paused):
            return None
        runs_here = self.handlers.filter
        if runs_here is not None:
            return buffer.pop_next(runs_here)
        buffer.started += 1  # once per job: the common case without a call
        return buffer.popleft()

    def to_release(self, mode: WorkerMode, now: float) -> list[jobs.Job]:
        """Buffered jobs to give back now."""
        if self._releases_all(mode):
            return [job for job, _claimed in self.buffer]
        return self.buffer.to_give_back(now, self.handlers.filter)

    def would_release(self, mode: WorkerMode, entries: list[Entry], now: float) -> bool:
        """Whether :meth:`to_release` would give back any of ``entries`` (jobs on deck)
        were they in the buffer."""
        return bool(entries) and (self._releases_all(mode)
                                  or any_to_give_back(entries, now, self.handlers.filter))

    def _releases_all(self, mode: WorkerMode) -> bool:
        return mode != WorkerMode.RUNNING or self.suspects_possible or self.lane_paused

    def giving_back(self, leaving: list[jobs.Job]) -> None:
        """Take ``leaving`` out of the buffer before their release is sent: from then on no
        slot may start them, whatever becomes of the release (see ``releasing``)."""
        self.buffer.drop({job.id for job in leaving})
        self.releasing.extend(leaving)

    def released(self, mode: WorkerMode, ids: set[int]) -> None:
        """A release's answer came: the jobs ``ids`` are no longer this worker's to give
        back (given back, gone, or to be finished as cancelled)."""
        self.held_back = mode == WorkerMode.RUNNING and not self.suspects_possible
        self.floors.forget()  # they keep their run_at, below this worker's floors
        self.buffer.drop(ids)
        self.releasing = [job for job in self.releasing if job.id not in ids]

    def finished(self, job_id: int) -> None:
        """A job left its slot (done, or failed for its timeout)."""
        self.held_back = False
        if self.isolating == job_id:
            self.isolating = None
