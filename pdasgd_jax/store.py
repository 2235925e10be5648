"""A versioned per-stage parameter store shared by the simulator and the threaded runtime.

Each stage holds two ``VersionedSlot``s: its trainable parameters together with their
optimizer state, and its non-trainable state (BatchNorm statistics). A slot's value and
version travel together in one immutable tuple, so a read is a single reference load
(no lock: readers never block writers), and a write is an atomic read-modify-write under
that slot's own lock, so no update is ever lost and stages never wait for each other.
Old versions can be kept for replay; JAX arrays are immutable, so keeping a version is
only keeping a reference.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import jax

T = TypeVar("T")
PyTree = Any


def place(tree: PyTree, device: jax.Device | None) -> PyTree:
    """``tree`` on ``device`` (``None``: where it is), without a copy or a ``device_put`` call
    when every leaf is already a JAX array there: on a one-device run ``device_put``'s own
    per-call cost can be the largest part of a small stage's operation."""
    if device is None:
        return tree
    leaves = jax.tree.leaves(tree)
    # Committed only: jit compiles once per pattern of committed/uncommitted arguments, so
    # letting uncommitted arrays through would add recompilations mid-run.
    if all(isinstance(leaf, jax.Array) and leaf.committed and leaf.devices() == {device} for leaf in leaves):
        return tree
    return jax.device_put(tree, device)


class Versioned(NamedTuple, Generic[T]):
    value: T
    version: int


class VersionedSlot(Generic[T]):
    """One value with a version counter; lock-free reads, atomic updates, optional history."""

    def __init__(self, value: T, *, keep_history: bool = False):
        self._current = Versioned(value, 0)
        self._lock = threading.Lock()
        self._history: dict[int, T] | None = {0: value} if keep_history else None

    def read(self) -> Versioned[T]:
        return self._current

    def update(
        self, fn: Callable[..., T], on_commit: Callable[[int], None] | None = None, *, spread: bool = False
    ) -> int:
        """Replaces the value by ``fn(value, version)`` atomically; returns the version it replaced.

        ``fn`` sees the version it replaces, so whatever it derives from it (an update's
        staleness) is exact even when threads race for the slot. ``spread``: the value is a
        tuple, which ``fn`` takes item by item (``fn(*value, version)``), as a stage's
        ``(params, opt_state)`` slot hands them to an update's step.

        ``on_commit(version_before)`` runs inside the lock and before the new version is
        visible, so whatever it records (an event sequence number) is ordered exactly like
        the updates themselves and ahead of every read that sees the new version.
        """
        with self._lock:
            before = self._current
            value = fn(*before.value, before.version) if spread else fn(before.value, before.version)
            self._publish(value, on_commit)
            return before.version

    def _publish(self, value: T, on_commit: Callable[[int], None] | None) -> None:
        """Makes ``value`` the next version; the caller holds the lock."""
        before = self._current
        new = Versioned(value, before.version + 1)
        if self._history is not None:
            self._history[new.version] = new.value
        # Record before publishing: a reader that sees the new version must find its
        # update already in the log, or replay would order the read before the write.
        if on_commit is not None:
            on_commit(before.version)
        self._current = new

    def load(self, value: T) -> None:
        """Replaces the current value, keeping its version (restoring a checkpointed value)."""
        with self._lock:
            version = self._current.version
            if self._history is not None:
                self._history[version] = value
            self._current = Versioned(value, version)

    def forget(self, version: int) -> None:
        """Drops an old ``version`` from the history (a replay that knows nothing reads it again)."""
        if self._history is not None and version != self._current.version:
            self._history.pop(version, None)

    def at(self, version: int) -> T:
        """The value at ``version`` (history must be kept)."""
        if self._history is None:
            raise RuntimeError("this slot keeps no history; create the store with keep_history=True")
        return self._history[version]


class StageSlots(NamedTuple):
    params: VersionedSlot  # value: (params_m, opt_state_m)
    state: VersionedSlot  # value: non-trainable state_m


