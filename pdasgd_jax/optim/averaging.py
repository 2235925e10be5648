"""DaSGD / local SGD averaging: the rule (``AveragingRule``) and the per-step optax wrapper
(``delayed_averaging``) built on it (algorithms.md §4)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.choices import MERGES
from pdasgd_jax.optim.hyperparameters import is_concrete

PyTree = Any
AxisName = Any  # a mapped axis name, or a tuple of them


class OuterState(NamedTuple):
    """DiLoCo-style outer optimizer state, identical on every worker.

    Attributes:
      global_params: the last global model the outer optimizer produced.
      opt_state: the outer optax optimizer's state.
    """

    global_params: PyTree
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class AveragingRule:
    """DaSGD's averaging schedule and merge (algorithms.md §4).

    After ``t`` local steps, with period ``H`` and delay ``d``: at every ``t`` with
    ``t % H == 0`` (``t = 0`` included) each worker snapshots ``s = theta`` and the average
    ``a = mean_w s`` is started; at ``t0 + d`` it is merged into every worker:
    ``correct``: ``theta <- a + (theta - s)``; ``overwrite``: ``theta <- a``; ``eager``
    (below): ``theta <- a + (theta - s) / W`` over ``W`` workers. With an ``outer``
    optimizer the pseudo-gradient ``global - a`` is fed to it, and the global model it
    produces takes the place of ``a`` in the merge of the parameters.
    The round program merges non-trainable state (BatchNorm statistics) by the same rule, and
    with ``average_opt_state`` the optimizer state too (by default each worker keeps its own);
    a replicated run's groups set their non-trainable state to the mean itself. When a merge
    and a snapshot fall on the same ``t``, ``d = H`` merges first (the previous round's
    average) and ``d = 0`` snapshots first (local SGD: ``theta <- a`` at once).

    ``eager``: a worker's own progress since its snapshot, ``theta - s``, is not yet in the
    average it merges, nor is anyone else's. ``correct`` adds the worker's own in full,
    ``overwrite`` drops it; ``eager`` keeps the worker's share of it, ``a' = a + (theta - s)
    / W``: the mean of the others' snapshots and the worker's current model. What it holds
    back, the carry ``c = (theta - s) - (theta - s) / W``, is not lost: it is added to the
    worker's next snapshot where that enters the next average (``mean_w (s_w + c_w)``), so
    every worker's progress reaches the average once and in full, as with ``correct`` (with
    plain SGD, ``mean_w (theta_w + c_w)`` is the start plus the workers' mean of their local
    steps, as ``correct``'s ``mean_w theta_w`` is). The worker itself trains on from ``a'``.
    With an outer optimizer the pseudo-gradient is ``global - a`` as for the other merges (so
    the outer state stays identical on every worker) and ``theta <- global + (theta - s) /
    W``. Integer leaves (step counts, equal on every worker) merge as ``correct``.
    Identities: with ``d = 0`` the merge follows its snapshot with no step between, ``theta =
    s``, so ``eager`` is ``correct`` (and ``overwrite``); with ``W = 1``, ``a' = theta`` and
    ``c = 0``, so it is ``correct`` again. ``merge_tree`` and ``merge_params`` need ``W`` for
    it (under ``vmap`` or ``shard_map``: ``AveragingRule.worker_count(axis_name)``);
    ``carry`` and ``contribution`` are the carry's two ends.

    ``eager`` follows the eager updates of Kale, Douillard and Donchev, which overlap
    DiLoCo's outer all-reduce with the next inner phase: each worker applies its own current
    outer gradient at once (weighted ``1 / W``) together with the others' delayed ones, and
    the all-reduce still carries every worker's whole outer gradient, so the others receive
    it one round late. ``d = H`` with no outer optimizer (or ``optax.sgd(1.0)``) is that
    scheme with one outer step of overlap and an outer SGD step of rate 1; with ``d < H``
    the same mixing applies to the steps taken while the average is in flight. Unlike the
    paper, the worker's own share is added to the merged model directly rather than passed
    through the outer optimizer (which the paper runs per worker): here the outer optimizer
    sees only the averaged pseudo-gradient, as with the other merges.

    Attributes:
      period: ``H >= 1``, local steps between snapshots.
      delay: ``0 <= d <= H``, steps between a snapshot and its merge (0: local SGD).
        ``period`` and ``delay`` may be jax integer arrays (traced): then they are not
        validated, and only the schedule's predicates (``is_snapshot``, ``is_merge``) use
        them; ``spmd``'s round program needs Python integers.
      merge: ``"correct"``, ``"overwrite"`` or ``"eager"`` (``choices.MERGES``).
      outer: optional optax optimizer applied to the pseudo-gradient, e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; ``optax.sgd(1.0)`` is the same
        as none.
      average_opt_state: also snapshot, average and merge the workers' optimizer states
        (momentum, Adam moments; counts are equal on every worker), as the parameters.
      fragments: ``K >= 1``, streaming merges (algorithms.md §4, "Streaming merges"): the
        stages are grouped into ``K`` contiguous fragments (``fragment_stages``) and fragment
        ``p`` runs this schedule shifted by its offset ``floor(p H / K)``
        (``fragment_offsets``), with an outer optimizer state of its own. ``1``: the whole
        model at once.

    Examples:
        >>> import jax.numpy as jnp
        >>> from pdasgd_jax import AveragingRule
        >>> rule = AveragingRule(period=4, delay=2)
        >>> [t for t in range(10) if rule.is_snapshot(t)], [t for t in range(10) if rule.is_merge(t)]
        ([0, 4, 8], [2, 6])
        >>> float(rule.merge_tree(jnp.array(5.0), jnp.array(3.0), jnp.array(2.0)))  # a + (theta - s)
        4.0
        >>> eager = AveragingRule(period=4, delay=2, merge="eager")
        >>> theta, s, a = jnp.array(5.0), jnp.array(3.0), jnp.array(2.0)
        >>> float(eager.merge_tree(theta, s, a, num_workers=2))  # a + (theta - s) / W
        3.0
        >>> float(eager.carry(jnp.array(5.0), jnp.array(3.0), num_workers=2))  # added to the next snapshot
        1.0

    References:
      Kale, Douillard and Donchev, "Eager Updates For Overlapped Communication and
      Computation in DiLoCo", arXiv:2502.12996.
    """

    period: int
    delay: int = 0
    merge: str = "correct"
    outer: optax.GradientTransformation | None = None
    average_opt_state: bool = False
    fragments: int = 1

    def __post_init__(self):
        period, delay = self.period, self.delay
        if not (isinstance(self.fragments, int) and self.fragments >= 1):
            raise ValueError(f"fragments {self.fragments!r} must be an integer >= 1")
        if is_concrete(period) and not (isinstance(period, int) and period >= 1):
            raise ValueError(f"period {period!r} must be an integer >= 1")
        if is_concrete(delay) and not (
            isinstance(delay, int) and delay >= 0 and (not is_concrete(period) or delay <= period)
        ):
            raise ValueError(f"delay {delay!r} must be an integer in [0, period={period}]")
        if self.merge not in MERGES:
            raise ValueError(f"merge {self.merge!r} is not allowed; choose one of {', '.join(MERGES)}")
        if self.merge == "overwrite" and is_concrete(period) and is_concrete(delay) and delay == period:
            # Every worker is reset to (a function of) the snapshots it took H steps earlier,
            # just before the next snapshot: no local step ever survives.
            raise ValueError("merge='overwrite' with delay == period discards every local step; lower the delay")

    def init_outer(self, params: PyTree) -> OuterState | tuple:
        """The outer optimizer's state (``()`` without one); all workers start from ``params``
        (one tree per stage). With ``fragments > 1``, a tuple of one ``OuterState`` per fragment
        over that fragment's stages."""
        if self.outer is None:
            return ()
        if self.fragments == 1:
            return OuterState(params, self.outer.init(params))
        pieces = [tuple(params[lo:hi]) for lo, hi in fragment_stages(len(params), self.fragments)]
        return tuple(OuterState(piece, self.outer.init(piece)) for piece in pieces)

    def fragment_offsets(self) -> tuple[int, ...]:
        """Each fragment's snapshot step within a period, ``floor(p H / K)``: fragment ``p``
        snapshots after ``t`` local steps when ``t % H == offset_p`` and merges ``d`` steps
        later. One fragment: ``(0,)``, the whole model's schedule."""
        return tuple(p * self.period // self.fragments for p in range(self.fragments))

    @staticmethod
    def average(tree: PyTree, axis_name: AxisName) -> PyTree:
        """``pmean`` over the workers' axis, keeping each leaf's dtype and per-worker type.

        Every worker keeps its own copy of the average. Under ``shard_map``'s varying-axes
        typing a ``pmean`` result is invariant, and ``lax.cond``/``lax.scan`` need it as
        varying as the per-worker leaf it came from; under ``vmap`` there is nothing to cast.
        """
        axes = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}

        def mean(x):
            # `.mat.varying` is where jax 0.10's own error messages point users; it is empty
            # under vmap and with check_vma=False, where no cast is needed (or allowed).
            varying = tuple(sorted(axes & jax.typeof(x).mat.varying))
            m = jax.lax.pmean(x, axis_name).astype(x.dtype)
            return jax.lax.pcast(m, varying, to="varying") if varying else m

        return jax.tree.map(mean, tree)

    @staticmethod
    def worker_count(axis_name: AxisName) -> int:
        """``W``, the number of workers over the mapped axis (or axes) ``axis_name``, a Python
        integer under ``vmap`` and ``shard_map`` alike."""
        return jax.lax.psum(1, axis_name)

    @property
    def carries(self) -> bool:
        """Whether a merge leaves a carry for the next snapshot (``eager``)."""
        return self.merge == "eager"

    def _workers(self, num_workers: int | None) -> int:
        if num_workers is None or num_workers < 1:
            raise ValueError(
                f"merge='eager' needs the number of workers W >= 1 (num_workers={num_workers!r}); "
                "under vmap or shard_map pass AveragingRule.worker_count(axis_name)"
            )
        return num_workers

    def merge_tree(self, local: PyTree, snapshot: PyTree, average: PyTree, num_workers: int | None = None) -> PyTree:
        """The merge of one tree: ``a + (local - s)``, ``a`` or (``eager``, over ``num_workers``
        workers) ``a + (local - s) / W``."""
        if self.merge == "overwrite":
            return average
        if self.merge == "eager":
            w = self._workers(num_workers)
            return jax.tree.map(lambda a, x, s: a + _own_share(x - s, w), average, local, snapshot)
        return jax.tree.map(lambda a, x, s: a + (x - s), average, local, snapshot)

    def carry(self, local: PyTree, snapshot: PyTree, num_workers: int | None = None) -> PyTree:
        """What an ``eager`` merge of ``local`` holds back of the worker's progress since its
        snapshot, ``(local - s) - (local - s) / W`` (zeros for integer leaves), to be added to
        its next snapshot's contribution (``contribution``). Computed from the model before
        the merge."""
        if not self.carries:
            raise ValueError(f"merge={self.merge!r} carries nothing; only 'eager' does")
        w = self._workers(num_workers)

        def held_back(x, s):
            moved = x - s
            return moved - _own_share(moved, w) if jnp.issubdtype(moved.dtype, jnp.inexact) else jnp.zeros_like(moved)

        return jax.tree.map(held_back, local, snapshot)

    @staticmethod
    def contribution(snapshot: PyTree, carry: PyTree) -> PyTree:
        """What a worker's snapshot adds to the average: the snapshot itself, plus the carry of
        its previous ``eager`` merge (``()``: none)."""
        if isinstance(carry, tuple) and not carry:
            return snapshot
        return jax.tree.map(jnp.add, snapshot, carry)

    def merge_params(
        self,
        params: PyTree,
        snapshot: PyTree,
        average: PyTree,
        outer_state: OuterState | tuple,
        num_workers: int | None = None,
    ) -> tuple[PyTree, OuterState | tuple]:
        """The merge of the parameters, through the outer optimizer if there is one."""
        if self.outer is None:
            return self.merge_tree(params, snapshot, average, num_workers), outer_state
        pseudo_grad = jax.tree.map(jnp.subtract, outer_state.global_params, average)
        updates, opt_state = self.outer.update(pseudo_grad, outer_state.opt_state, outer_state.global_params)
        global_params = optax.apply_updates(outer_state.global_params, updates)
        return self.merge_tree(params, snapshot, global_params, num_workers), OuterState(global_params, opt_state)

    def is_snapshot(self, t: jax.Array) -> jax.Array:
        """Whether a snapshot is taken after ``t`` local steps."""
        return t % self.period == 0

    def is_merge(self, t: jax.Array) -> jax.Array:
        """Whether an average is merged after ``t`` local steps."""
        return (t >= self.delay) & ((t - self.delay) % self.period == 0)


