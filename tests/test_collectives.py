"""``collectives.allreduce_mean``: the replicated runtime's average across group devices."""

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.collectives import allreduce_mean


def _tree(g: int, device: jax.Device) -> dict:
    """Group ``g``'s tree on ``device``: float leaves of two shapes and an int counter."""
    rng = np.random.default_rng(g)
    tree = {
        "w": rng.normal(size=(3, 5)).astype(np.float32),
        "b": rng.normal(size=(5,)).astype(np.float32),
        "count": np.int32(10 + g),
        "inner": (rng.normal(size=(2,)).astype(np.float32),),
    }
    return jax.device_put(tree, device)


def test_every_device_gets_the_mean_of_float_leaves_and_keeps_its_own_counters():
    devices = tuple(jax.devices()[:4])
    trees = [_tree(g, d) for g, d in enumerate(devices)]
    copies = allreduce_mean(trees, devices)
    expected = jax.tree.map(lambda *xs: np.mean(np.stack([np.asarray(x) for x in xs]), axis=0), *trees)
    for g, (copy, device) in enumerate(zip(copies, devices, strict=True)):
        assert jax.tree.structure(copy) == jax.tree.structure(trees[g])
        for name in ("w", "b"):
            np.testing.assert_allclose(copy[name], expected[name], rtol=1e-6, atol=1e-7)
            assert copy[name].devices() == {device}
            assert copy[name].dtype == jnp.float32
        np.testing.assert_allclose(copy["inner"][0], expected["inner"][0], rtol=1e-6, atol=1e-7)
        assert int(copy["count"]) == 10 + g  # not averaged


def test_one_device_returns_its_own_values():
    device = jax.devices()[0]
    tree = _tree(7, device)
    [copy] = allreduce_mean([tree], (device,))
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
