"""The compiled simulator with its schedule recorded while its numerics run (``pipelined``)
against the whole plan's run (``run_compiled``): bitwise the same parameters at every cut,
the same losses, staleness and utilisation, whatever the chunks; a chunk that does not fit
the rings sized on the first ones runs the whole plan again from the start, reporting each
cut once (checkpoints and resume through ``train``: test_compiled_checkpoints.py)."""

import jax
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import pipelined
from pdasgd_jax.simulate.compiled import run_compiled
from pdasgd_jax.simulate.pipelined import run_pipelined
from pdasgd_jax.simulate.schedule_plan import record_schedule

TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
CUTS = [7, 20, 30]


@pytest.fixture(scope="module")
def base():
    return Experiment.from_config(
        Config(algo="pdasgd", simulate=True, epochs=0.5, batch_size=16, delay_model="exponential", progress=False)
    )


def _ends(run, exp, **kwargs):
    """``run`` with an ``on_segment`` keeping each cut's jobs done, time, losses and parameters."""
    ends = []

    def keep(end):
        ends.append(
            (end.done, end.virtual_time, np.asarray(end.losses), [np.asarray(x) for x in jax.tree.leaves(end.params)])
        )

    return run(exp, on_segment=keep, **kwargs), ends


def _assert_same_ends(a, b):
    assert [e[:2] for e in a] == [e[:2] for e in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x[2], y[2])
        for p, q in zip(x[3], y[3], strict=True):
            np.testing.assert_array_equal(p, q)


def _whole(exp, **kwargs):
    return run_compiled(exp, record_schedule(exp, TIMING, stops_at=CUTS), cuts=CUTS, **kwargs)


@pytest.mark.parametrize(
    "algo, replicas, chunk_jobs",
    [("asgd", 3, 4), ("pdasgd", 4, 1), ("pdasgd", 4, 64), ("pdasgd-block", 3, 4)],
)
def test_chunks_land_bitwise_on_the_whole_plan(base, algo, replicas, chunk_jobs):
    exp = base.with_config(algo=algo, replicas=replicas)
    whole, whole_ends = _ends(_whole, exp)
    (run, schedule), ends = _ends(lambda e, **kw: run_pipelined(e, TIMING, cuts=CUTS, chunk_jobs=chunk_jobs, **kw), exp)
    assert run.plan is None  # the chunks ran, none went past the rings sized on the first ones
    _assert_same_ends(ends, whole_ends)
    assert run.done == whole.done == len(schedule.done)
    recorded = record_schedule(exp, TIMING, stops_at=CUTS)
    assert schedule.staleness.summary() == recorded.staleness.summary()
    assert (schedule.utilisation, schedule.started) == (recorded.utilisation, recorded.started)
    np.testing.assert_array_equal(schedule.done_times, recorded.done_times)


def test_a_chunk_past_the_rings_runs_the_whole_plan_again_reporting_each_cut_once(base, monkeypatch):
    exp = base.with_config(replicas=4)
    monkeypatch.setattr(pipelined, "_margin", lambda need: need)  # rings just wide enough for the first chunk
    monkeypatch.setattr(pipelined, "FIRST_CHUNK_JOBS_PER_REPLICA", 0)
    _, whole_ends = _ends(_whole, exp)
    (run, _), ends = _ends(lambda e, **kw: run_pipelined(e, TIMING, cuts=CUTS, chunk_jobs=2, **kw), exp)
    assert run.plan is not None  # it ran the whole plan
    _assert_same_ends(ends, whole_ends)


def test_a_run_stopped_at_a_cut_stops_there(base):
    exp = base.with_config(replicas=4)
    seen = []

    def until_second_cut(end):
        seen.append(end.done)
        return end.done < CUTS[1]

    run, schedule = run_pipelined(exp, TIMING, cuts=CUTS, chunk_jobs=3, on_segment=until_second_cut)
    whole = _whole(exp, on_segment=lambda end: end.done < CUTS[1])
    assert run.done == whole.done == CUTS[1] and seen == CUTS[:2]
    for p, q in zip(jax.tree.leaves(run.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    assert len(schedule.done) < exp.total_examples // 16  # the clock was not recorded to its end


def test_what_it_runs(base):
    assert pipelined.covers(base)
    assert not pipelined.covers(base.with_config(backward_weights="live"))
    assert not pipelined.covers(base.with_config(algo="lpp", replicas=2, devices=1))
    with pytest.raises(ValueError, match="chunk_jobs must be at least 1, not 0"):
        run_pipelined(base, TIMING, chunk_jobs=0)
