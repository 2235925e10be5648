"""The device concurrency model on the clock: a device runs up to ``len(curve)`` programs at
once with total throughput ``g_n`` (processor sharing), the same for every algorithm; a
number ``c`` is the curve ``min(n, c)``, so the default serial device (c = 1) is unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config, program_timing, train_and_evaluate
from pdasgd_jax.cli import main
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.scheduler import Device, Kernel, Scheduler, Sleep

TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)


def test_a_number_is_the_curve_min_n_c():
    assert TimingModel((1.0,), (1.0,), (0.0,), concurrency=2.5).concurrency_curve == (1.0, 2.0, 2.5)
    assert TimingModel((1.0,), (1.0,), (0.0,)).concurrency_curve == (1.0,)
    curve = TimingModel((1.0,), (1.0,), (0.0,), concurrency=[1, 1.5, 1.8])
    assert curve.concurrency == (1.0, 1.5, 1.8) and curve.device_slots == 3
    assert [curve.kernel_rate(n) for n in (1, 2, 3, 5)] == [1.0, 0.75, 0.6, 0.36]


@pytest.mark.parametrize(
    ("curve", "message"),
    [
        ((1.5, 2.0), "must start with 1"),
        ((1.0, 2.5), r"throughput 2.5 of 2 concurrent kernels must be in \(0, 2\]"),
        ((1.0, 0.0), r"must be in \(0, 2\]"),
        ((), "must start with 1"),
    ],
)
def test_a_curve_that_cannot_be_is_refused(curve, message):
    with pytest.raises(ValueError, match=message):
        TimingModel((1.0,), (1.0,), (0.0,), concurrency=curve)


def test_kernels_share_the_device_by_the_curve():
    """Two kernels of 3 s started together on a device of curve (1, 1.5): each runs at 0.75,
    both end at 4 s; a third, started at 4 s alone, runs at full speed."""
    sched = Scheduler()
    device = Device(sched, 0, dataclasses.replace(TIMING, concurrency=(1.0, 1.5)))
    ends = {}

    def worker(name, start):
        if start:
            yield Sleep(start)
        yield Kernel(device, 3.0)
        ends[name] = sched.now

    for name, start in (("a", 0.0), ("b", 0.0), ("c", 4.0)):
        sched.spawn(name, worker(name, start))
    sched.run()
    assert ends == {"a": 4.0, "b": 4.0, "c": 7.0}


@pytest.fixture(scope="module")
def exp():
    return Experiment.from_config(Config(algo="pdasgd", simulate=True, batch_size=16, epochs=0.1, progress=False))


def _run(exp, timing, **changes):
    run = exp.with_config(**changes)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    return run_simulated(run, metrics, timing=timing)


@pytest.mark.parametrize("algo", ["pdasgd", "asgd", "lpp"])
def test_the_curve_of_a_number_runs_the_same_schedule_as_the_number(exp, algo):
    """concurrency=2.0 and the curve (1, 2) are one model: bitwise the same run."""
    layout = dict(replicas=2, devices=1) if algo != "lpp" else dict(replicas=2, devices=1, period=2)
    a = _run(exp, dataclasses.replace(TIMING, concurrency=2.0), algo=algo, **layout)
    b = _run(exp, dataclasses.replace(TIMING, concurrency=(1.0, 2.0)), algo=algo, **layout)
    assert a.extra["virtual_time"] == b.extra["virtual_time"]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("algo", "gains"), [("pdasgd", True), ("asgd", True), ("lpp", False)])
def test_a_device_that_gains_from_concurrency_speeds_the_programs_that_can_overlap(exp, algo, gains):
    """Several workers on one device and one store: a gain g2 > 1 shortens the virtual time
    where their programs do not wait for each other's data, and a serial device (the
    default) is what c = 1 always was. The clock reads at dispatch, as the runtime does
    (algorithms.md §5), so a program waits for the updates dispatched before it: PD-ASGD's
    forward and backward workers overlap; an ASGD job waits for the other thread's update,
    but its per-stage update programs, dispatched together, overlap; two LPP-SGD threads run
    one after the other, each reading the other's booked update, as on a serial device."""
    layout = dict(replicas=2, devices=1) if algo != "lpp" else dict(replicas=2, devices=1, period=2)
    serial = _run(exp, TIMING, algo=algo, **layout)
    same = _run(exp, dataclasses.replace(TIMING, concurrency=(1.0,)), algo=algo, **layout)
    gain = _run(exp, dataclasses.replace(TIMING, concurrency=(1.0, 1.6, 1.9)), algo=algo, **layout)
    assert same.extra["virtual_time"] == serial.extra["virtual_time"]
    if gains:
        assert gain.extra["virtual_time"] < serial.extra["virtual_time"]
    else:
        assert gain.extra["virtual_time"] == serial.extra["virtual_time"]


def test_the_flag_states_a_curve_and_the_summary_says_which_was_used(tmp_path):
    summary = train_and_evaluate(
        Config(
            algo="pdasgd",
            simulate=True,
            replicas=2,
            devices=1,
            epochs=0.1,
            progress=False,
            device_concurrency="1,1.6",
            timing=None,
        )
    )
    assert summary["device_concurrency"] == {"curve": [1.0, 1.6], "source": "stated"}
    serial = train_and_evaluate(Config(algo="pdasgd", simulate=True, replicas=2, devices=1, epochs=0.1, progress=False))
    assert serial["device_concurrency"] == {"curve": [1.0], "source": "serial (default)"}


@pytest.mark.parametrize("spec", ["2,1", "1,2.5", "abc", "0", ""])
def test_a_curve_that_cannot_be_is_bad_input(spec, capsys):
    assert main(["train", "--simulate", "--algo", "pdasgd", "--device-concurrency", spec]) == 2
    assert f"--device-concurrency {spec!r} is not allowed" in capsys.readouterr().err


def test_the_flag_needs_the_simulator(capsys):
    assert main(["train", "--algo", "pdasgd", "--device-concurrency", "1,1.5"]) == 2
    assert "needs --simulate" in capsys.readouterr().err


def test_the_measured_curve_starts_at_one_and_stays_in_range():
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    curve = program_timing.measure_concurrency_curve(f, jnp.ones((64, 64)), programs=3, repeats=2)
    assert len(curve) == 3 and curve[0] == 1.0 and all(0 < g <= n for n, g in enumerate(curve, 1))
    TimingModel((1.0,), (1.0,), (0.0,), concurrency=curve)  # a curve the timing model takes


def test_a_measured_curve_with_a_timing_that_has_none_is_refused_not_run_serial(exp):
    """``--device-concurrency measure`` with a timing built elsewhere (a serial one) would
    silently run serial devices: refused, naming the way out."""
    with pytest.raises(ValueError, match="carries no measured curve"):
        _run(exp, TIMING, algo="pdasgd", replicas=2, devices=1, device_concurrency="measure")
    measured = dataclasses.replace(TIMING, concurrency=(1.0, 1.3, 1.4))
    assert _run(exp, measured, algo="pdasgd", replicas=2, devices=1, device_concurrency="measure").extra["virtual_time"]
