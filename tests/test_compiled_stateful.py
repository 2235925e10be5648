"""Models with non-trainable state (BatchNorm) on the compiled simulator: the forward's new
state of each stage committed as the event path commits it, bitwise the event-by-event run
(parameters, states, metrics rows), resumed compiled from its checkpoints too."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, data, from_modules
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models.cnn import cnn_stages
from pdasgd_jax.models.common import Flatten
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.compiled import make_plan, run_compiled
from pdasgd_jax.simulate.compiled_run import simulate_compiled
from pdasgd_jax.simulate.schedule_plan import check_supported, record_schedule
from pdasgd_jax.simulate.stateful_plan import StatefulPlan

TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)


def _bn_mlp():
    rngs = nnx.Rngs(0)
    return from_modules(
        [
            nnx.Sequential(Flatten(), nnx.Linear(64, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs), nnx.relu),
            nnx.Sequential(nnx.Linear(32, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs), nnx.relu),
            nnx.Linear(32, 10, rngs=rngs),
        ]
    )


@pytest.fixture(scope="module")
def dataset():
    return data.load_dataset("digits")


def _exp(dataset, model_and_variables, **changes):
    fields = dict(algo="pdasgd", simulate=True, batch_size=16, epochs=0.3, progress=False) | changes
    model, v = model_and_variables
    return Experiment(Config(**fields).validate(), dataset, model, v, optax.sgd(0.05, momentum=0.9))


def _metrics(exp, eval_every=10**9, out=None):
    return MetricsLog(
        exp.evaluate, total_examples=exp.total_examples, eval_every=eval_every, progress=False, out_dir=out
    )


def _assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


DELAYS = {"delay_model": "exponential", "delay_mean": 1.0}


@pytest.mark.parametrize(
    "changes",
    [
        {"replicas": 1},
        {"replicas": 4, **DELAYS},
        {"algo": "asgd", "replicas": 3, **DELAYS},
        {"algo": "pdasgd-block", "replicas": 3, **DELAYS},
        {"replicas": 4, "devices": 2, "queue": 1, "comm_latency": 0.375, **DELAYS},
    ],
)
def test_batchnorm_lands_bitwise_on_the_event_by_event_run(dataset, changes):
    exp = _exp(dataset, _bn_mlp(), **changes)
    log = EventLog()
    result = run_simulated(exp, _metrics(exp), timing=TIMING, log=log)
    schedule = record_schedule(exp, TIMING)
    fields = lambda events: [
        (e.kind, e.job, e.stage, e.params_version, e.state_version, e.replaced_version) for e in events
    ]
    assert fields(schedule.events) == fields(log.events)
    assert schedule.staleness.summary() == result.extra["staleness"]
    plan = make_plan(schedule, [10, 20])
    assert isinstance(plan, StatefulPlan)
    run = run_compiled(exp, schedule, cuts=[10, 20])
    _assert_bitwise((run.params, run.states), (result.params, result.states))


def test_evaluations_read_the_states_of_their_instant(dataset):
    exp = _exp(dataset, _bn_mlp(), replicas=4, **DELAYS)
    expected = _metrics(exp, eval_every=100)
    result = run_simulated(exp, expected, timing=TIMING)
    metrics = _metrics(exp, eval_every=100)
    compiled, _, _, _ = simulate_compiled(exp, metrics, TIMING)
    keys = ("step", "examples", "virtual_time", "loss", "test_loss", "test_accuracy")
    assert len(metrics.rows) == len(expected.rows) > 3
    assert [[r[k] for k in keys] for r in metrics.rows] == [[r[k] for k in keys] for r in expected.rows]
    _assert_bitwise((compiled.params, compiled.states), (result.params, result.states))


class Interrupted(Exception):
    pass


def test_a_checkpointed_run_resumes_compiled_bitwise(dataset, tmp_path, monkeypatch):
    exp = _exp(dataset, _bn_mlp(), replicas=4, **DELAYS)
    whole = _metrics(exp, eval_every=100)
    result = run_simulated(exp, whole, timing=TIMING)
    out = str(tmp_path)
    save = RunCheckpointer.save

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        if step >= 15:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        checkpointer = RunCheckpointer(out, fresh=True)
        with pytest.raises(Interrupted):
            simulate_compiled(exp, _metrics(exp, 100, out), TIMING, checkpointer=checkpointer)
        checkpointer.close()
    checkpointer = RunCheckpointer(out)
    metrics = MetricsLog(
        exp.evaluate, total_examples=exp.total_examples, eval_every=100, progress=False, out_dir=out, resume=True
    )
    resumed, _, _, _ = simulate_compiled(exp, metrics, TIMING, checkpointer=checkpointer)
    checkpointer.close()
    assert 15 <= metrics.resumed_from_step < resumed.step == result.step
    _assert_bitwise((resumed.params, resumed.states), (result.params, result.states))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]
    assert strip(metrics.rows) == strip(whole.rows)


def test_a_batchnorm_cnn_stays_within_float_rounding(dataset):
    """XLA compiles a convolution inside the loop otherwise than as a program of its own:
    the compiled run of a convolutional model lands within float rounding of the event run."""
    stages = cnn_stages((8, 8, 1), 10, channels=(8, 8), hidden=16, batch_norm=True, rngs=nnx.Rngs(0))
    exp = _exp(dataset, from_modules(stages), replicas=3, **DELAYS)
    result = run_simulated(exp, _metrics(exp), timing=TIMING)
    run = run_compiled(exp, record_schedule(exp, TIMING))
    for x, y in zip(jax.tree.leaves((run.params, run.states)), jax.tree.leaves((result.params, result.states))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)


def test_live_weights_with_batchnorm_are_refused(dataset):
    with pytest.raises(ValueError, match="stashed weights, not live"):
        check_supported(_exp(dataset, _bn_mlp(), replicas=2, backward_weights="live"))
