"""Policy-free stage operations on a ``ParameterStore``, their event log, and replay.

An algorithm (PD-ASGD, its block variant, ASGD) is a *policy*: which worker runs which
operation of which job, and when. The operations themselves are the same everywhere:

* ``start_job``: take a batch;
* ``forward_stage(job, m)``: read the latest stage ``m`` (recording its version), run its
  forward, keep what the backward needs, write the new non-trainable state;
* ``pull_stage(job, m)``: read stage ``m`` ahead of its forward (or of a ``live``
  backward), for a worker that must first move it from its remote home: the version is the
  one current when the pull starts (on the simulator's clock: the newest booked, whose
  weights ``fill_pull`` hands over once written), and the later
  ``forward_stage``/``backward_stage`` runs on those weights;
* ``loss``: loss and ``delta_M``;
* ``backward_stage(job, m)``: ``(g_m, delta_{m-1})`` with ``stashed`` or ``live`` weights;
* ``update_stage(job, m)``: apply ``g_m`` to the store (a layer-wise partial update);
  staleness ``tau_m = version replaced - version read by the forward``, computed under the
  stage's lock and handed to the optimizer with the weights the forward read (optax extra
  arguments ``staleness`` and ``old_params``).

``forward_all`` and ``backward_all`` run a whole forward or backward, with fewer programs
when the executor is asked to fuse (``fuse_jobs`` for the simulator, ``fuse_forward`` for
the runtime), logging the same events. The simulator calls them in virtual-time order, the
runtime's threads call them concurrently; both can record an ``EventLog`` (typed
``Event``s of an ``EventKind``), and ``replay`` re-executes a log with the logged versions
and lands on the same parameters.

Each mode is one small class on the shared ``StageExecutor`` (``StageExecutor(...)`` picks
it): ``StashedExecutor``, ``LiveExecutor``, ``FusedJobExecutor``, ``FusedForwardExecutor``;
what a job's forward keeps for its backward is the mode's record (``StashedRecord``,
``LiveRecord``, ``ReadRecord``).

Modules: ``events`` (the event types, the log, staleness statistics), ``job`` (a job and
its records), ``stage_executor`` (the shared operations), ``stage_updates`` (the update
operations and their staleness), ``modes`` (the mode classes), ``replay``.
"""

from pdasgd_jax.executor.events import Event, EventKind, EventLog, ReplayDiverged, ReplicaLog, StalenessStats
from pdasgd_jax.executor.job import Job, LiveRecord, Pull, ReadRecord, StageRecord, StashedRecord
from pdasgd_jax.executor.modes import FusedForwardExecutor, FusedJobExecutor, LiveExecutor, StashedExecutor
from pdasgd_jax.executor.replay import JOB_KINDS, StoreReplay, forget_unread, in_seq_order, last_reads, replay
from pdasgd_jax.executor.stage_executor import BACKWARD_WEIGHTS, PyTree, StageExecutor

__all__ = [
    "BACKWARD_WEIGHTS",
    "JOB_KINDS",
    "Event",
    "EventKind",
    "EventLog",
    "FusedForwardExecutor",
    "FusedJobExecutor",
    "Job",
    "LiveExecutor",
    "LiveRecord",
    "Pull",
    "PyTree",
    "ReadRecord",
    "ReplayDiverged",
    "ReplicaLog",
    "StageExecutor",
    "StageRecord",
    "StalenessStats",
    "StashedExecutor",
    "StashedRecord",
    "StoreReplay",
    "forget_unread",
    "in_seq_order",
    "last_reads",
    "replay",
]
