"""Pure functional, jitted kernels shared by every algorithm.

Per stage ``m`` (algorithms.md §3):

* ``forward(m)``: training-mode stage forward; the caller keeps the stage input for a
  ``live`` backward.
* ``forward_stashed(m)``: the same forward that also returns the stage's VJP, i.e. the
  residuals at the weights it read (weight stashing: JAX arrays are immutable, so the
  old version simply stays alive).
* ``backward_stashed(m)``: ``(g_m, delta_{m-1})`` from the stored VJP.
* ``backward_live(m)``: ``(g_m, delta_{m-1})`` re-linearised at the *current* weights with
  the stored stage input; costs one extra stage forward.
* ``update(m)``: one optax step on stage ``m`` with its own optimizer state.

Fused kernels, the same arithmetic in fewer programs: ``job_gradients`` (a whole stashed
job, for the simulator), ``forward_all_stashed`` (every stage's ``forward_stashed`` and the
loss, for the runtime's forward workers), ``backward_update_stashed`` (one stage's
backward and its update, run under the stage's update lock) and ``update_all`` (every
stage's update, for an ASGD thread that owns every stage: LPP-SGD, replicated ASGD).

Whole-model kernels (``make_train_step``, jitted as ``StageKernels.train_step``, and
``eval_step``) chain the same stage functions and serve the synchronous baselines and
evaluation: they live in ``model_steps``, one optax step on a stage and the optimizer
states' layout (``apply_stage_update``, ``init_opt_states``) in ``stage_update``; both are
importable from here.

Every training-mode kernel takes an optional last argument ``rng``, the key of the job (or
step) its randomness (Dropout masks) is drawn from; stage ``m`` draws from
``model.stage_rng(rng, m)``, so the per-stage and the fused kernels draw the same masks. A
model that draws no randomness takes ``None`` and compiles to exactly the programs it would
without the argument.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import optax

from pdasgd_jax.model_steps import TrainState, make_eval_step, make_train_step
from pdasgd_jax.stage_update import apply_stage_update, init_opt_states
from pdasgd_jax.stages import StagedModel

PyTree = Any


@runtime_checkable
class StageKernelsProtocol(Protocol):
    """The kernels a ``StageExecutor`` calls: ``StageKernels`` runs them,
    ``simulate.resume.AbstractKernels`` evaluates them abstractly. Signatures as in
    ``StageKernels``."""

    loss_grad: Callable[..., tuple[Any, Any]]
    job_gradients: Callable[..., tuple[Any, tuple[PyTree, ...]]]
    forward_all_stashed: Callable[..., tuple[Any, ...]]
    backward_update_stashed: Callable[..., tuple[PyTree, PyTree, Any]]
    update_all: Callable[..., tuple[tuple[PyTree, ...], tuple[PyTree, ...]]]

    @property
    def num_stages(self) -> int: ...

    @property
    def draws_randomness(self) -> bool: ...

    def forward(self, m: int) -> Callable: ...

    def forward_stashed(self, m: int) -> Callable: ...

    def backward_stashed(self, m: int) -> Callable: ...

    def backward_live(self, m: int) -> Callable: ...

    def update(self, m: int) -> Callable: ...

    def apply_update(
        self,
        m: int,
        params: PyTree,
        opt_state: PyTree,
        grads: PyTree,
        staleness: int = 0,
        old_params: PyTree | None = None,
    ) -> tuple[PyTree, PyTree]: ...


class StageKernels:
    """Jitted per-stage kernels of one model under one optax optimizer: what the asynchronous
    algorithms run, a stage's forward, backward and update at a time.

    Args:
      model: the staged model.
      tx: the optimizer every stage's update applies (one state per stage).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> x, labels = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> from pdasgd_jax import StageKernels, init_opt_states
        >>> k = StageKernels(model, optax.sgd(0.1))
        >>> y, s, vjp = k.forward_stashed(0)(v.params[0], v.states[0], x)
        >>> logits, _, vjp1 = k.forward_stashed(1)(v.params[1], v.states[1], y)
        >>> loss, delta = k.loss_grad(logits, labels)
        >>> g1, delta = k.backward_stashed(1)(vjp1, delta)
        >>> new_params1, new_opt1 = k.update(1)(v.params[1], init_opt_states(optax.sgd(0.1), v.params)[1], g1)
        >>> new_params1["kernel"].shape
        (8, 3)
    """

    def __init__(self, model: StagedModel, tx: optax.GradientTransformation):
        self.model = model
        self.tx = tx
        self._forward = [jax.jit(functools.partial(_forward, model, m)) for m in range(model.num_stages)]
        self._forward_stashed = [jax.jit(functools.partial(_forward_vjp, model, m)) for m in range(model.num_stages)]
        self._backward_live = [jax.jit(functools.partial(_backward_live, model, m)) for m in range(model.num_stages)]
        self._backward_stashed = jax.jit(_apply_vjp)
        self._update = jax.jit(functools.partial(apply_stage_update, tx))
        self.loss_grad: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] = jax.jit(
            jax.value_and_grad(model.loss)
        )
        # The whole job in one program: what the stashed per-stage chain computes, for callers
        # (the simulator) that know every stage's read version before the first backward.
        self.job_gradients: Callable[..., tuple[jax.Array, tuple[PyTree, ...]]] = jax.jit(_job_gradients(model))
        # A whole forward pass in one program, keeping every stage's VJP for the per-stage
        # backward kernels: for callers that read every stage before the forward starts.
        self.forward_all_stashed: Callable[..., tuple[Any, ...]] = jax.jit(_forward_all_stashed(model))
        # A stashed stage backward and that stage's update in one program: for a caller that
        # holds the stage's update lock around it (the layer-wise update still lands as
        # soon as the stage's gradient exists).
        self.backward_update_stashed: Callable[..., tuple[PyTree, PyTree, Any]] = jax.jit(
            functools.partial(_backward_update, tx)
        )
        # Every stage's update in one program: for a caller that holds every stage's update
        # lock (an ASGD thread whose store keeps every stage on its device).
        self.update_all: Callable[..., tuple[tuple[PyTree, ...], tuple[PyTree, ...]]] = jax.jit(
            functools.partial(_update_all, tx)
        )
        # The whole-model SGD step in one program (``make_train_step``): what a synchronous,
        # local SGD or DaSGD worker runs per step; the calibration times it.
        self.train_step: Callable[..., tuple[TrainState, jax.Array]] = jax.jit(make_train_step(model, tx))

    @property
    def num_stages(self) -> int:
        return self.model.num_stages

    @property
    def draws_randomness(self) -> bool:
        """Whether the training kernels need a key (``rng``) per job."""
        return self.model.draws_randomness

    def forward(self, m: int) -> Callable:
        """``(params_m, state_m, x, rng=None) -> (y, new_state_m)``."""
        return self._forward[m]

    def forward_stashed(self, m: int) -> Callable:
        """``(params_m, state_m, x, rng=None) -> (y, new_state_m, vjp_m)``."""
        return self._forward_stashed[m]

    def backward_stashed(self, m: int) -> Callable:
        """``(vjp_m, delta_m) -> (g_m, delta_{m-1})``; ``delta_{-1}`` is ``None``."""
        return self._backward_stashed

    def backward_live(self, m: int) -> Callable:
        """``(params_m_live, state_m, x_in, delta_m, rng=None) -> (g_m, delta_{m-1})``; ``rng``:
        the job's key, so the re-run forward draws the masks the forward drew."""
        return self._backward_live[m]

    def update(self, m: int) -> Callable:
        """``(params_m, opt_state_m, g_m, staleness=0, old_params_m=None) -> (params_m, opt_state_m)``."""
        return self._update

    def apply_update(
        self,
        m: int,
        params: PyTree,
        opt_state: PyTree,
        grads: PyTree,
        staleness: int = 0,
        old_params: PyTree | None = None,
    ) -> tuple[PyTree, PyTree]:
        """``update(m)`` with the stage index first: the form ``ParameterStore`` takes."""
        return self._update(params, opt_state, grads, staleness, old_params)


