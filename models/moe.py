"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, OLMoE, GLM-4.5) as pure functions.

Each token's hidden state goes through a router (float32 logits [T, E]), a softmax over all
E experts, the top k of them (renormalised to sum to 1 when cfg.norm_topk_prob: Mixtral
always, Qwen3-MoE and OLMoE by their flag), and the weighted sum of those k experts' gated
MLPs. GLM-4.5 (and DeepSeek-V3) route otherwise (route_grouped): sigmoid scores, a bias that
only chooses, top-k within the best groups, a scaling factor; and add shared experts, a
gated MLP every token runs. gpt-oss routes by the top k of its router's biased logits with a
softmax over those k (route_topk_softmax), and its experts add biases and apply a clamped
SwiGLU (clamped_swiglu). The experts run as grouped matmuls (jax.lax.ragged_dot) over the T * k token-expert
pairs sorted by expert, never a loop over experts:

    pairs (token, expert):  (0,5) (0,1) (1,1) (1,3) ...      T * k rows
    sorted by expert:       (0,1) (1,1) | (1,3) | (0,5) ...  group sizes = bincount(experts)
    ragged_dot:             rows of group e times expert e's weights

On the CPU, XLA computes jax.lax.ragged_dot as a dense product of every row with every
expert (E times the work: 278 ms against 11 ms for 512 rows, 4 of 32 experts), so there
the sorted rows are laid out in blocks of B rows, each block one expert's (a group padded to
whole blocks), and a loop over the used blocks runs each block's gated MLP on its expert's
weights (grouped_mlp):

    sorted rows:  e1 e1 e1 | e3 | e5 e5 ...        group sizes [0, 3, 0, 1, 0, 2, ...]
    blocks (B=4): [e1 e1 e1 0] [e3 0 0 0] [e5 e5 0 0] ...   at most ceil(M / B) + E blocks

Weights (params layout, models/config.py): router [D, E], w_gate_exps / w_up_exps
[E, D, F], w_down_exps [E, F, D]; router_bias [E]; w_gate_shared / w_up_shared [D, Fs],
w_down_shared [Fs, D] (split over F like a dense MLP under either layout); gpt-oss's b_router [E],
b_gate_exps / b_up_exps [E, F] (split as the experts' F or the experts) and b_down_exps [E, D]
(replicated: its weighted sum is added once, after the psum). Under tensor parallelism (inside shard_map, tp_axis set)
a device holds either every expert's slice of F (plain TP: partial sums of every pair) or
E / T whole experts (expert parallelism: only the pairs routed to its experts, the rest
zero); either way every device sees all tokens and one psum over the axis combines them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import quantization
from models.config import ModelConfig
from models.quantization import dequantize

# The params of an expert layer that a dense layer lacks (models/config.py).
EXPERT_PARAMS = (
    "router", "router_bias", "w_gate_exps", "w_up_exps", "w_down_exps",
    "w_gate_shared", "w_up_shared", "w_down_shared",
    "b_router", "b_gate_exps", "b_up_exps", "b_down_exps",
)  # fmt: skip


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


def route_topk_softmax(logits: jax.Array, num_experts_per_tok: int) -> tuple[jax.Array, jax.Array]:
    """gpt-oss's routing (transformers' GptOssTopKRouter): the k largest logits (the router's
    bias already added), their softmax the weights.

    Args:
      logits: float32[T, E].

    Returns:
      (weights float32[T, k], expert_ids int32[T, k]), in decreasing weight per token.
    """
    top, expert_ids = jax.lax.top_k(logits.astype(jnp.float32), num_experts_per_tok)
    return jax.nn.softmax(top, axis=-1), expert_ids.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def route_grouped(
    logits: jax.Array,
    bias: jax.Array | None,
    num_experts_per_tok: int,
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
    scoring: str = "sigmoid",
    group_score: str = "top2",
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's "noaux_tc" routing (GLM-4.5's), as transformers' Glm4MoeTopkRouter.

    scores = sigmoid(logits) (or softmax); choice = scores + bias. The E experts form
    num_groups groups of E / G; a group's score is the sum of its best two choice values;
    the topk_groups best groups are eligible and the top k choice values among their experts
    are chosen (group_score "max": a group's score is its best value, DeepSeek-V2's
    group_limited_greedy). Each chosen expert's weight is its unbiased score (the bias picks, never
    weighs), renormalised over the k when norm_topk_prob, then times scaling.

        experts  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | ...   G groups of E / G
        group    top-2 sum each -> best topk_groups eligible -> top k among them

    Args:
      logits: float32[T, E].
      bias: float32[E] (e_score_correction_bias) or None.
      num_experts_per_tok: k.

    Returns:
      (weights float32[T, k], expert_ids int32[T, k]), in decreasing choice value per token.
    """
    logits = logits.astype(jnp.float32)
    if scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    num_tokens, num_experts = choice.shape
    if num_groups > 1 and topk_groups < num_groups:
        grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
        if group_score == "max":
            group_scores = jnp.max(grouped, axis=-1)  # [T, G]
        else:
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, best = jax.lax.top_k(group_scores, topk_groups)
        eligible = (
            jnp.zeros((num_tokens, num_groups), bool)
            .at[jnp.arange(num_tokens)[:, None], best]
            .set(True)
        )
        eligible = jnp.repeat(eligible, num_experts // num_groups, axis=1)  # [T, E]
        choice = jnp.where(eligible, choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, num_experts_per_tok)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, expert_ids.astype(jnp.int32)


def _route(logits: jax.Array, layer: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The layer's routing: route_grouped for the DeepSeek-style configs, else route."""
    if cfg.moe_scoring == "topk_softmax":
        return route_topk_softmax(logits, cfg.num_experts_per_tok)
    plain = (cfg.moe_scoring, cfg.router_bias, cfg.num_expert_groups, cfg.routed_scaling_factor)
    if plain == ("softmax", False, 1, 1.0):
        return route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return route_grouped(
        logits,
        layer.get("router_bias"),
        cfg.num_experts_per_tok,
        num_groups=cfg.num_expert_groups,
        topk_groups=cfg.topk_groups,
        norm_topk_prob=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor,
        scoring=cfg.moe_scoring,
        group_score=cfg.group_score,
    )


