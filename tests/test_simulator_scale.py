"""The simulator's set-up, plots and reports scale with the devices W as O(W + stages x bins):
one scan of the devices per placement, one cost table per class of alike devices, a random
generator only for a worker that draws, a bounded staleness histogram; and none of it changes
what a run computes."""

import hashlib
import itertools
import types

import numpy as np
import optax
import pytest

from pdasgd_jax import data, models
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel, rng_for
from pdasgd_jax.delays.streams import LazyStream
from pdasgd_jax.executor import EventLog, StageExecutor
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.placement import Placement
from pdasgd_jax.plots import STALENESS_BINS, plot_staleness, staleness_bins
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.resume import AbstractKernels
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation
from pdasgd_jax.store import ParameterStore

TIMING = dict(forward=(0.25, 0.5, 1.0), backward=(0.5, 1.0, 2.0), update=(0.125, 0.25, 0.5), loss=0.25)


def _fake_executor(stages: int) -> types.SimpleNamespace:
    """What ``Simulation.__init__`` reads of an executor: the store's stages and their bytes."""
    store = types.SimpleNamespace(
        num_stages=stages, read_params=lambda m: types.SimpleNamespace(value=(np.zeros(256, np.float32),))
    )
    return types.SimpleNamespace(store=store, live=False, fused=True)


def _setup(devices: int, factors: tuple[float, ...] = ()) -> Simulation:
    timing = TimingModel(**TIMING, worker_factors=factors, comm=CommModel(1e-3, 1e6))
    return Simulation(
        Scheduler(),
        _fake_executor(3),
        timing,
        DelayModel(),
        seed=0,
        batches=iter(()),
        max_jobs=0,
        num_devices=devices,
        on_job_done=lambda job: None,
    )


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_set_up_scans_the_devices_once_and_costs_each_class_of_devices_once(monkeypatch):
    """Per-device work grows linearly with W (one factor look-up per device, for the
    placement's homes and for the cost classes); kernel costs are computed per class of
    devices alike (speed factor, stages at home), the same number at W = 64 as at W = 512."""
    scans = _count_calls(monkeypatch, Placement, "device_factor")
    costs = _count_calls(monkeypatch, TimingModel, "forward_time")
    counts = {}
    for w in (64, 512):
        scans[0] = costs[0] = 0
        sim = _setup(w, factors=(1.0,) * (w - 2) + (3.0, 3.0))
        counts[w] = scans[0], costs[0]
        assert len({id(c) for c in sim.costs}) == 5  # 3 homes, other fast devices, the stragglers
    assert counts[64][0] <= 2 * 64 and counts[512][0] <= 2 * 512
    assert counts[512][1] == counts[64][1] == 5 * 3


@pytest.mark.parametrize("factors", [(), (2.0, 1.0, 2.0, 1.0, 1.5, 3.0, 1.0), (1.0, 1.0, 1.0, 4.0)])
def test_shared_costs_equal_each_devices_own(factors):
    sim = _setup(7, factors)
    for device in sim.devices:
        assert sim.costs[device.index] == sim._device_costs(device)
        assert sim.costs[device.index].transfer == tuple(sim.transfer_time(m, device) for m in range(3))
        homes = tuple(home.index for home in sim.homes)
        for layerwise in (False, True):
            own = sim.timing.pipeline_compute(device.index, homes, live=False, layerwise=layerwise)
            assert sim.pipeline_compute(device, layerwise=layerwise) == own


def test_a_placements_home_devices_are_found_once(monkeypatch):
    scans = _count_calls(monkeypatch, Placement, "device_factor")
    p = Placement(1000, 1000, 7, (2.0,) * 3)
    assert p.homes() == tuple(3 + m for m in range(7))
    assert [p.is_remote(m, d) for m in range(7) for d in range(1000)].count(False) == 7
    assert scans[0] == 1000
    assert p == Placement(1000, 1000, 7, (2.0,) * 3) and hash(p) == hash(Placement(1000, 1000, 7, (2.0,) * 3))


