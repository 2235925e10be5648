"""Stage versions booked at an update's dispatch and written at its end, as the runtime books them.

The threaded runtime bumps a stage's version when it *dispatches* the update to the stage's
home device (under the stage's lock); a reader that comes after gets that version, and its
kernel waits on its own device until the home device has computed it (algorithms.md §5).
On the clock an update is dispatched when its worker reaches it (``book``) and written
when its kernel ends (``write``, which opens the booking's ``Gate``). A read ahead of its
kernel (``pull``: a remote stage's, or, where a device runs several programs at once, every
read, taken at dispatch) gets the newest version booked; while that version is unwritten,
the reading kernel waits for it (``gates``: its ``Kernel.after``), and receives exactly its
weights, handed over when the version is written (``StageExecutor.fill_pull``).

Updates of a stage are written in booking order: a booking takes the stage's lock right
after it is booked (first come, first served) and keeps it until its write; ``reserve``
books and queues for the lock at once, for a writer that needs the lock only later (a
worker that books every update of its job at dispatch). A booked version's number is the
store's version plus the bookings ahead of it, so a write that was never booked (an
averaging's merge applied at an instant) only shifts the numbers of the pending ones; a
pull waiting across such a write gets the version its booking writes, numbered as written
(``StageExecutor.fill_pull``).
"""

from __future__ import annotations

import collections

from pdasgd_jax.executor import Job, StageExecutor
from pdasgd_jax.simulate.scheduler import Gate, Scheduler
from pdasgd_jax.simulate.version_executor import VersionExecutor, VersionStore
from pdasgd_jax.simulate.worker_requests import Channel, Get, Process, Put, Worker


class Booking(Gate):
    """One booked update of ``stage``, written when ``gate`` opens; ``pulls``: the jobs whose
    reads wait for its weights (None until the first); ``held``: for a ``reserve``d booking,
    the channel that gets the stage's lock once the bookings before it have released it
    (else None); ``number``: on a ``VersionStore``, the version number it was booked as
    (what its pulls read, unless a write that was never booked came between), else None.

    A booking is its own gate: thousands of updates may be booked and unwritten at once, and
    one object apiece (not two, nor an empty list) keeps what the clock touches per update small.
    """

    __slots__ = ("held", "number", "pulls", "stage")

    def __init__(self, stage: int, key: int):
        # ``Gate.__init__``'s fields, set here (one call fewer per update booked).
        self.key = key
        self.is_open = False
        self.devices = None
        self.stage = stage
        self.pulls: list[Job] | None = None
        self.held: Channel | None = None
        self.number: int | None = None

    @property
    def gate(self) -> Gate:
        """The gate its write opens (the booking itself)."""
        return self


class Bookings:
    """The booked, not yet written, updates of every stage of one store, in booking order."""

    def __init__(self, scheduler: Scheduler, executor: StageExecutor):
        self.scheduler = scheduler
        self.executor = executor
        self._open: list[collections.deque[Booking]] = [collections.deque() for _ in range(executor.store.num_stages)]
        # job id -> the booking (a gate, of its ``stage``) of each version it pulled that its
        # kernels have not waited for yet
        self._waits: dict[int, list[Booking]] = {}
        # A ``VersionStore``'s own list of stage versions (read at every pull), else None.
        store = executor.store
        self._versions: list[int] | None = store.versions if isinstance(store, VersionStore) else None
        # Whether a pull's fill only gives it the number of the version written (a
        # ``VersionExecutor``'s): then a write as booked, numbered as its pulls read it, has
        # nothing to fill, and its pulls (jobs long out of the processor's caches) go untouched.
        self._fills_number_only = isinstance(executor, VersionExecutor)

    def newest(self, m: int) -> int:
        """The newest version of stage ``m`` booked (the store's, when none is pending)."""
        if self._versions is not None:
            return self._versions[m] + len(self._open[m])
        return self.executor.store.read_params(m).version + len(self._open[m])

    def book(self, m: int, ticket: int | None) -> Booking:
        """Books the next version of stage ``m`` for an update dispatched with ``ticket``
        (None: now). Its gate's key is no earlier than the previous booking's: a version is
        written after the one it replaces."""
        key = self.scheduler.ticket() if ticket is None else ticket
        pending = self._open[m]
        if pending and pending[-1].key > key:
            key = pending[-1].key
        booking = Booking(m, key)
        pending.append(booking)
        if self._versions is not None:
            booking.number = self._versions[m] + len(pending)  # ``newest(m)``, inlined
        return booking

    def reserve(self, m: int, ticket: int | None, lock: Channel) -> Booking:
        """``book``, and a place in the queue of stage ``m``'s ``lock`` taken now: the
        booking's ``held`` gets the lock once every booking before it has released it, so a
        writer that books now and writes later (``yield Get(booking.held)``, then its write,
        then ``yield Put(lock, None)``) still writes in booking order."""
        booking = self.book(m, ticket)
        booking.held = Channel(1)
        self.scheduler.resume(Process(f"stage{m}/lock", _take(lock, booking.held)))
        return booking

    def write(self, booking: Booking) -> None:
        """The booked update was just written to the store: hands its weights to the pulls
        that wait for them and opens its gate."""
        pending = self._open[booking.stage]
        if pending[0] is not booking:
            raise RuntimeError(f"stage {booking.stage}: a write out of booking order")
        pending.popleft()
        m = booking.stage
        # Written as the number its pulls read (no unbooked write since it was booked, which
        # would have shifted it): their fills would change nothing (``_fills_number_only``).
        if booking.pulls is not None and not (self._fills_number_only and self._versions[m] == booking.number):
            fill = self.executor.fill_pull
            for job in booking.pulls:
                fill(job, m)
        self.scheduler.open(booking)

    def pull(self, job: Job, m: int, backward: bool = False, worker: str = "") -> None:
        """``StageExecutor.pull_stage`` of the newest version booked: when it is not written
        yet, the job's kernel on stage ``m`` waits for it (``gates``) and gets its weights then."""
        pending = self._open[m]
        if not pending:
            self.executor.pull_stage(job, m, backward=backward, worker=worker)
            return
        booking = pending[-1]
        versions = self._versions  # ``newest(m)``, inlined: most pulls of a busy stage find a booking
        newest = versions[m] + len(pending) if versions is not None else self.newest(m)
        self.executor.pull_stage(job, m, backward=backward, version=newest, worker=worker)
        if job.pulled[m] is not None:  # a stashed backward reads nothing
            if booking.pulls is None:
                booking.pulls = [job]
            else:
                booking.pulls.append(job)
            waits = self._waits.get(job.id)
            if waits is None:
                self._waits[job.id] = [booking]
            else:
                waits.append(booking)

    def gates(self, job: Job, stage: int | None = None) -> tuple[Gate, ...]:
        """The gates of the versions ``job`` pulled (of ``stage`` only, when given) that no
        kernel of it has waited for yet: its next kernel's ``after`` (the kernel that runs on
        them); forgets them."""
        waits = self._waits.pop(job.id, None)
        if waits is None:
            return ()
        if stage is not None:
            if rest := [booking for booking in waits if booking.stage != stage]:
                self._waits[job.id] = rest
            waits = [booking for booking in waits if booking.stage == stage]
        return tuple(waits)


def _take(lock: Channel, held: Channel) -> Worker:
    """Takes ``lock`` (in arrival order) and hands it over through ``held``."""
    yield Get(lock)
    yield Put(held, None)