def moe_mlp(x: jax.Array, layer: dict, cfg: ModelConfig, act, tp_axis=None) -> jax.Array:
    """The experts' feed-forward of x [T, D] (post-attention-normed): [T, D], summed over
    tp_axis.

    The device's experts are layer["w_gate_exps"].shape[0] of cfg.num_experts: all of them
    (plain TP or one device), or under expert parallelism the E_local experts starting at
    axis_index * E_local."""
    num_tokens, k = x.shape[0], cfg.num_experts_per_tok
    # Quantized experts (models/quantization.py) stay quantized here: grouped_mlp
    # dequantizes them, one expert at a time in the CPU's block loop.
    w_gate, w_up, w_down = (layer[name] for name in ("w_gate_exps", "w_up_exps", "w_down_exps"))
    logits = jnp.dot(
        x.astype(jnp.float32),
        layer["router"].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if "b_router" in layer:
        logits = logits + layer["b_router"].astype(jnp.float32)
    weights, expert_ids = _route(logits, layer, cfg)
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
    biases = glu = None
    if "b_gate_exps" in layer:
        biases = (layer["b_gate_exps"], layer["b_up_exps"])
    if cfg.swiglu_limit is not None:
        limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        glu = lambda g, u: clamped_swiglu(g, u, limit, alpha)
    y = grouped_mlp(xs, w_gate, w_up, w_down, group_sizes, act, biases=biases, glu=glu)
    # y: [T * k, D], sorted order
    y = jnp.where(mine[order][:, None], y, 0)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    # Back to (token, slot) order, then the k slots summed per token.
    y = jnp.zeros_like(y).at[order].set(y).reshape(num_tokens, k, -1)
    out = jnp.sum(y, axis=1)
    if "w_gate_shared" in layer:  # split over F on every device: partial sums, as the experts'
        mm = quantization.matmul
        h = act(mm(x, layer["w_gate_shared"])) * mm(x, layer["w_up_shared"])
        out = out + mm(h, layer["w_down_shared"]).astype(out.dtype)
    out = out if tp_axis is None else jax.lax.psum(out, tp_axis)
    if "b_down_exps" in layer:  # replicated: the chosen experts' biases, weighted, once
        bias = layer["b_down_exps"][expert_ids]  # [T, k, D]
        out = out + jnp.sum(bias * weights[..., None].astype(bias.dtype), axis=1).astype(out.dtype)
    return out


def grouped_mlp(
    xs: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    group_sizes: jax.Array,
    act,
    *,
    blocked: bool | None = None,
    biases: tuple[jax.Array, jax.Array] | None = None,
    glu=None,
) -> jax.Array:
    """Each row's gated MLP on its group's expert: act(x @ w_gate[g]) * (x @ w_up[g]) @
    w_down[g].

    Args:
      xs: [M, D], rows sorted by group; rows past sum(group_sizes) belong to none.
      w_gate, w_up: [G, D, F]; w_down: [G, F, D]; arrays or QuantizedWeights (the block loop
        dequantizes only the expert of each block, to xs's dtype: the step reads the stored
        bytes, never a float copy of every expert; ragged_dot takes them dequantized).
      group_sizes: int32[G].
      blocked: the CPU's block loop (_blocked_mlp); None: on the CPU only, as
        jax.lax.ragged_dot is a dense product there and a native grouped matmul elsewhere.
      biases: (b_gate, b_up) [G, F], added to the gate and up products (gpt-oss), or None.
      glu: h = glu(gate, up) in place of act(gate) * up (gpt-oss's clamped_swiglu), or None.

    Returns:
      [M, D]; rows of no group are zero in the block loop (ragged_dot leaves them
      unspecified: callers mask them).
    """
    if blocked is None:
        blocked = jax.default_backend() == "cpu"
    if glu is None:
        glu = lambda g, u: act(g) * u
    if blocked:
        return _blocked_mlp(xs, w_gate, w_up, w_down, group_sizes, glu, biases)
    w_gate, w_up, w_down = (dequantize(w, xs.dtype) for w in (w_gate, w_up, w_down))
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    if biases is not None:  # each row its group's (rows of no group: masked by callers)
        ends = jnp.cumsum(group_sizes)
        rows = jnp.arange(xs.shape[0], dtype=jnp.int32)
        row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), ends.shape[0] - 1)
        gate = gate + biases[0][row_group].astype(gate.dtype)
        up = up + biases[1][row_group].astype(up.dtype)
    return jax.lax.ragged_dot(glu(gate, up), w_down, group_sizes)


