"""The arithmetic both replays of local SGD's and DaSGD's rounds under ``--fleet``, ``--quorum``
or ``--deadline adaptive`` run (algorithms.md §5a): the whole model's
(``simulate.fleet_rounds``, its round's units in one vmapped program) and the streamed
fragments' (``simulate.fleet_fragments``, replica by replica). Each keeps its own order of
operations; what an operation computes is said once here: a unit's batches and keys, a
merge and its ``eager`` carry, what a landed unit gives, an average with its outer step, and
the run's summary.

The two orders are not merged into one: the vmapped program and the per-replica one round
differently, and the whole-model schedule also places several replicas on a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states, make_train_step
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners.averaging import outer_optimizer
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.averaging_clock import on_devices, placement
from pdasgd_jax.simulate.fleet_round_inputs import mean_of
from pdasgd_jax.simulate.straggler_policy import DEADLINE_MADS, DEADLINE_WINDOW
from pdasgd_jax.simulate.sync import fresh_updates


@dataclasses.dataclass
class Replay:
    """What a replay starts from and steps with.

    Attributes:
      params, states, init_opt: the initial model and optimizer state, on the host.
      delay: DaSGD's ``d`` (local SGD: 0).
      rule: the merges (``--merge``, ``d``) and the outer optimizer.
      step_fn: one local step, ``(TrainState, x, y[, key]) -> (TrainState, loss)``.
      key: the run's key for a model that draws randomness (else None).
      streams: each replica's batches.
      outer_step: the outer optimizer's step on a landed mean, the round program's
        (``overwrite``: the new global model).
    """

    params: Any
    states: Any
    init_opt: Any
    delay: int
    rule: AveragingRule
    step_fn: Any
    key: jax.Array | None
    streams: list[Iterator]
    outer_step: Any

    @classmethod
    def of(cls, exp: Experiment, num_workers: int) -> Replay:
        """The replay of ``exp`` (``local`` or ``dasgd``) over ``num_workers`` replicas."""
        config = exp.config
        v = exp.variables
        params, states = jax.device_get(v.params), jax.device_get(v.states)
        d = config.averaging_delay if config.algo == "dasgd" else 0
        rule = AveragingRule(config.period, d, config.merge, outer_optimizer(config.outer_optimizer, config.outer_lr))
        batch = config.batch_size
        return cls(
            params,
            states,
            jax.device_get(init_opt_states(exp.tx, params, whole_model=exp.whole_model_updates)),
            d,
            rule,
            make_train_step(exp.model, exp.tx, whole_model=exp.whole_model_updates),
            jax.random.key(config.seed) if exp.model.draws_randomness else None,
            [exp.train_stream(batch, shard_index=w, num_shards=num_workers) for w in range(num_workers)],
            jax.jit(AveragingRule(config.period, 0, "overwrite", rule.outer).merge_params),
        )

    def inputs(self, w: int, first: int, count: int) -> list:
        """Replica ``w``'s next ``count`` batches, stacked, for its local steps from its step
        ``first``; with randomness, step ``s``'s key ``fold_in(fold_in(key, w), s)`` (the round
        program's)."""
        rows = [next(self.streams[w]) for _ in range(count)]
        out = [np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])]
        if self.key is not None:
            worker_key = jax.random.fold_in(self.key, w)
            out.append(jnp.stack([jax.random.fold_in(worker_key, first + s) for s in range(count)]))
        return out

    def merge(self, now: Any, taken: Any, average: Any, n: int | None) -> tuple[Any, Any]:
        """A unit's merge of ``average`` into ``now`` (its snapshot ``taken``) by ``rule`` over
        the ``n`` units landed in that average; and what it holds back (``eager`` with ``d > 0``:
        its carry, which its next snapshot adds where it lands; else None)."""
        carry = self.rule.carry(now, taken, n) if self.rule.carries and self.delay > 0 else None
        return self.rule.merge_tree(now, taken, average, n), carry

    def given(self, model: Any, carry: Any) -> Any:
        """What a landing unit's ``model`` gives its average: plus its carry (None: none)."""
        return model if carry is None else self.rule.contribution(model, carry)

    def average(self, prev: Any, given: list, bases: list, outer: Any) -> tuple[Any, Any, Any]:
        """An average of the landed units: ``prev`` plus the mean over them of what each
        gave minus the average it began from (``(params, states)`` trees, each leaf in
        ``prev``'s dtype).

        Returns:
          ``(mean, stored, outer)``: the landed mean (the model evaluated), the average the
          replicas merge (with an outer optimizer the global model its step makes of the mean)
          and the outer state after it.
        """
        moved = [jax.tree.map(jnp.subtract, g, b) for g, b in zip(given, bases, strict=True)]
        mean = jax.device_get(jax.tree.map(lambda a, m: (a + m).astype(a.dtype), prev, mean_of(moved)))
        if self.rule.outer is None:
            return mean, mean, outer
        global_p, outer = self.outer_step(mean[0], mean[0], mean[0], outer)
        return mean, (jax.device_get(global_p), mean[1]), outer


def policy_report(config: Any, fleet: bool) -> dict[str, Any]:
    """The straggler policy and fleet a run's ``local_rounds`` report names."""
    out: dict[str, Any] = {}
    if config.quorum:
        out["quorum"] = config.quorum
    if config.deadline == "adaptive":
        out["deadline"] = {"rule": "adaptive", "mads": DEADLINE_MADS, "window": DEADLINE_WINDOW}
    if fleet:
        out["fleet"] = config.fleet
    return out


def units_report(merged: list, late: int, begun: list, unmerged: list) -> dict[str, Any]:
    """What became of a run's units, in local steps: ``merged`` (``late`` of them landed past
    their first average), dropped by leaves and crashes among ``begun``, and ``unmerged`` at
    the end (each unit with ``steps`` and ``dropped``)."""
    return {
        "merged_steps": sum(u.steps for u in merged),
        "late_units": late,
        "dropped_steps": {k: sum(u.steps for u in begun if u.dropped == k) for k in ("leave", "crash")},
        "unmerged_steps_at_end": sum(u.steps for u in unmerged),
    }


def replay_outcome(
    exp: Experiment,
    shown: tuple,
    step: int,
    examples: int,
    report: dict,
    busy: np.ndarray,
    now: float,
    computed: int,
    **extra: Any,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """A replay's answer, like ``run_averaging``'s.

    Args:
      exp: the experiment.
      shown: the model evaluated last, ``(params, states)``.
      step, examples: the local steps and examples it stands at.
      report: its ``local_rounds`` summary.
      busy: ``(W,)`` device seconds each replica computed.
      now: the run's virtual time.
      computed: local steps computed (the staleness count: every update fresh).
      extra: more summary entries.

    Returns:
      ``(RunResult, virtual_time, utilisation, staleness)``.
    """
    config = exp.config
    num_workers, devices = len(busy), exp.layout.devices
    dasgd = config.algo == "dasgd" and config.averaging_delay
    result = RunResult(
        shown[0],
        shown[1],
        step,
        examples,
        {
            "devices": 1,
            "replicas": num_workers,
            "placement": "vmap",
            "effective_algorithm": "dasgd" if dasgd else "local",
            "delay_steps": config.averaging_delay,
            "average_delay_steps": config.averaging_delay,
            "local_rounds": report,
            **extra,
            **placement(num_workers, devices),
        },
    )
    share = [float(b) / now for b in busy]
    utilisation = {
        "workers": {f"w{w}": b for w, b in enumerate(share)},
        "devices": on_devices(np.array(share), devices).tolist(),
    }
    return result, now, utilisation, fresh_updates(len(shown[0]), computed)