def fragment_stages(num_stages: int, fragments: int) -> tuple[tuple[int, int], ...]:
    """The stages of each of ``fragments`` streaming fragments: fragment ``p`` holds stages
    ``[floor(p M / K), floor((p + 1) M / K))`` of ``M = num_stages``, contiguous and as even as
    possible.

    Args:
      num_stages: ``M``, the model's stages.
      fragments: ``K``, ``1 <= K <= M``.

    Returns:
      ``K`` half-open ``(first, end)`` stage ranges covering ``0 .. M - 1`` in order.

    Raises:
      ValueError: ``K`` outside ``[1, M]``.

    Examples:
        >>> fragment_stages(5, 2)
        ((0, 2), (2, 5))
    """
    if not (isinstance(fragments, int) and 1 <= fragments <= num_stages):
        raise ValueError(
            f"--fragments {fragments!r} must be an integer in [1, {num_stages}]: the model has {num_stages} "
            f"stage(s), and a fragment holds at least one"
        )
    return tuple((p * num_stages // fragments, (p + 1) * num_stages // fragments) for p in range(fragments))


def _own_share(moved: jax.Array, num_workers: int) -> jax.Array:
    """The worker's share ``1 / W`` of its own progress ``moved``; an integer leaf (a step
    count, equal on every worker) keeps all of it, as ``correct`` merges it."""
    return moved / num_workers if jnp.issubdtype(moved.dtype, jnp.inexact) else moved


class DelayedAveragingState(NamedTuple):
    """State of ``delayed_averaging`` (per worker).

    Attributes:
      count: local steps taken.
      inner_state: the wrapped optimizer's state (averaged only with ``average_opt_state``).
      snapshot: the parameters at the last snapshot step.
      average: the workers' mean of ``snapshot``: computed (``pmean``) at the snapshot
        step and held, in flight, until it is merged ``delay`` steps later.
      outer: the outer optimizer's ``OuterState``, or ``()`` without one.
      opt_snapshot: with ``average_opt_state``, ``inner_state`` at the last snapshot step
        (else ``()``).
      opt_average: the workers' mean of ``opt_snapshot``, held like ``average``.
      carry: with ``merge="eager"`` (and a delay that may be > 0), what the last merge held
        back of ``(params, opt_snapshot)``'s progress, added to the next snapshot's
        contribution to the average (``AveragingRule.carry``); else ``()``.
    """

    count: jax.Array
    inner_state: optax.OptState
    snapshot: optax.Params
    average: optax.Params
    outer: OuterState | tuple
    opt_snapshot: optax.OptState | tuple = ()
    opt_average: optax.OptState | tuple = ()
    carry: PyTree = ()


def delayed_averaging(
    inner: optax.GradientTransformation,
    period: int,
    delay: int,
    axis_name: AxisName,
    merge: str = "correct",
    outer: optax.GradientTransformation | None = None,
    average_opt_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """DaSGD (local SGD with delayed averaging) as a per-step optax wrapper.

    Each worker runs ``inner`` on its own gradients; the parameters are averaged over the
    mapped axis ``axis_name`` on the schedule of ``AveragingRule`` (snapshot every
    ``period`` steps, merge ``delay`` steps later; ``delay=0`` is local SGD). Call
    ``update`` inside ``jax.vmap(..., axis_name=...)`` or ``jax.shard_map`` over the
    workers, each worker with its own parameters and state: under ``shard_map`` pass them
    in sharded along the workers' axis, since AD sums the gradient of a replicated input
    over the axis.

    This reproduces DaSGD's arithmetic but not its speed: each step is a separately
    compiled call, so the ``pmean`` issued at the snapshot step cannot overlap the next
    ``delay`` local steps; they wait for it. To hide the communication run whole rounds as
    one program, ``pdasgd_jax.spmd.make_round_program``, where XLA can overlap the
    collective with the local steps. Under ``vmap`` both ``lax.cond`` branches run, so the
    ``pmean`` is computed every step there (the result is the same).

    Each step's averaging events are applied right after its local step: with ``delay=0``
    the workers are averaged right after step ``kH``, where the round program does it at
    the start of its next round (the same arithmetic, one phase apart).

    The transform sees only parameters: average non-trainable state (BatchNorm
    statistics) yourself, or use the round program, which does. ``init`` assumes every
    worker starts from the same parameters, so the first average (``t = 0``) is
    ``params`` itself and ``init`` needs no collective.

    Args:
      inner: the local optimizer, e.g. ``optax.sgd(0.1)``.
      period: ``H``, local steps between snapshots.
      delay: ``d``, steps between a snapshot and its merge, ``0 <= d <= H``. ``period``
        and ``delay`` may be traced integers (``optax.inject_hyperparams``).
      axis_name: the workers' mapped axis (or a tuple of axes).
      merge: ``"correct"`` (``a + (theta - s)``), ``"overwrite"`` (``a``) or ``"eager"``
        (``a + (theta - s) / W``, the rest carried into the next average; ``W`` is the
        size of ``axis_name``): ``AveragingRule``.
      outer: optional DiLoCo-style outer optimizer on the pseudo-gradient.
      average_opt_state: also average ``inner``'s state (momentum, Adam moments) on the
        same schedule and merge it like the parameters (default: each worker keeps its own).

    Returns:
      A transformation whose ``update(grads, state, params, **extra)`` needs ``params``;
      ``extra`` is passed to ``inner``.

    Example (two workers with constant gradients 1 and 3; with plain SGD and the
    ``correct`` merge the workers' mean stays on the SGD path, -1 per step):

    >>> import jax, jax.numpy as jnp, optax
    >>> from pdasgd_jax.optim import delayed_averaging
    >>> tx = delayed_averaging(optax.sgd(0.5), period=2, delay=1, axis_name="workers")
    >>> def train(w, grads_T):
    ...     def step(carry, g):
    ...         w, state = carry
    ...         updates, state = tx.update(g, state, w)
    ...         return (optax.apply_updates(w, updates), state), None
    ...     (w, _), _ = jax.lax.scan(step, (w, tx.init(w)), grads_T)
    ...     return w
    >>> grads = jnp.array([[1.0] * 4, [3.0] * 4])  # worker x step
    >>> jax.vmap(train, axis_name="workers")(jnp.zeros(2), grads).tolist()
    [-3.0, -5.0]
    """
    rule = AveragingRule(period, delay, merge, outer, average_opt_state)
    inner = optax.with_extra_args_support(inner)
    # With d = 0 every merge directly follows its snapshot: nothing moved, nothing to carry.
    carried = rule.carries and not (is_concrete(delay) and delay == 0)

    def init(params: optax.Params) -> DelayedAveragingState:
        inner_state = inner.init(params)
        held = inner_state if average_opt_state else ()
        carry = jax.tree.map(jnp.zeros_like, (params, held)) if carried else ()
        return DelayedAveragingState(
            jnp.zeros((), jnp.int32), inner_state, params, params, rule.init_outer(params), held, held, carry
        )

    def update(
        updates: optax.Updates, state: DelayedAveragingState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, DelayedAveragingState]:
        if params is None:
            raise ValueError("delayed_averaging needs params: call update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        theta = optax.apply_updates(params, inner_updates)
        t = state.count + 1
        held = (state.snapshot, state.opt_snapshot), (state.average, state.opt_average)
        workers = rule.worker_count(axis_name) if rule.carries else None

        def merge(held, theta, inner_state, outer_state, carry):
            (snapshot, opt_snapshot), (average, opt_average) = held
            if carried:
                carry = rule.carry((theta, inner_state if average_opt_state else ()), held[0], workers)
            theta, outer_state = rule.merge_params(theta, snapshot, average, outer_state, workers)
            if average_opt_state:
                inner_state = rule.merge_tree(inner_state, opt_snapshot, opt_average, workers)
            return theta, inner_state, outer_state, carry

        def merged(when, held, values):
            # `when` is a Python bool for a concrete delay (False: no merge here, no cond) and
            # a traced one for an injected delay.
            if is_concrete(when) and not when:
                return values
            return jax.lax.cond(rule.is_merge(t) & when, merge, lambda held, *v: v, held, *values)

        values = (theta, inner_state, state.outer, state.carry)
        # With d > 0 the average started `delay` steps ago is merged before a new snapshot.
        values = merged(delay > 0, held, values)
        taken = (values[0], values[1] if average_opt_state else ())
        # An eager merge's carry rides on the next snapshot into the average (AveragingRule).
        sent = rule.contribution(taken, values[3])
        held = jax.lax.cond(rule.is_snapshot(t), lambda: (taken, rule.average(sent, axis_name)), lambda: held)
        # With d = 0 (local SGD) the average just taken is merged at once.
        values = merged(delay == 0, held, values)
        theta, inner_state, outer_state, carry = values
        (snapshot, opt_snapshot), (average, opt_average) = held
        new_updates = jax.tree.map(jnp.subtract, theta, params)
        return new_updates, DelayedAveragingState(
            t, inner_state, snapshot, average, outer_state, opt_snapshot, opt_average, carry
        )

    return optax.GradientTransformationExtraArgs(init, update)
