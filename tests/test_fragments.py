"""Streaming merges (``--fragments K``, algorithms.md §4 "Streaming merges"): K = 1 is the whole
model's schedule, K = M with d = 0 averages each stage at its own offset, the clock charges each
fragment's all-reduce on its own, and a bad K is refused before any work."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdasgd_jax import Config
from pdasgd_jax.delays import CommModel, DelayModel, from_flops
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models.mlp import Flatten
from pdasgd_jax.runners import select_runner
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.async_local import run_async_local_simulated
from pdasgd_jax.simulate.averaging_clock import Fragment, averaging_schedule
from pdasgd_jax.stages import from_modules

COMMON = dict(replicas=4, period=4, batch_size=8, epochs=0.25, seed=3, eval_every=128, progress=False)


def _clock(num_stages=3, beta=1e6):
    """1 ms of compute per stage and step; a network of ``beta`` bytes/s."""
    return dataclasses.replace(
        from_flops([1e6] * num_stages, rate_flops_per_s=1e9, backward_factor=0.0), comm=CommModel(1e-4, beta)
    )


CLOCK = _clock()


def _run(config, model=None, timing=None):
    exp = Experiment.from_config(config.validate(), model=model)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=config.eval_every, progress=False)
    if config.simulate and config.algo == "async-local":
        return exp, run_async_local_simulated(exp, metrics, timing=timing), metrics.rows
    if config.simulate:
        return exp, run_simulated(exp, metrics, timing=timing), metrics.rows
    return exp, select_runner(config)(exp, metrics), metrics.rows


def _rows(rows):
    """Metrics rows without their wall-clock times."""
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]


def _assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _two_even_stages():
    """Two stages of about the same bytes (1040 and 1090 parameters) for the digits' 8x8 inputs."""
    rngs = nnx.Rngs(0)
    return from_modules(
        [
            nnx.Sequential(Flatten(), nnx.Linear(64, 16, rngs=rngs), nnx.relu),
            nnx.Sequential(nnx.Linear(16, 40, rngs=rngs), nnx.relu, nnx.Linear(40, 10, rngs=rngs)),
        ]
    )


@pytest.mark.parametrize("algo, extra", [("local", {}), ("dasgd", dict(delay_steps=2))])
def test_one_fragment_is_the_whole_model_on_the_clock(algo, extra):
    base = Config(algo=algo, simulate=True, **COMMON, **extra)
    _, plain, plain_rows = _run(base, timing=CLOCK)
    _, one, one_rows = _run(dataclasses.replace(base, fragments=1), timing=CLOCK)
    _assert_bitwise(plain.params, one.params)
    assert _rows(plain_rows) == _rows(one_rows)
    assert one.extra["fragments"] == 1 and one.extra["peak_network_bytes"] == sum(one.extra["fragment_bytes"])


def _reference(exp, num_workers, period, steps):
    """Local SGD with every stage averaged on its own (d = 0): stage m of M is set to the
    workers' mean after ``t`` local steps whenever ``t % H == floor(m H / M)``."""
    model, v, tx = exp.model, exp.variables, exp.tx
    step = jax.jit(make_train_step(model, tx))
    streams = [
        exp.train_stream(exp.config.batch_size, shard_index=w, num_shards=num_workers) for w in range(num_workers)
    ]
    workers = [TrainState(v.params, v.states, init_opt_states(tx, v.params))] * num_workers
    num_stages = model.num_stages
    for t in range(steps):
        for m in range(num_stages):
            if t % period == m * period // num_stages:
                mean = jax.tree.map(
                    lambda *xs: jnp.mean(jnp.stack(xs), 0), *[(w.params[m], w.states[m]) for w in workers]
                )
                workers = [
                    w._replace(
                        params=(*w.params[:m], mean[0], *w.params[m + 1 :]),
                        states=(*w.states[:m], mean[1], *w.states[m + 1 :]),
                    )
                    for w in workers
                ]
        workers = [step(w, *next(s))[0] for w, s in zip(workers, streams, strict=True)]
    return jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs), 0), *[w.params for w in workers])


