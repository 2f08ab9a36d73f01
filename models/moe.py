"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, OLMoE) as pure functions.

Each token's hidden state goes through a router (float32 logits [T, E]), a softmax over all
E experts, the top k of them (renormalised to sum to 1 when cfg.norm_topk_prob: Mixtral
always, Qwen3-MoE and OLMoE by their flag), and the weighted sum of those k experts' gated
MLPs. The experts run as grouped matmuls (jax.lax.ragged_dot) over the T * k token-expert
pairs sorted by expert, never a loop over experts:

    pairs (token, expert):  (0,5) (0,1) (1,1) (1,3) ...      T * k rows
    sorted by expert:       (0,1) (1,1) | (1,3) | (0,5) ...  group sizes = bincount(experts)
    ragged_dot:             rows of group e times expert e's weights

Weights (params layout, models/config.py): router [D, E], w_gate_exps / w_up_exps
[E, D, F], w_down_exps [E, F, D]. Under tensor parallelism (inside shard_map, tp_axis set)
a device holds either every expert's slice of F (plain TP: partial sums of every pair) or
E / T whole experts (expert parallelism: only the pairs routed to its experts, the rest
zero); either way every device sees all tokens and one psum over the axis combines them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.quantization import dequantize


def route(
    logits: jax.Array, num_experts_per_tok: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of router logits.

    Args:
      logits: float32[T, E].
      num_experts_per_tok: k.
      norm_topk_prob: the k weights renormalised to sum to 1 (else the softmax's own).

    Returns:
      (weights float32[T, k], expert_ids int32[T, k]), in decreasing weight per token.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, num_experts_per_tok)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, expert_ids.astype(jnp.int32)


def moe_mlp(x: jax.Array, layer: dict, cfg: ModelConfig, act, tp_axis=None) -> jax.Array:
    """The experts' feed-forward of x [T, D] (post-attention-normed): [T, D], summed over
    tp_axis.

    The device's experts are layer["w_gate_exps"].shape[0] of cfg.num_experts: all of them
    (plain TP or one device), or under expert parallelism the E_local experts starting at
    axis_index * E_local."""
    num_tokens, k = x.shape[0], cfg.num_experts_per_tok
    # Quantized experts are dequantized in the step (models/quantization.py).
    w_gate, w_up, w_down = (
        dequantize(layer[name], x.dtype) for name in ("w_gate_exps", "w_up_exps", "w_down_exps")
    )
    logits = jnp.dot(
        x.astype(jnp.float32),
        layer["router"].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    weights, expert_ids = route(logits, k, cfg.norm_topk_prob)
    num_local = w_gate.shape[0]
    first = 0
    if num_local != cfg.num_experts:  # expert parallel: this device's experts only
        first = jax.lax.axis_index(tp_axis) * num_local
    local = expert_ids.reshape(-1) - first  # [T * k]
    mine = (local >= 0) & (local < num_local)
    # Pairs of other devices' experts sort after every local group and are left out of the
    # group sizes, so the grouped matmuls never read them (their rows are masked to zero).
    key = jnp.where(mine, local, num_local)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    tokens = order // k
    xs = x[tokens]  # [T * k, D]
    h = act(jax.lax.ragged_dot(xs, w_gate, group_sizes)) * jax.lax.ragged_dot(xs, w_up, group_sizes)
    y = jax.lax.ragged_dot(h, w_down, group_sizes)  # [T * k, D], pair order
    y = jnp.where(mine[order][:, None], y, 0)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    # Back to (token, slot) order, then the k slots summed per token.
    y = jnp.zeros_like(y).at[order].set(y).reshape(num_tokens, k, -1)
    out = jnp.sum(y, axis=1)
    return out if tp_axis is None else jax.lax.psum(out, tp_axis)
