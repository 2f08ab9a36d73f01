"""Per-row logits processors for the jitted step: pure jnp, fixed shapes, no host sync.

apply_token_bitmask masks the tokens a row's grammar forbids (structured outputs);
apply_logit_bias adds OpenAI's per-token biases. Both take padded arrays whose neutral
values (an all-ones bitmask row, -1 bias ids) leave a row unchanged, so constrained and
unconstrained rows share one compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf  # the sampler's mask value


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets the logits of disallowed tokens to -inf.

    llguidance's layout, little-endian within a word:

        word w of a row:  bit 31 ... bit 1  bit 0
        token:            32w+31    32w+1  32w

    Args:
      logits: float32[S, V].
      bitmask: int32[S, ceil(V / 32)]; bit j of word w set = token 32 * w + j allowed.
        An all-ones row (-1) leaves its logits unchanged.
    Returns:
      float32[S, V].
    """
    num_rows, vocab = logits.shape
    num_words = (vocab + 31) // 32
    if bitmask.shape != (num_rows, num_words):
        raise ValueError(
            f"bitmask must be int32[{num_rows}, {num_words}] for logits {list(logits.shape)}, "
            f"got {list(bitmask.shape)}"
        )
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # int32[S, W, 32]; >> is arithmetic, & 1 is not
    allowed = bits.reshape(num_rows, num_words * 32)[:, :vocab] != 0  # bool[S, V]
    return jnp.where(allowed, logits, _NEG_INF)


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Adds each row's biases to its logits (OpenAI's logit_bias).

    Args:
      logits: float32[S, V].
      bias_ids: int32[S, B], -1 padded; ids are distinct within a row (a dict's keys).
      bias_values: float32[S, B]; padding entries are ignored.
    Returns:
      float32[S, V].
    """
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]  # [S, 1]
    ids = jnp.where(bias_ids >= 0, bias_ids, vocab)  # padding -> out of range -> dropped
    return logits.at[rows, ids].add(bias_values.astype(logits.dtype), mode="drop")
