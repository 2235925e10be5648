"""A model as a chain of stages, in pure functional form.

Stage m maps ``x_m = f_m(theta_m, s_m, x_{m-1})`` where ``theta_m`` are its trainable
parameters and ``s_m`` its non-trainable state (BatchNorm statistics, ...). Every
algorithm in the library works on the tuple of per-stage parameter trees, so a
layer-wise update touches exactly one element of that tuple.

Build a staged model from your own Flax NNX modules::

    import optax
    from flax import nnx
    from pdasgd_jax import stages

    rngs = nnx.Rngs(0)
    model, variables = stages.from_modules(
        [nnx.Sequential(nnx.Linear(64, 128, rngs=rngs), nnx.relu),
         nnx.Linear(128, 10, rngs=rngs)],
        loss=stages.softmax_cross_entropy,
    )
    logits, _ = model.apply(variables.params, variables.states, x_BxD, train=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def softmax_cross_entropy(logits_BxC: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy against integer labels: the default loss of a staged model.

    Args:
      logits_BxC: the last stage's output, one row of class scores per example.
      labels_B: the examples' integer class labels.

    Returns:
      The mean over the batch, a scalar.

    Examples:
        >>> import jax.numpy as jnp
        >>> from pdasgd_jax import softmax_cross_entropy
        >>> loss = softmax_cross_entropy(jnp.zeros((4, 10)), jnp.array([0, 1, 2, 3]))
        >>> round(float(loss), 4)  # log(10): uniform scores
        2.3026
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B).mean()


class Variables(NamedTuple):
    """Per-stage trainable parameters and non-trainable state, one tree per stage.

    Attributes:
      params: one tree of arrays per stage (plain nested dicts, ``nnx.to_pure_dict``).
      states: one tree per stage of the non-trainable state (BatchNorm statistics; an empty
        dict for a stage without any).

    Examples:
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, variables = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> len(variables.params), sorted(variables.params[0])
        (2, ['bias', 'kernel'])
    """

    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: the NNX graph definitions for training and for evaluation.

    The two graph definitions differ only in mode flags (``use_running_average`` of
    BatchNorm, ``deterministic`` of Dropout); keeping both lets ``apply`` stay a pure
    function of arrays.

    Randomness (Dropout's ``nnx.Rngs`` streams, any ``nnx.RngState``) is not state: it is
    split out of the stage's non-trainable state, which concurrent jobs share, and rebuilt
    at every call from the caller's key ``rng`` (stream keys ``fold_in(rng, i)``, counts
    zero), so each job draws its own masks and the same key draws the same masks again
    (a ``live`` backward's re-run, a replay). ``rng_def``/``rng_leaves`` describe those
    variables; a stage without any takes no key.

    Parameters and state travel as plain nested dicts of arrays (``nnx.to_pure_dict``),
    not as NNX ``State`` trees: jax flattens plain dicts in C++ at every jitted call, while
    ``State`` and its ``Variable`` leaves are flattened in Python, which costs more than a
    small stage's whole kernel. ``param_def``/``state_def`` rebuild the ``State`` inside
    the traced function, where the cost is paid once per compilation. ``from_modules``
    builds stages; constructing one by hand needs both structures.

    Attributes:
      name: the stage's name (in error messages and summaries).
      train_def, eval_def: the module's graph definitions in training and in eval mode.
      param_def, state_def: the structures of its parameters and non-trainable state.
      rng_def, rng_leaves: the structure and leaves of its randomness, if it draws any.

    Examples:
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, _ = from_modules([nnx.Linear(4, 3, rngs=nnx.Rngs(0))], names=["head"])
        >>> model.stages[0].name, model.stages[0].draws_randomness
        ('head', False)
    """

    name: str
    train_def: nnx.GraphDef
    eval_def: nnx.GraphDef
    param_def: jax.tree_util.PyTreeDef
    state_def: jax.tree_util.PyTreeDef
    rng_def: jax.tree_util.PyTreeDef | None = None
    rng_leaves: tuple[jax.ShapeDtypeStruct, ...] = ()

    @property
    def draws_randomness(self) -> bool:
        return bool(self.rng_leaves)

    def apply(
        self, params: PyTree, state: PyTree, x: jax.Array, *, train: bool, rng: jax.Array | None = None
    ) -> tuple[jax.Array, PyTree]:
        """Runs the stage; returns its output and its updated non-trainable state (a plain dict).

        Args:
          rng: the key this call's randomness (Dropout masks) is drawn from; needed in
            training mode by a stage that draws randomness, ignored otherwise.
        """
        parts = [
            _as_nnx(self.param_def, params, f"parameters of stage {self.name!r}"),
            _as_nnx(self.state_def, state, f"state of stage {self.name!r}"),
        ]
        if self.draws_randomness:
            parts.append(self._rng_state(rng, train))
        module = nnx.merge(self.train_def if train else self.eval_def, *parts, copy=True)
        y = module(x)
        *_, new_state = _split(module)
        return y, nnx.to_pure_dict(new_state)

    def _rng_state(self, rng: jax.Array | None, train: bool) -> nnx.State:
        """The stage's ``RngState`` variables drawn from ``rng``: stream keys ``fold_in(rng, i)``, counts zero."""
        if rng is None:
            if train:
                raise ValueError(
                    f"stage {self.name!r} draws randomness (Dropout) in training mode: pass rng, "
                    "a key of its own per job (or step)"
                )
            rng = jax.random.key(0)  # evaluation draws nothing: the key only fills the stream variables
        leaves = [
            jax.random.fold_in(rng, i)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            else jnp.zeros(leaf.shape, leaf.dtype)
            for i, leaf in enumerate(self.rng_leaves)
        ]
        return jax.tree.unflatten(self.rng_def, leaves)


