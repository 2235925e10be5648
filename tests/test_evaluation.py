"""Evaluation uses the model's own loss, counting only the real examples of a padded batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdasgd_jax import stages
from pdasgd_jax.kernels import make_eval_step


def _squared_error(logits_BxC, labels_B):
    """A loss other than softmax cross-entropy: mean squared error against one-hot labels."""
    return jnp.mean(jnp.sum((logits_BxC - jax.nn.one_hot(labels_B, logits_BxC.shape[-1])) ** 2, -1))


@pytest.mark.parametrize("loss", [_squared_error, stages.softmax_cross_entropy])
def test_eval_step_sums_the_models_loss_over_real_examples(loss):
    rngs = nnx.Rngs(0)
    model, v = stages.from_modules([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)], loss=loss)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    mask = np.arange(8) < 5  # the last three rows are padding
    loss_sum, correct = make_eval_step(model)(v.params, v.states, x, labels, mask)
    logits, _ = model.apply(v.params, v.states, x[:5], train=False)
    np.testing.assert_allclose(loss_sum, 5 * loss(logits, labels[:5]), rtol=1e-6)
    assert int(correct) == int(np.sum(np.argmax(logits, -1) == labels[:5]))