def test_a_lazy_stream_draws_bitwise_what_its_generator_draws():
    lazy = LazyStream(5, "delay", "d3/forward0")
    assert lazy._generator is None  # nothing made before the first draw
    eager = rng_for(5, "delay", "d3/forward0")
    assert [lazy.exponential(1.0) for _ in range(5)] == [eager.exponential(1.0) for _ in range(5)]
    assert lazy.random(4).tobytes() == eager.random(4).tobytes()
    assert DelayModel("lognormal", 0.3).job_idle(lazy, 1.0) == DelayModel("lognormal", 0.3).job_idle(eager, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        LazyStream(-1, "delay")


# Digests of every event (versions, staleness, worker, virtual time), update span and cost
# table of runs over several devices, with stragglers, transfers and each delay model, as the
# simulator computed them before its set-up was made linear in the devices.
SCHEDULES = [
    ("c11ae4d130f32be2", "asgd", 8, 12, (1.0, 1.0, 2.0, 1.0, 1.0, 3.0), DelayModel("exponential", 0.5), "stashed"),
    (
        "d6b53a2c6fedc544",
        "pdasgd",
        8,
        12,
        (2.0, 1.0, 2.0, 1.0, 1.5, 3.0),
        DelayModel("exponential", 0.5, per="job"),
        "stashed",
    ),
    ("bd2fa13d27ae3611", "pdasgd", 6, 6, (), DelayModel("straggler", 0.1, prob=0.3, factor=2.0), "stashed"),
    ("f6e47af5ac2a28a2", "pdasgd-block", 5, 9, (1.0, 1.0, 1.0, 1.0, 4.0), DelayModel("lognormal", 0.3), "stashed"),
    ("4156cc7f3d70ae6e", "pdasgd", 4, 4, (), DelayModel("uniform", 0.2), "live"),
]


@pytest.fixture(scope="module")
def world():
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    tx = optax.sgd(0.05, momentum=0.9)
    batch = next(data.train_batches(ds.train, 8, seed=0, epoch=0))
    return variables, tx, AbstractKernels(StageKernels(model, tx)), batch


@pytest.mark.parametrize("digest, algo, devices, groups, factors, delay, weights", SCHEDULES)
def test_multi_device_schedules_are_unchanged(world, digest, algo, devices, groups, factors, delay, weights):
    v, tx, kernels, batch = world
    sched, log, spans = Scheduler(), EventLog(), []
    store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), kernels.apply_update)
    ex = StageExecutor(kernels, store, log=log, clock=lambda: sched.now, backward_weights=weights, fuse_jobs=True)
    timing = TimingModel(**TIMING, worker_factors=factors, comm=CommModel(1e-3, 1e6))
    sim = Simulation(
        sched,
        ex,
        timing,
        delay,
        seed=3,
        batches=itertools.repeat(batch),
        max_jobs=40,
        num_devices=devices,
        groups=groups,
        on_job_done=lambda job: None,
        on_update=spans.append,
    )
    if algo == "asgd":
        policies.spawn_asgd(sim)
    else:
        policies.spawn_pdasgd(sim, forward_workers=2, backward_workers=2, queue=2, layerwise=algo == "pdasgd")
    end = sched.run()
    keys = ("job", "stage", "batch_id", "params_version", "state_version", "live_version", "replaced_version")
    fields = [(e.kind.value, *(getattr(e, k) for k in keys), e.staleness, e.worker, e.time.hex()) for e in log.events]
    costs = [tuple(map(repr, c)) for c in sim.costs]
    record = repr([*fields, [tuple(s) for s in spans], costs, end.hex()])
    assert hashlib.sha256(record.encode()).hexdigest()[:16] == digest


# Staleness plots --------------------------------------------------------------------------------


def _summary(histograms):
    return {"staleness": {"per_stage": [{"mean": 1.0, "max": max(len(h) - 1, 0), "histogram": h} for h in histograms]}}


def test_a_wide_staleness_histogram_is_drawn_in_bounded_bins():
    wide = [int(c) for c in np.random.default_rng(0).integers(0, 9, 100_000)]
    fig = plot_staleness(_summary([wide, [3, 1], []]))
    axes = fig.axes
    assert len(axes[0].patches) <= STALENESS_BINS
    assert sum(p.get_height() for p in axes[0].patches) == sum(wide)
    assert [p.get_height() for p in axes[1].patches] == [3, 1]  # a small range: one bar per value
    assert [p.get_x() + p.get_width() / 2 for p in axes[1].patches] == [0, 1]
    assert not axes[2].patches


@pytest.mark.parametrize("values", [0, 1, 49, 50, 51, 100, 101, 12_345])
def test_staleness_bins_keep_every_update_in_bins_of_equal_width(values):
    counts = list(range(1, values + 1))
    lows, sums, width = staleness_bins(counts)
    assert len(lows) <= STALENESS_BINS and sums.sum() == sum(counts)
    assert (width == 1) == (values <= STALENESS_BINS)
    assert list(lows) == list(range(0, values, width))
    for low, total in zip(lows, sums):
        assert total == sum(counts[low : low + width])