def block_rows(num_rows: int, num_groups: int) -> int:
    """B: the rows of one block, the power of two at least the mean group size, in [8, 128]
    (decode: a few rows per expert and little padding; prefill: matmuls of up to 128 rows)."""
    mean = -(-num_rows // num_groups)
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def _blocked_mlp(xs, w_gate, w_up, w_down, group_sizes, glu, biases=None) -> jax.Array:
    """grouped_mlp as a loop over blocks of B rows of one group each (module docstring)."""
    num_rows, dim = xs.shape
    num_groups = group_sizes.shape[0]
    b = block_rows(num_rows, num_groups)
    # A group of s rows takes ceil(s / B) blocks: sum_g ceil(s_g / B) < M / B + G.
    num_blocks = -(-num_rows // b) + num_groups
    sizes = group_sizes.astype(jnp.int32)
    row_end = jnp.cumsum(sizes)  # [G]
    blocks = (sizes + b - 1) // b
    block_end = jnp.cumsum(blocks)  # [G]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.searchsorted(row_end, rows, side="right")  # [M]: G past the last group
    valid = group < num_groups
    g = jnp.minimum(group, num_groups - 1)
    first_block = block_end[g] - blocks[g]
    dest = jnp.where(valid, first_block * b + rows - (row_end[g] - sizes[g]), num_blocks * b)
    xp = jnp.zeros((num_blocks * b, dim), xs.dtype).at[dest].set(xs, mode="drop")
    xp = xp.reshape(num_blocks, b, dim)
    block_group = jnp.searchsorted(block_end, jnp.arange(num_blocks, dtype=jnp.int32),
                                   side="right")  # fmt: skip
    block_group = jnp.minimum(block_group, num_groups - 1)

    def body(i, yp):  # block i: B rows of one expert
        e = block_group[i]
        wg, wu, wd = (dequantize(w[e], xs.dtype) for w in (w_gate, w_up, w_down))
        xb = xp[i]  # [B, D]
        gate, up = xb @ wg, xb @ wu  # [B, F]
        if biases is not None:
            gate, up = gate + biases[0][e].astype(gate.dtype), up + biases[1][e].astype(up.dtype)
        h = glu(gate, up)
        return yp.at[i].set((h @ wd).astype(yp.dtype))

    # Only the used blocks run (a loop of dynamic length): the bound above is for shapes.
    yp = jax.lax.fori_loop(0, block_end[-1], body, jnp.zeros_like(xp))
    y = yp.reshape(num_blocks * b, dim)[jnp.minimum(dest, num_blocks * b - 1)]
    return jnp.where(valid[:, None], y, 0)