def _as_nnx(treedef: jax.tree_util.PyTreeDef, tree: PyTree, what: str) -> nnx.State:
    """The NNX ``State`` of structure ``treedef`` holding ``tree``'s leaves (a plain dict of the
    same structure: they share their leaf order, both sorting keys, checked in ``from_modules``)."""
    nnx_tree = jax.tree.unflatten(treedef, jax.tree.leaves(tree))
    # Structures are static: under jit this check runs once per compilation.
    if jax.tree.structure(nnx.to_pure_dict(nnx_tree)) != jax.tree.structure(tree):
        raise ValueError(
            f"{what} have structure {jax.tree.structure(tree)}; expected the plain dict "
            f"{jax.tree.structure(nnx.to_pure_dict(nnx_tree))}"
        )
    return nnx_tree


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A chain of stages followed by a loss on the last stage's output.

    Build one with ``from_modules``; every algorithm trains it stage by stage or whole.

    Attributes:
      stages: the stages, applied in order.
      loss: ``loss(logits, labels) -> scalar``, a mean over the batch.

    Examples:
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> rngs = nnx.Rngs(0)
        >>> first = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.relu)
        >>> model, _ = from_modules([first, nnx.Linear(8, 3, rngs=rngs)])
        >>> model.num_stages
        2
    """

    stages: tuple[Stage, ...]
    loss: LossFn = softmax_cross_entropy

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def draws_randomness(self) -> bool:
        """Whether some stage draws randomness (then training calls need an ``rng``)."""
        return any(stage.draws_randomness for stage in self.stages)

    def stage_rng(self, rng: jax.Array | None, m: int) -> jax.Array | None:
        """Stage ``m``'s key of a job's (or step's) key ``rng``: ``fold_in(rng, m)``, or None
        when the stage draws nothing (nothing is computed for it)."""
        if rng is None or not self.stages[m].draws_randomness:
            return None
        return jax.random.fold_in(rng, m)

    def apply(
        self,
        params: Sequence[PyTree],
        states: Sequence[PyTree],
        x: jax.Array,
        *,
        train: bool,
        rng: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[PyTree, ...]]:
        """Runs all stages in order; returns the logits and the new per-stage states.

        ``rng``: the key of this job or step, needed in training mode when the model draws
        randomness; stage ``m`` draws from ``stage_rng(rng, m)``.
        """
        new_states = []
        for m, (stage, p, s) in enumerate(zip(self.stages, params, states)):
            x, s = stage.apply(p, s, x, train=train, rng=self.stage_rng(rng, m))
            new_states.append(s)
        return x, tuple(new_states)

    def loss_and_states(
        self,
        params: Sequence[PyTree],
        states: Sequence[PyTree],
        x: jax.Array,
        labels: jax.Array,
        rng: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[PyTree, ...]]:
        """Training-mode loss; the auxiliary output is the new per-stage state."""
        logits, new_states = self.apply(params, states, x, train=True, rng=rng)
        return self.loss(logits, labels), new_states


def _split(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, params, rng_state, state)``: randomness apart from the shared state."""
    return nnx.split(module, nnx.Param, nnx.RngState, ...)


def _pure(tree: nnx.State) -> tuple[PyTree, jax.tree_util.PyTreeDef]:
    """``tree`` as a plain dict of arrays, and the NNX structure that rebuilds it."""
    pure = nnx.to_pure_dict(tree)
    leaves, pure_leaves = jax.tree.leaves(tree), jax.tree.leaves(pure)
    if len(leaves) != len(pure_leaves) or any(a is not b for a, b in zip(leaves, pure_leaves)):
        raise AssertionError("NNX State and its pure dict disagree on leaf order")  # a Flax change, not user error
    return pure, jax.tree.structure(tree)


def from_modules(
    modules: Sequence[nnx.Module | Callable],
    *,
    loss: LossFn = softmax_cross_entropy,
    names: Sequence[str] | None = None,
) -> tuple[StagedModel, Variables]:
    """Turns a list of NNX modules (one per stage) into a ``StagedModel`` and its variables.

    A plain function (``jax.nn.relu``, a reshape) is wrapped as a parameter-free stage;
    prefer folding such functions into a neighbouring ``nnx.Sequential`` so that every
    stage carries parameters.

    Args:
      modules: the stages, applied in order; the last one produces the logits.
      loss: ``loss(logits, labels) -> scalar``.
      names: optional stage names (default ``stage0``, ``stage1``, ...).

    Returns:
      ``(model, variables)``: the pure description and the initial per-stage arrays.

    Examples:
        >>> from flax import nnx
        >>> from pdasgd_jax import Config, from_modules
        >>> rngs = nnx.Rngs(0)
        >>> modules = [nnx.Sequential(nnx.Linear(64, 32, rngs=rngs), nnx.relu), nnx.Linear(32, 10, rngs=rngs)]
        >>> model, variables = from_modules(modules)  # then: train_and_evaluate(Config(...), model=(model, variables))
        >>> [stage.name for stage in model.stages]
        ['stage0', 'stage1']
    """
    if not modules:
        raise ValueError("from_modules needs at least one stage; got an empty list")
    names = list(names) if names is not None else [f"stage{i}" for i in range(len(modules))]
    if len(names) != len(modules):
        raise ValueError(f"got {len(names)} names for {len(modules)} stages")
    stages, params, states = [], [], []
    for name, module in zip(names, modules):
        if not isinstance(module, nnx.Module):
            module = nnx.Sequential(module)
        module.train()
        train_def, p, r, s = _split(module)
        module.eval()
        eval_def, *_ = _split(module)
        module.train()
        p, param_def = _pure(p)
        s, state_def = _pure(s)
        rng_leaves = tuple(jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype) for leaf in jax.tree.leaves(r))
        stages.append(
            Stage(
                name,
                train_def,
                eval_def,
                param_def,
                state_def,
                jax.tree.structure(r) if rng_leaves else None,
                rng_leaves,
            )
        )
        params.append(p)
        states.append(s)
    return StagedModel(tuple(stages), loss), Variables(tuple(params), tuple(states))


