"""LoRA on device: fixed-shape adapter slots in the layer params, and the batched update.

Each adapted projection W (one of MODULES) gets two stacked params next to the layer's own
weights, shaped like them over the layers, one slice per device slot (N = max_loras):

    lora_a_<module>  [L, in, N, r]     A of slot n: [:, :, n, :]   (r = max_lora_rank)
    lora_b_<module>  [L, N, r, out]    B of slot n, scaled (lora_alpha / r, or / sqrt(r))

An adapter of a smaller rank is zero-padded to r, and a module it does not adapt is zero, so
every slot holds the same shapes and writing one (write_slots, a slot index traced) never
recompiles. Each token carries its slot (-1: the base model; token_slots expands the rows'),
and the update is

    y += ((x @ A_all) * [slot of each r-block == token's slot]) @ B_all

two dense matmuls over all N slots at once (x @ A_all is [T, N * r]), the other slots'
columns masked to zero, with no conditional: its cost grows with N * r, not with the adapters
a step uses. Measured on the 2-core CPU (loaded; medians of interleaved runs):
- one projection, in 576, out 1536, r 16, T = 512, 16 slots: 14.3 ms against 20.4 ms for
  lax.ragged_dot over tokens sorted by slot, 45 ms for per-token gathered A and B and 41 ms
  for a loop over slots;
- 30 SmolLM2-shaped layers of the seven projections, 16 decode tokens on one adapter: the
  base 158 ms, this 221 ms (N 16) and 135 against 106 ms (N 4); gathering only the step's
  adapters into 1/4/16/N columns under lax.switch took 291 and 157 ms (XLA:CPU's
  conditionals cost more than the masked columns: a switch whose branch does nothing already
  took 128 against 94 ms), and a lax.cond skipping steps without adapters likewise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = MODULES[:4]


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of a dense layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def a_name(module: str) -> str:
    return f"lora_a_{module}"


def b_name(module: str) -> str:
    return f"lora_b_{module}"


def slot_shapes(cfg: ModelConfig, num_slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Each slot param's shape for one layer (without the leading layer axis)."""
    shapes = {}
    for module, (n_in, n_out) in module_dims(cfg).items():
        shapes[a_name(module)] = (n_in, num_slots, rank)
        shapes[b_name(module)] = (num_slots, rank, n_out)
    return shapes


def adapter_shapes(cfg: ModelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one adapter's weights as write_slots takes them: A [L, in, rank], B
    [L, rank, out]."""
    shapes = {}
    for module, (n_in, n_out) in module_dims(cfg).items():
        shapes[a_name(module)] = (cfg.num_layers, n_in, rank)
        shapes[b_name(module)] = (cfg.num_layers, rank, n_out)
    return shapes


def with_slots(params: dict, cfg: ModelConfig, num_slots: int, rank: int, dtype) -> dict:
    """params with zero adapter slots added to every layer (either layers layout: a list of
    per-layer dicts, or one dict of [L, ...] arrays); params itself is not changed."""
    shapes = slot_shapes(cfg, num_slots, rank)
    layers = params["layers"]
    if isinstance(layers, dict):
        extra = {k: jnp.zeros((cfg.num_layers, *s), dtype) for k, s in shapes.items()}
        return {**params, "layers": {**layers, **extra}}
    out = [{**layer, **{k: jnp.zeros(s, dtype) for k, s in shapes.items()}} for layer in layers]
    return {**params, "layers": type(layers)(out)}  # a tuple stays one (switched layers)


def split_slots(params: dict) -> tuple[dict, object]:
    """(params without the slot params, the slot params: a dict of stacked arrays or a list
    of per-layer dicts, as params' layers are laid out)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        base = {k: v for k, v in layers.items() if not k.startswith("lora_")}
        slots = {k: v for k, v in layers.items() if k.startswith("lora_")}
        return {**params, "layers": base}, slots
    base = [{k: v for k, v in layer.items() if not k.startswith("lora_")} for layer in layers]
    slots = [{k: v for k, v in layer.items() if k.startswith("lora_")} for layer in layers]
    return {**params, "layers": type(layers)(base)}, slots


def join_slots(params: dict, slots) -> dict:
    """split_slots' inverse."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return {**params, "layers": {**layers, **slots}}
    joined = [{**a, **b} for a, b in zip(layers, slots, strict=True)]
    return {**params, "layers": type(layers)(joined)}


def write_slots(slots, index: jax.Array, weights: dict):
    """The slot params with slot `index` (int32[], traced) replaced by one adapter's weights
    {name: [L, in, r] for A, [L, r, out] for B} (scaled and padded already). Pure; jitted
    with slots donated (jpaged/worker/programs.py), it writes in place."""

    def put(array, new, name):  # array [.., in, N, r] or [.., N, r, out]
        axis = array.ndim - 2 if name.startswith("lora_a_") else array.ndim - 3
        new = jnp.expand_dims(new.astype(array.dtype), axis)
        start = [0] * array.ndim
        start[axis] = index
        return jax.lax.dynamic_update_slice(array, new, start)

    if isinstance(slots, dict):
        return {k: put(v, weights[k], k) for k, v in slots.items()}
    return [
        {k: put(v, weights[k][i], k) for k, v in layer.items()} for i, layer in enumerate(slots)
    ]


def token_slots(row_slots: jax.Array, query_start: jax.Array, num_tokens: int) -> jax.Array:
    """int32[T]: each token's adapter slot, its row's (row_slots int32[S], -1: the base;
    query_start int32[S + 1]); tokens past the rows (padding) get -1."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(query_start[1:], tokens, side="right")  # S for padding
    return jnp.concatenate([row_slots, jnp.full((1,), -1, row_slots.dtype)])[row]


def add(y: jax.Array, x: jax.Array, layer: dict, module: str, slots: jax.Array | None):
    """y (the projection of x, [T, ...out]) plus the LoRA update of each token's adapter
    (slots int32[T], -1: none; token_slots); y as it is when LoRA is off (slots None) or the
    layer has no slot params for module. Dense over all N slots, the others masked: no
    conditional (see the module docstring)."""
    a = layer.get(a_name(module))
    if slots is None or a is None:
        return y
    b = layer[b_name(module)]  # [N, r, out]
    num_slots, rank = b.shape[0], b.shape[1]
    xf = x.reshape(x.shape[0], -1).astype(a.dtype)  # [T, in]
    h = jnp.einsum("ti,inr->tnr", xf, a)  # [T, N, r]
    mine = slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]  # [T, N]
    h = jnp.where(mine[:, :, None], h, 0).reshape(x.shape[0], num_slots * rank)
    delta = h @ b.reshape(num_slots * rank, -1)  # [T, out]
    return y + delta.reshape(y.shape).astype(y.dtype)
