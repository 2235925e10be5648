"""The simulator-speed benchmark (``benchmarks/scripts/compiled_sim_speed.py``) on a tiny run:
every mode in every round, in an order shuffled per round, the simulated paths landing on the
event run's parameters and the scan on the SGD loop's (``_repeat`` checks both)."""

import pytest

from benchmarks.scripts import compiled_sim_speed
from pdasgd_jax.config import Config

pytestmark = pytest.mark.harness


def test_rounds_run_every_mode_in_a_shuffled_order_and_land_on_the_reference_parameters():
    config = Config(
        algo="pdasgd",
        simulate=True,
        replicas=2,
        delay_model="exponential",
        delay_mean=1.0,
        batch_size=32,
        epochs=2.0,
        progress=False,
    ).validate()
    out = compiled_sim_speed.measure(config, repeats=2)
    orders = [run["order"] for run in out["runs"]]
    assert all(sorted(order) == sorted(compiled_sim_speed.MODES) for order in orders)
    assert orders[0] != orders[1]  # seeded by the round: not one order rotated
    for run in out["runs"]:
        assert run["pipelined_chunks"] and run["steps_per_job"] >= 1
        assert all(run[mode] > 0 for mode in ("sgd", "event", "compiled", "pipelined", "scan"))
    assert out["median"]["pipelined/sgd"] > 0 and out["batch_size"] == 32
