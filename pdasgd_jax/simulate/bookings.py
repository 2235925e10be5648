"""Stage versions booked at an update's dispatch and written at its end, as the runtime books them.

The threaded runtime bumps a stage's version when it *dispatches* the update to the stage's
home device (under the stage's lock); a reader that comes after gets that version, and its
kernel waits on its own device until the home device has computed it (algorithms.md §5).
On the clock an update is dispatched when its worker reaches it (``book``) and written
when its kernel ends (``write``, which opens the booking's ``Gate``). A pull of a remote
stage (``pull``) gets the newest version booked; while that version is unwritten, the
reading kernel waits for it (``gates``: its ``Kernel.after``), and receives exactly its
weights, handed over when the version is written (``StageExecutor.fill_pull``).

Updates of a stage are written in booking order: a booking takes the stage's lock right
after it is booked (first come, first served) and keeps it until its write. A booked
version's number is the store's version plus the bookings ahead of it, so a write that was
never booked (LPP-SGD's free averaging, applied at an instant on a one-device simulation,
where nothing is pulled) only shifts the numbers of the pending ones; a pull waiting across
such a write is refused (``StageExecutor.fill_pull``).
"""

from __future__ import annotations

import collections

from pdasgd_jax.executor import Job, StageExecutor
from pdasgd_jax.simulate.scheduler import Gate, Scheduler


class Booking:
    """One booked update of ``stage``, written when ``gate`` opens; ``pulls``: the jobs whose
    reads wait for its weights."""

    __slots__ = ("gate", "pulls", "stage")

    def __init__(self, stage: int, key: int):
        self.stage = stage
        self.gate = Gate(key)
        self.pulls: list[Job] = []


class Bookings:
    """The booked, not yet written, updates of every stage of one store, in booking order."""

    def __init__(self, scheduler: Scheduler, executor: StageExecutor):
        self.scheduler = scheduler
        self.executor = executor
        self._open: list[collections.deque[Booking]] = [collections.deque() for _ in range(executor.store.num_stages)]
        self._waits: dict[int, list[Gate]] = {}  # job id -> gates its next kernel waits for

    def newest(self, m: int) -> int:
        """The newest version of stage ``m`` booked (the store's, when none is pending)."""
        return self.executor.store.read_params(m).version + len(self._open[m])

    def book(self, m: int, ticket: int | None) -> Booking:
        """Books the next version of stage ``m`` for an update dispatched with ``ticket``
        (None: now). Its gate's key is no earlier than the previous booking's: a version is
        written after the one it replaces."""
        key = self.scheduler.ticket() if ticket is None else ticket
        pending = self._open[m]
        if pending:
            key = max(key, pending[-1].gate.key)
        booking = Booking(m, key)
        pending.append(booking)
        return booking

    def write(self, booking: Booking) -> None:
        """The booked update was just written to the store: hands its weights to the pulls
        that wait for them and opens its gate."""
        pending = self._open[booking.stage]
        if pending[0] is not booking:
            raise RuntimeError(f"stage {booking.stage}: a write out of booking order")
        pending.popleft()
        for job in booking.pulls:
            self.executor.fill_pull(job, booking.stage)
        self.scheduler.open(booking.gate)

    def pull(self, job: Job, m: int, *, backward: bool = False, worker: str = "") -> None:
        """``StageExecutor.pull_stage`` of the newest version booked: when it is not written
        yet, the job's next kernel waits for it (``gates``) and gets its weights then."""
        pending = self._open[m]
        if not pending:
            self.executor.pull_stage(job, m, backward=backward, worker=worker)
            return
        booking = pending[-1]
        self.executor.pull_stage(job, m, backward=backward, version=self.newest(m), worker=worker)
        if job.pulled[m] is not None:  # a stashed backward reads nothing
            booking.pulls.append(job)
            self._waits.setdefault(job.id, []).append(booking.gate)

    def gates(self, job: Job) -> tuple[Gate, ...]:
        """The gates of the versions ``job`` pulled and has not run a kernel on yet (its next
        kernel's ``after``); forgets them."""
        return tuple(self._waits.pop(job.id, ()))
