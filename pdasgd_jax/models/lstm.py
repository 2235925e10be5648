"""LSTM text classifier: embedding stage, LSTM stage(s), dense head.

Token id 0 is padding. Between stages the sequence travels as ``(B, T, F + 1)`` floats
whose last channel is the real-token mask, so every stage can tell padding apart
without a second input; the LSTM holds its state over padding steps, so the final
state is that after the last real token wherever the padding sits.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

PAD_ID = 0


class MaskedEmbed(nnx.Module):
    """``(B, T)`` token ids -> ``(B, T, features + 1)`` embeddings with the mask appended."""

    def __init__(self, vocab_size: int, features: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, features, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        mask_BxTx1 = (tokens_BxT != PAD_ID)[..., None].astype(jnp.float32)
        return jnp.concatenate([self.embed(tokens_BxT), mask_BxTx1], axis=-1)


class MaskedLSTM(nnx.Module):
    """One LSTM layer over masked ``(B, T, F + 1)`` input that skips padding steps.

    Returns the masked hidden sequence ``(B, T, hidden + 1)`` for a following LSTM, or
    with ``final=True`` the final hidden state ``(B, hidden)``.
    """

    def __init__(self, in_features: int, hidden: int, *, final: bool, rngs: nnx.Rngs):
        self.cell = nnx.OptimizedLSTMCell(in_features, hidden, rngs=rngs)
        self.final = final

    def __call__(self, x_BxTxF1: jax.Array) -> jax.Array:
        x_TxBxF1 = jnp.swapaxes(x_BxTxF1, 0, 1)
        zeros_BxH = jnp.zeros((x_BxTxF1.shape[0], self.cell.hidden_features), x_BxTxF1.dtype)

        def step(carry, xm_BxF1):
            new_carry, _ = self.cell(carry, xm_BxF1[:, :-1])
            real_Bx1 = xm_BxF1[:, -1:] > 0
            carry = jax.tree.map(lambda new, old: jnp.where(real_Bx1, new, old), new_carry, carry)
            return carry, carry[1]

        (_, h_BxH), h_TxBxH = jax.lax.scan(step, (zeros_BxH, zeros_BxH), x_TxBxF1)
        if self.final:
            return h_BxH
        return jnp.concatenate([jnp.swapaxes(h_TxBxH, 0, 1), x_BxTxF1[..., -1:]], axis=-1)


def lstm_stages(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    vocab_size: int | None,
    embed: int = 128,
    hidden: int = 128,
    layers: int = 1,
    rngs: nnx.Rngs,
) -> list[nnx.Module]:
    """Stages ``[embed, lstm x layers, dense]`` for ``(T,)`` int token ids.

    Args:
      input_shape: ``(T,)`` of one example.
      num_classes: number of output logits.
      vocab_size: number of token ids (the dataset's ``vocab_size``); id 0 is padding.
      embed: embedding width.
      hidden: LSTM state width.
      layers: stacked LSTM layers, one stage each.
      rngs: parameter initialisation.

    Raises:
      ValueError: if the inputs are not token sequences or ``vocab_size`` is None.
    """
    if len(input_shape) != 1 or vocab_size is None:
        raise ValueError(
            f"the lstm model needs (T,) token ids and a vocab_size; "
            f"got inputs of shape {tuple(input_shape)} and vocab_size {vocab_size}"
        )
    stages: list[nnx.Module] = [MaskedEmbed(vocab_size, embed, rngs=rngs)]
    sizes = [embed] + [hidden] * layers
    for i in range(layers):
        stages.append(MaskedLSTM(sizes[i], hidden, final=i == layers - 1, rngs=rngs))
    stages.append(nnx.Linear(hidden, num_classes, rngs=rngs))
    return stages