def _job_gradients(model: StagedModel) -> Callable:
    """``(params, states, x, labels, rng=None) -> (loss, grads)`` of the whole chain, states unchanged."""

    def job_gradients(params, states, x, labels, rng=None):
        return jax.value_and_grad(lambda p: model.loss_and_states(p, states, x, labels, rng)[0])(params)

    return job_gradients


def _forward_all_stashed(model: StagedModel) -> Callable:
    """``(params, states, x, labels, rng=None) -> (loss, delta_M, new_states, vjps)``: every
    ``forward_stashed(m)`` in order, then ``loss_grad``."""

    def forward_all(params, states, x, labels, rng=None):
        new_states, vjps = [], []
        for m in range(model.num_stages):
            x, new_state, vjp = _forward_vjp(model, m, params[m], states[m], x, rng)
            new_states.append(new_state)
            vjps.append(vjp)
        loss, delta = jax.value_and_grad(model.loss)(x, labels)
        return loss, delta, tuple(new_states), tuple(vjps)

    return forward_all


def _backward_update(tx, vjp, delta, params, opt_state, staleness, old_params):
    """``(vjp_m, delta_m, params_m, opt_state_m, staleness, old_params_m) -> (params_m, opt_state_m,
    delta_{m-1})``."""
    g, delta_in = _apply_vjp(vjp, delta)
    params, opt_state = apply_stage_update(tx, params, opt_state, g, staleness, old_params)
    return params, opt_state, delta_in