def num_params(params: PyTree) -> int:
    """Number of scalar parameters in a tree."""
    return sum(int(jnp.size(leaf)) for leaf in jax.tree.leaves(params))


def update_modules(modules: Sequence[nnx.Module | Callable], variables: Variables) -> None:
    """Writes ``variables`` (e.g. a trained run's ``result.variables``) into the NNX modules they
    were made from by ``from_modules``, in place: the modules then compute what the staged model
    computes with ``variables``.

    Args:
      modules: the list given to ``from_modules`` (plain functions in it hold nothing and are skipped).
      variables: per-stage parameters and state of the staged model built from ``modules``.

    Raises:
      ValueError: the stage counts, or a stage's variable structure or shapes, differ (the
        variables belong to another model).

    Example::

        model, variables = from_modules(modules)
        result = train_and_evaluate(config, model=(model, variables))
        update_modules(modules, result.variables)
    """
    if len(modules) != len(variables.params) or len(modules) != len(variables.states):
        raise ValueError(
            f"got {len(modules)} modules but variables of {len(variables.params)} stages; pass the list given "
            "to from_modules"
        )
    updates = []  # checked for every stage before any module changes
    for m, (module, params, state) in enumerate(zip(modules, variables.params, variables.states)):
        if not isinstance(module, nnx.Module):
            continue
        _, old_params, _, old_state = _split(module)
        new = []
        for what, old, tree in (("parameters", old_params, params), ("state", old_state, state)):
            new.append(_as_nnx(jax.tree.structure(old), tree, f"{what} of stage {m}"))
            old_shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(old)]
            new_shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(tree)]
            if old_shapes != new_shapes:
                raise ValueError(f"{what} of stage {m} have shapes {new_shapes}; the module holds {old_shapes}")
        updates.append((module, new))
    for module, new in updates:
        nnx.update(module, *new)
