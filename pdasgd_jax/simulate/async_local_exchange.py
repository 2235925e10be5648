"""The server's side of an async-local round's exchanges on the virtual clock: of the whole
model, or (``--fragments``, streaming) of one fragment's stages at a time.

A stretch starts from what it pulls (``Exchange.pull``) and its arrival updates the server
with the pseudo-gradient of the stages it sends (``Exchange.push``), through
``runners.async_local.make_server_update``'s compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdasgd_jax.kernels import TrainState
from pdasgd_jax.runners.async_local import ServerState
from pdasgd_jax.simulate.async_local_clock import WHOLE_MODEL


class Exchange:
    """The server's side of the rounds' exchanges, of the whole model or (streaming fragments)
    of one fragment's stages: what a replica's stretch starts from, and an arrival's update.

    Args:
      update: ``make_server_update``'s step.
      bounds: each fragment's ``(first, end)`` stages (one: the whole model).
    """

    def __init__(self, update: Callable, bounds: tuple[tuple[int, int], ...]):
        self._update, self._bounds = update, bounds
        self._whole = len(bounds) == 1

    def stages(self, fragment: int) -> tuple[int, int]:
        """The stages an arrival of ``fragment`` updates."""
        return self._bounds[fragment]

    def pull(
        self, server: ServerState, replica: TrainState, start: tuple[Any, Any], fragment: int
    ) -> tuple[TrainState, tuple[Any, Any]]:
        """The state a replica's stretch starts from and the ``(params, states)`` it measures its
        pseudo-gradients from: the server's model (the whole model's exchange, or a joiner's
        pull of every fragment: ``WHOLE_MODEL``), or the replica's own with ``fragment``'s
        stages pulled (``-1``: none, its first stretch)."""
        if self._whole or fragment == WHOLE_MODEL:
            return TrainState(server.params, server.states, replica.opt_states), (server.params, server.states)
        if fragment < 0:
            return replica, start
        lo, hi = self._bounds[fragment]
        params, states = _put(replica.params, server.params, lo, hi), _put(replica.states, server.states, lo, hi)
        return TrainState(params, states, replica.opt_states), (
            _put(start[0], params, lo, hi),
            _put(start[1], states, lo, hi),
        )

    def push(self, server: ServerState, fragment: int, start: tuple[Any, Any], end: tuple[Any, Any]) -> ServerState:
        """The server after an arrival of ``fragment`` (pseudo-gradient ``start - end`` of its stages)."""
        if self._whole:
            return self._update(server, start, end)
        lo, hi = self._bounds[fragment]
        part = ServerState(server.params[lo:hi], server.states[lo:hi], server.outer[fragment] if server.outer else ())
        sliced = lambda pair: (pair[0][lo:hi], pair[1][lo:hi])
        new = self._update(part, sliced(start), sliced(end))
        outer = server.outer
        if outer:
            outer = (*outer[:fragment], new.outer, *outer[fragment + 1 :])
        return ServerState(_put(server.params, new.params, lo, hi), _put(server.states, new.states, lo, hi), outer)


def _put(stages: Any, source: Any, lo: int, hi: int) -> tuple:
    """``stages`` (one tree per stage) with stages ``lo .. hi - 1`` taken from ``source``,
    indexed as the whole model's or, when shorter, as those stages alone."""
    piece = tuple(source[lo:hi]) if len(source) == len(stages) else tuple(source)
    return (*stages[:lo], *piece, *stages[hi:])