def _update_all(tx, params, opt_states, grads, stalenesses=None, old_params=None):
    """``(params, opt_states, grads, stalenesses=None, old_params=None) -> (params, opt_states)``,
    per-stage tuples: ``apply_stage_update`` of every stage (staleness 0 and the current
    weights where None), each stage's arithmetic as its own ``update(m)`` computes it."""
    stalenesses = (0,) * len(params) if stalenesses is None else stalenesses
    old_params = (None,) * len(params) if old_params is None else old_params
    stepped = [apply_stage_update(tx, *args) for args in zip(params, opt_states, grads, stalenesses, old_params)]
    return tuple(p for p, _ in stepped), tuple(o for _, o in stepped)


def _forward(model, m, params, state, x, rng=None):
    return model.stages[m].apply(params, state, x, train=True, rng=model.stage_rng(rng, m))


def _forward_vjp(model, m, params, state, x, rng=None):
    if m > 0:
        y, vjp, new_state = jax.vjp(lambda p, s, x_: _forward(model, m, p, s, x_, rng), params, state, x, has_aux=True)
    else:  # the first stage's input is data (possibly integer tokens): no cotangent
        y, vjp, new_state = jax.vjp(lambda p, s: _forward(model, m, p, s, x, rng), params, state, has_aux=True)
    return y, new_state, vjp


def _apply_vjp(vjp, delta):
    cotangents = vjp(delta)
    g = cotangents[0]
    delta_in = cotangents[2] if len(cotangents) == 3 else None
    return g, delta_in


def _backward_live(model, m, params, state, x, delta, rng=None):
    _, _, vjp = _forward_vjp(model, m, params, state, x, rng)
    return _apply_vjp(vjp, delta)


def chained_gradients(
    kernels: StageKernels,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    x: jax.Array,
    labels: jax.Array,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, tuple[PyTree, ...]]:
    """Loss and per-stage gradients by chaining the stashed per-stage kernels.

    The reference the layer-wise algorithms are checked against: it must equal
    ``jax.grad`` of the whole model.

    Args:
      kernels: the model's ``StageKernels``.
      params: one parameter tree per stage.
      states: one non-trainable state tree per stage.
      x: a batch's inputs.
      labels: its labels.
      rng: the key of the model's randomness (Dropout), if it draws any.

    Returns:
      ``(loss, grads)``: the batch's loss and one gradient tree per stage.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> x, labels = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> from pdasgd_jax import StageKernels, chained_gradients
        >>> loss, grads = chained_gradients(StageKernels(model, optax.sgd(0.1)), v.params, v.states, x, labels)
        >>> whole = jax.grad(lambda p: model.loss_and_states(p, v.states, x, labels)[0])(v.params)
        >>> bool(jnp.allclose(grads[0]["kernel"], whole[0]["kernel"], atol=1e-6))
        True
    """
    vjps = []
    for m in range(kernels.num_stages):
        x, _, vjp = kernels.forward_stashed(m)(params[m], states[m], x, rng)
        vjps.append(vjp)
    loss, delta = kernels.loss_grad(x, labels)
    grads = [None] * kernels.num_stages
    for m in reversed(range(kernels.num_stages)):
        grads[m], delta = kernels.backward_stashed(m)(vjps[m], delta)
    return loss, tuple(grads)


__all__ = [
    "StageKernels",
    "StageKernelsProtocol",
    "TrainState",
    "apply_stage_update",
    "chained_gradients",
    "init_opt_states",
    "make_eval_step",
    "make_train_step",
]