class ParameterStore:
    """Per-stage versioned parameters, optimizer states and non-trainable states.

    Args:
      params, states, opt_states: per-stage trees (tuples of length M).
      update: ``update(m, params_m, opt_state_m, grads_m, staleness, old_params_m) ->
        (params_m, opt_state_m)``, typically ``StageKernels.apply_update``: ``staleness`` is
        the update's ``tau_m`` and ``old_params_m`` the weights its gradient was computed at
        (what ``optim.staleness_aware`` and ``optim.delay_compensated`` need). Kept as the
        public ``update_rule``, which a resuming simulation swaps (an abstract rule while it
        replays its schedule).
      home_devices: optional device per stage; parameters live there and gradients are
        moved there before the update (``replication="shared"``).
      keep_history: keep every version (for replay and tests).
    """

    def __init__(
        self,
        params: Sequence[PyTree],
        states: Sequence[PyTree],
        opt_states: Sequence[PyTree],
        update: Callable[[int, PyTree, PyTree, PyTree], tuple[PyTree, PyTree]],
        *,
        home_devices: Sequence[jax.Device] | None = None,
        keep_history: bool = False,
    ):
        if not len(params) == len(states) == len(opt_states):
            raise ValueError(f"got {len(params)} params, {len(states)} states, {len(opt_states)} optimizer states")
        self.home_devices = tuple(home_devices) if home_devices is not None else None
        if self.home_devices is not None and len(self.home_devices) != len(params):
            raise ValueError(f"got {len(self.home_devices)} home devices for {len(params)} stages")
        self.update_rule = update
        self.slots = tuple(
            StageSlots(
                VersionedSlot(self._home(m, (p, o)), keep_history=keep_history),
                VersionedSlot(self._home(m, s), keep_history=keep_history),
            )
            for m, (p, s, o) in enumerate(zip(params, states, opt_states))
        )

    @property
    def num_stages(self) -> int:
        return len(self.slots)

    def _home(self, m: int, tree: PyTree) -> PyTree:
        return tree if self.home_devices is None else place(tree, self.home_devices[m])

    def read_params(self, m: int) -> Versioned:
        """Latest ``((params_m, opt_state_m), version)`` of stage ``m``, without locking."""
        return self.slots[m].params.read()

    def apply_gradient(
        self,
        m: int,
        grads: PyTree,
        on_commit: Callable[[int], None] | None = None,
        *,
        read_version: int | None = None,
        read_params: PyTree | None = None,
    ) -> int:
        """Applies one optimizer step to stage ``m`` atomically; returns the version it replaced.

        Args:
          read_version: the version the gradient's forward read; the update's staleness
            ``tau_m = replaced - read_version`` is computed under the stage's lock (None: 0).
          read_params: the parameters that forward read, for the optimizer's ``old_params``
            (None: the current ones).
        """
        return self.update_with(
            m, self.gradient_step(m, grads, read_version=read_version, read_params=read_params), on_commit
        )

    def gradient_step(
        self, m: int, grads: PyTree, *, read_version: int | None = None, read_params: PyTree | None = None
    ) -> Callable[[PyTree, PyTree, int], tuple[PyTree, PyTree]]:
        """The ``step`` that ``apply_gradient`` hands to ``update_with`` (arguments as there):
        ``grads`` and ``read_params`` moved to the stage's home device, then ``update_rule``."""
        grads = self._home(m, grads)
        old = None if read_params is None else self._home(m, read_params)

        def step(p: PyTree, o: PyTree, version: int) -> tuple[PyTree, PyTree]:
            tau = 0 if read_version is None else version - read_version
            return self.update_rule(m, p, o, grads, tau, p if old is None else old)

        return step

    def update_with(
        self,
        m: int,
        step: Callable[[PyTree, PyTree, int], tuple[PyTree, PyTree]],
        on_commit: Callable[[int], None] | None = None,
    ) -> int:
        """Replaces stage ``m``'s ``(params, opt_state)`` by ``step(params, opt_state, version)``
        atomically (``step`` runs under the stage's lock and sees the version it replaces);
        returns the version it replaced.

        Unlike ``apply_gradient`` it neither moves anything to the stage's home device nor
        uses ``update_rule``: ``step`` is the whole update and must return values placed
        where the stage's values live.
        """
        return self.slots[m].params.update(step, on_commit, spread=True)

    def update_all(
        self,
        step: Callable[[tuple, tuple, tuple[int, ...]], tuple[tuple, tuple]],
        on_commit: Callable[[int, int], None] | None = None,
    ) -> tuple[int, ...]:
        """Replaces every stage's ``(params, opt_state)`` by ``step(params, opt_states, versions)``
        (per-stage tuples) atomically; returns the versions it replaced.

        Every stage's lock is taken, in stage order (a fixed order: two such updates cannot
        deadlock, and every other writer holds one stage's lock at a time), ``step`` runs under
        all of them and sees the versions it replaces; ``on_commit(m, version_before)`` as in
        ``update_with``. Like ``update_with``, ``step`` is the whole update.
        """
        slots = [s.params for s in self.slots]
        with contextlib.ExitStack() as locks:
            for slot in slots:
                locks.enter_context(slot._lock)
            befores = [slot._current for slot in slots]
            params, opt_states = step(
                tuple(b.value[0] for b in befores),
                tuple(b.value[1] for b in befores),
                tuple(b.version for b in befores),
            )
            for m, (slot, p, o) in enumerate(zip(slots, params, opt_states, strict=True)):
                slot._publish((p, o), None if on_commit is None else functools.partial(on_commit, m))
        return tuple(b.version for b in befores)

    def read_state(self, m: int) -> Versioned:
        return self.slots[m].state.read()

    def write_state(self, m: int, state: PyTree, on_commit: Callable[[int], None] | None = None) -> int:
        """Replaces stage ``m``'s non-trainable state (last writer wins, as in the paper's setting)."""
        state = self._home(m, state)
        return self.slots[m].state.update(lambda _value, _version: state, on_commit)

    def versions(self) -> tuple[int, ...]:
        return tuple(s.params.read().version for s in self.slots)

    def state_versions(self) -> tuple[int, ...]:
        return tuple(s.state.read().version for s in self.slots)

    def load(self, params: Sequence[PyTree], states: Sequence[PyTree], opt_states: Sequence[PyTree]) -> None:
        """Replaces every stage's values (placed on its home device), keeping the versions.

        For resuming: the versions are the schedule's bookkeeping, replayed, not restored.
        """
        for m, (slots, p, s, o) in enumerate(zip(self.slots, params, states, opt_states, strict=True)):
            slots.params.load(self._home(m, (p, o)))
            slots.state.load(self._home(m, s))

    def snapshot(self) -> tuple[tuple[PyTree, ...], tuple[PyTree, ...], tuple[PyTree, ...]]:
        """Current ``(params, states, opt_states)``, one tree per stage (not one consistent instant)."""
        po = [s.params.read().value for s in self.slots]
        return (tuple(p for p, _ in po), tuple(s.state.read().value for s in self.slots), tuple(o for _, o in po))
