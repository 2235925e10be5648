"""The compiled loops of per-device stores (LPP-SGD, replicated runs) write their rings and
optimizer stacks in place: the optimised program copies no array of a carried ring's or stack's
shape (a copy per step of every stage's whole ring is what made these loops slow)."""

from __future__ import annotations

import re

import jax
import pytest

from pdasgd_jax import Config
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import compiled
from pdasgd_jax.simulate.run import run_simulated

TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
COPY = re.compile(r"= (\w+\[[0-9,]*\])\{[^}]*\} copy\(")


def _loop_text(monkeypatch, config: Config) -> tuple[str, set[str]]:
    """The optimised text of the run's compiled loop, and the shapes of its carried arrays
    with a leading stacking axis (rings, stacked optimizer states, snapshots)."""
    seen = {}
    original = compiled.loop_program

    def spy(kernels, step):
        program = original(kernels, step)

        def call(*args):
            seen.setdefault("program", program)
            seen.setdefault("args", jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args))
            return program(*args)

        return call

    monkeypatch.setattr(compiled, "loop_program", spy)
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=64, progress=False)
    run_simulated(exp, metrics, timing=TIMING)
    text = seen["program"].lower(*seen["args"]).compile().as_text()
    carry = seen["args"][1]
    dtype = {"float32": "f32", "int32": "s32"}
    shapes = {
        f"{dtype.get(str(a.dtype), str(a.dtype))}[{','.join(map(str, a.shape))}]"
        for a in jax.tree.leaves(carry)
        if a.ndim >= 2 and a.shape[0] > 1
    }
    return text, shapes


@pytest.mark.parametrize(
    "changes",
    [
        dict(algo="lpp", devices=2, replicas=4, period=2),
        dict(algo="pdasgd", replication="replicas", devices=2, replicas=2, period=2),
        dict(algo="pdasgd", replication="replicas", devices=2, replicas=2, period=2, merge="eager"),
        dict(algo="pdasgd", replication="replicas", devices=2, replicas=2, period=2, optimizer="adamw"),
    ],
    ids=["lpp", "replicated", "replicated-eager", "replicated-adamw"],
)
def test_the_loop_copies_no_ring_or_stack(monkeypatch, changes):
    config = Config(simulate=True, numerics="compiled", batch_size=16, epochs=0.1, progress=False, **changes)
    text, shapes = _loop_text(monkeypatch, config)
    assert shapes  # the carry holds rings
    copied = [shape for shape in COPY.findall(text) if shape in shapes]
    assert not copied, f"the loop copies carried arrays of shapes {sorted(set(copied))}"