@pytest.mark.parametrize("simulate", [False, True])
def test_a_fragment_per_stage_averages_each_stage_at_its_offset(simulate):
    config = Config(algo="local", fragments=3, simulate=simulate, **COMMON)
    exp, result, _ = _run(config, timing=CLOCK if simulate else None)
    expected = _reference(exp, config.replicas, config.period, result.step)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


REPLICATED = dict(
    simulate=True, replication="replicas", devices=2, replicas=2, period=4, delay_steps=2, batch_size=16,
    epochs=0.25, seed=2, eval_every=128, progress=False,
)  # fmt: skip


@pytest.mark.parametrize("algo", ["asgd", "pdasgd"])
def test_one_fragment_is_the_whole_model_in_replicated_runs(algo):
    base = Config(algo=algo, **REPLICATED)
    _, plain, plain_rows = _run(base, timing=CLOCK)
    _, one, one_rows = _run(dataclasses.replace(base, fragments=1), timing=CLOCK)
    _assert_bitwise(plain.params, one.params)
    assert _rows(plain_rows) == _rows(one_rows)
    assert one.extra["fragments"] == 1


def test_replicated_fragments_merge_each_at_its_offset_and_halve_the_peak():
    """An all-reduce (under 1 ms) shorter than the H / K = 2 jobs between two fragments' snapshots:
    the network carries one fragment at a time."""
    model, timing = _two_even_stages(), _clock(2, beta=1e7)
    base = Config(algo="asgd", **REPLICATED)
    _, one, _ = _run(base, model=model, timing=timing)
    _, two, rows = _run(dataclasses.replace(base, fragments=2), model=model, timing=timing)
    assert two.extra["fragments"] == 2 and two.extra["fragment_rounds"][0] >= 1
    assert two.extra["fragment_bytes"] == [4 * 1040, 4 * 1090]
    assert one.extra["peak_network_bytes"] == 4 * 2130
    assert two.extra["peak_network_bytes"] <= 0.52 * one.extra["peak_network_bytes"]
    assert np.isfinite(rows[-1]["test_loss"])


@pytest.mark.parametrize("delay", [0, 3])
def test_asgd_groups_of_one_thread_with_fragments_are_local_sgd_with_fragments(delay):
    """One thread per group and no delays: each group steps in lockstep, so replicated ASGD
    with K = 3 fragments is local SGD / DaSGD with K = 3 over D = G workers (d = 3 carries the
    last fragment's average into the next round)."""
    groups, steps, batch = 2, 8, 16
    common = dict(
        simulate=True, period=4, delay_steps=delay, fragments=3, optimizer="momentum", lr=0.05, batch_size=batch,
        epochs=groups * batch * steps / 1438, seed=1, eval_every=10**9, progress=False,
    )  # fmt: skip
    timing = _clock(3, beta=1e7)
    _, ours, _ = _run(
        Config(algo="asgd", replication="replicas", devices=groups, replicas=groups, **common), timing=timing
    )
    _, theirs, _ = _run(Config(algo="local" if delay == 0 else "dasgd", replicas=groups, **common), timing=timing)
    assert (ours.step, theirs.step) == (groups * steps, steps)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


ASYNC = dict(
    algo="async-local", simulate=True, period=4, batch_size=16, epochs=0.25, seed=4, eval_every=128, progress=False
)


@pytest.mark.parametrize("local_steps", ["fixed", "dynamic"])
def test_one_fragment_is_the_whole_model_in_async_local(local_steps):
    base = Config(replicas=2, local_steps=local_steps, **ASYNC)
    _, plain, plain_rows = _run(base, timing=CLOCK)
    _, one, one_rows = _run(dataclasses.replace(base, fragments=1), timing=CLOCK)
    _assert_bitwise(plain.params, one.params)
    assert _rows(plain_rows) == _rows(one_rows)
    assert (
        one.extra["fragments"] == 1
        and one.extra["async_local"]["per_replica"] == plain.extra["async_local"]["per_replica"]
    )


