"""The virtual clock charges each algorithm the program it really runs (issue 15): a job's
fused gradient program for ASGD and LPP-SGD (and one fused update program where the thread
owns every stage), the fused training step for sync, local SGD and DaSGD (and each round's
mean and merge), PD-ASGD's fused forward and fused backward-and-update of a local stage."""

import dataclasses
import functools

import pytest
from flax import nnx

from pdasgd_jax import Config
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models import cnn_stages
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.stages import from_modules

# Dyadic costs for the 3-stage digits MLP whose fused programs cost far less than their
# per-stage kernels, as they do on a launch-bound CPU: per-stage step 10.25, fused job 3,
# fused step 4, PD-ASGD's fused forward 1.5 and fused backward-and-update 1.5 per stage.
PER_STAGE = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
FUSED = dataclasses.replace(
    PER_STAGE, job_gradients=3.0, train_step=4.0, forward_all=1.5, backward_update=(1.5,) * 3, update_all=0.5
)
UPDATES = sum(PER_STAGE.update)


@functools.cache
def _digits_mlp() -> Experiment:
    """One experiment whose compiled kernels every run here shares."""
    return Experiment.from_config(Config(simulate=True, progress=False, batch_size=16, epochs=0.1).validate())


def _simulate(timing=FUSED, model=None, **overrides):
    if model is None:
        exp = _digits_mlp().with_config(**overrides)
    else:
        config = Config(**{"simulate": True, "progress": False, "batch_size": 16, **overrides}).validate()
        exp = Experiment.from_config(config, model=model)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return run_simulated(exp, metrics, timing=timing)


def _busy(result):
    """Device seconds the scheduler recorded per worker."""
    now = result.extra["virtual_time"]
    return {name: share * now for name, share in result.extra["utilisation"]["workers"].items()}


@pytest.mark.parametrize(
    "overrides, per_job",
    [
        # One program per job, then the per-stage updates (a shared store: each on its stage's
        # home): not the 9.5 of per-stage kernels.
        ({"algo": "asgd"}, FUSED.job_gradients + UPDATES),
        # A thread that owns every stage of its store: one program for every stage's update.
        ({"algo": "lpp", "replicas": 2, "devices": 1}, FUSED.job_gradients + FUSED.update_all),
        ({"algo": "asgd", "replication": "replicas", "replicas": 2, "devices": 1}, FUSED.job_gradients + 0.5),
        # PD-ASGD (stashed) as the runtime runs it: one forward program, and each stage's
        # backward and update as one program on its home device (one device: every stage).
        ({"algo": "pdasgd", "forward_workers": 1, "backward_workers": 1, "queue": 1}, 1.5 + 3 * 1.5),
        # Block updates: the fused forward, per-stage backwards, then the per-stage updates.
        ({"algo": "pdasgd-block", "forward_workers": 1, "backward_workers": 1, "queue": 1}, 1.5 + 6.0 + UPDATES),
        # Live weights re-run each stage's forward in its backward: per-stage kernels throughout.
        (
            {"algo": "pdasgd", "backward_weights": "live", "forward_workers": 1, "backward_workers": 1, "queue": 1},
            PER_STAGE.step_compute_time() + sum(PER_STAGE.forward),
        ),
    ],
)
def test_asynchronous_jobs_are_charged_the_program_their_algorithm_runs(overrides, per_job):
    """One device, no delays: the device is never idle, so the run and the busy time the
    scheduler books are the jobs' programs back to back."""
    result = _simulate(**overrides)
    assert result.step == 9
    assert result.extra["virtual_time"] == pytest.approx(9 * per_job)
    assert sum(_busy(result).values()) == pytest.approx(9 * per_job)
    assert result.extra["timing"]["job_gradients"] == FUSED.job_gradients  # reported with the run


def test_an_asgd_job_of_a_stateful_model_is_charged_its_per_stage_kernels():
    """With BatchNorm statistics the runtime cannot fuse a job (``executor.fused`` is off), so
    neither does the clock."""
    bn_cnn = from_modules(cnn_stages((8, 8, 1), 10, channels=(8, 8), hidden=16, batch_norm=True, rngs=nnx.Rngs(0)))
    result = _simulate(model=bn_cnn, algo="asgd", epochs=0.02)
    assert result.step == 2
    assert result.extra["virtual_time"] == pytest.approx(result.step * PER_STAGE.step_compute_time())


@pytest.mark.parametrize(
    "overrides",
    [
        # The delay unit stays one step of per-stage compute, whichever program runs.
        {"algo": "sync", "devices": 4, "batch_size": 64, "delay_model": "constant", "delay_mean": 1.0},
        {"algo": "local", "replicas": 4, "period": 2},
        {"algo": "dasgd", "replicas": 4, "period": 2, "delay_steps": 1},
    ],
)
def test_data_parallel_steps_are_charged_the_fused_training_step(overrides):
    """Free communication: every step of every worker is one fused step, then its delay."""
    result = _simulate(**overrides)
    delay = overrides.get("delay_mean", 0.0) * PER_STAGE.step_compute_time()
    step = FUSED.train_step + delay
    assert result.extra["virtual_time"] == pytest.approx(result.step * step)
    assert result.extra["utilisation"]["devices"] == [pytest.approx(FUSED.train_step / step)] * 4


@pytest.mark.parametrize("algo, delay_steps", [("local", 0), ("dasgd", 1)])
def test_data_parallel_rounds_also_pay_the_mean_and_the_merge(algo, delay_steps):
    """With the averaging's programs calibrated, each round of every worker also runs the mean's
    program and every stage's merge (device work, free communication)."""
    average, merge = 0.75, (0.25,) * 3
    timing = dataclasses.replace(FUSED, average=average, merge=merge)
    result = _simulate(timing, algo=algo, replicas=4, period=2, delay_steps=delay_steps)
    rounds = result.step // 2
    work = rounds * (average + sum(merge))
    assert result.extra["virtual_time"] == pytest.approx(result.step * FUSED.train_step + work)
    busy = (result.step * FUSED.train_step + work) / result.extra["virtual_time"]
    assert result.extra["utilisation"]["devices"] == [pytest.approx(busy)] * 4


def test_a_timing_model_without_fused_costs_charges_the_per_stage_sums():
    assert PER_STAGE.job_gradients_time(0) == PER_STAGE.stage_job_time(0) == 9.5
    assert PER_STAGE.train_step_time(0) == PER_STAGE.step_compute_time() == 10.25
    assert PER_STAGE.update_all_time(0) == UPDATES and FUSED.update_all_time(0) == 0.5
    slow = dataclasses.replace(FUSED, worker_factors=(1.0, 3.0))
    assert (slow.job_gradients_time(1), slow.train_step_time(1), slow.stage_job_time(1)) == (9.0, 12.0, 28.5)
    assert slow.update_all_time(1) == 1.5
    assert TimingModel.from_dict(FUSED.to_dict()) == FUSED
    assert TimingModel.from_dict({k: v for k, v in PER_STAGE.to_dict().items() if k != "train_step"}) == PER_STAGE
    with pytest.raises(ValueError, match=r"train_step cost -1\.0 must be a finite number >= 0"):
        dataclasses.replace(PER_STAGE, train_step=-1.0)