def test_async_local_fragments_of_one_replica_train_its_own_model():
    """One replica: the server takes each fragment's pseudo-gradient whole and sends the
    replica its own stages back, so every K trains the model plain local steps do."""
    base = Config(replicas=1, **ASYNC)
    _, one, _ = _run(base, timing=CLOCK)
    _, three, _ = _run(dataclasses.replace(base, fragments=3), timing=CLOCK)
    # Three exchanges a round, and the two fragments the replica moved after its last one.
    assert (
        three.step == one.step
        and three.extra["async_local"]["arrivals"] == 3 * one.extra["async_local"]["arrivals"] + 2
    )
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(three.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_async_local_fragments_halve_the_peak_and_keep_training():
    model, timing = _two_even_stages(), _clock(2)
    base = Config(replicas=2, outer_optimizer="nesterov", outer_lr=0.5, **ASYNC)
    _, one, _ = _run(base, model=model, timing=timing)
    _, two, rows = _run(dataclasses.replace(base, fragments=2), model=model, timing=timing)
    assert two.extra["fragment_bytes"] == [4 * 1040, 4 * 1090]
    assert two.extra["peak_network_bytes"] <= 0.52 * one.extra["peak_network_bytes"]
    assert two.extra["async_local"]["arrivals"] == 2 * one.extra["async_local"]["arrivals"] + 2
    assert np.isfinite(rows[-1]["test_loss"]) and rows[-1]["test_accuracy"] > 0.2


def test_dasgd_fragments_halve_the_network_peak_on_the_clock():
    """Two stages of about equal bytes: each fragment's all-reduce is charged on its own, and
    with one ending before the next starts the network carries about half the bytes at once."""
    model, timing = _two_even_stages(), _clock(2, beta=1e7)
    base = Config(algo="dasgd", delay_steps=1, simulate=True, **COMMON)
    _, one, _ = _run(base, model=model, timing=timing)
    _, two, _ = _run(dataclasses.replace(base, fragments=2), model=model, timing=timing)
    assert (one.extra["fragments"], two.extra["fragments"]) == (1, 2)
    assert one.extra["peak_network_bytes"] == 4 * 2130
    assert two.extra["peak_network_bytes"] == 4 * 1090  # the larger fragment's


def test_the_clock_charges_each_fragment_and_sums_overlapping_ones():
    """A network too slow for the offsets (d = H): fragment 1's all-reduce starts while fragment
    0's is in flight, and the peak is their sum; each costs its own bytes."""
    timing = dataclasses.replace(
        from_flops([1e6, 1e6], rate_flops_per_s=1e9, backward_factor=0.0), comm=CommModel(0.0, 1e3)
    )
    kw = dict(num_workers=2, steps=8, period=4, delay=4, model_nbytes=2000, seed=0)
    halves = [Fragment(0, (0, 1), 1000, 0.5), Fragment(2, (1, 2), 1000, 0.5)]
    whole = averaging_schedule(timing, DelayModel(), **kw)
    split = averaging_schedule(timing, DelayModel(), fragments=halves, **kw)
    assert [b for _, _, b in split.transfers] == [1000] * 4
    assert [e - s for s, e, _ in split.transfers] == pytest.approx([1.0] * 4)  # 2 (D - 1) / D * 1000 B / 1 kB/s
    assert whole.peak_bytes == 2000 and split.peak_bytes == 2000  # 1 s all-reduces, 4 ms between offsets


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(algo="local", fragments=0), r"--fragments 0 must be an integer >= 1"),
        (dict(algo="sync", fragments=2), r"--fragments 2: .* --algo sync does not use them"),
        (dict(algo="asgd", fragments=2), r"--fragments 2: .* --algo asgd does not use them"),
        (dict(algo="asgd", replication="replicas", devices=2, replicas=2, fragments=2), r"simulator only"),
        (dict(algo="async-local", replicas=2, fragments=2), r"simulator only"),
    ],
)
def test_bad_fragments_are_refused_by_the_config(changes, message):
    with pytest.raises(ConfigError, match=message):
        Config(progress=False, **changes).validate()


@pytest.mark.parametrize(
    "changes",
    [
        dict(algo="local"),
        dict(algo="dasgd", simulate=True),
        dict(algo="asgd", simulate=True, replication="replicas", devices=2, replicas=2),
        dict(algo="async-local", simulate=True),
    ],
)
def test_more_fragments_than_stages_are_refused_before_any_step(changes):
    config = Config(**{**COMMON, "replicas": 2, **changes, "fragments": 4})
    with pytest.raises(ConfigError, match=r"--fragments 4 must be an integer in \[1, 3\]"):
        _run(config, timing=CLOCK)
