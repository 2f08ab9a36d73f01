"""LoRA on device: fixed-shape adapter slots in the layer params, and the batched update.

Each adapted projection W (one of MODULES) gets two stacked params next to the layer's own
weights, shaped like them over the layers, one slice per device slot (N = max_loras):

    lora_a_<module>  [L, in, N, r]     A of slot n: [:, :, n, :]   (r = max_lora_rank)
    lora_b_<module>  [L, N, r, out]    B of slot n, scaled (lora_alpha / r, or / sqrt(r))

An adapter of a smaller rank is zero-padded to r, and a module it does not adapt is zero, so
every slot holds the same shapes and writing one (write_slots, a slot index traced) never
recompiles. Each row carries its slot (-1: the base model); step_batch turns those into the
step's distinct slots `used` (k of them) and each token's place among them, and the update is

    y += ((x @ A[used]) * [r-block j == token's place]) @ B[used]        A[used]: [in, k, r]

two dense matmuls over the k adapters the step uses, gathered into the smallest of 1, 4, 16
or N that holds them (lax.switch: one program; a step with none skips the update). Measured
on the 2-core CPU (in 576, out 1536, r 16), dense over slots with the others masked beat
lax.ragged_dot over tokens sorted by slot (T = 512, 16 slots: 14.3 against 20.4 ms) and
per-token gathered A and B (45 ms); reading only the step's adapters instead of all N slots
took SmolLM2's one-adapter throughput from 0.53x to the figure in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import NamedTuple

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


def num_slots(params: dict) -> int:
    """N, the slots of params' LoRA slot params (either layers layout)."""
    layers = params["layers"]
    first = layers if isinstance(layers, dict) else layers[0]
    return first[b_name(MODULES[0])].shape[-3]


def with_slots(params: dict, cfg: ModelConfig, num_slots: int, rank: int, dtype) -> dict:
    """params with zero adapter slots added to every layer (either layers layout: a list of
    per-layer dicts, or one dict of [L, ...] arrays); params itself is not changed."""
    shapes = slot_shapes(cfg, num_slots, rank)
    layers = params["layers"]
    if isinstance(layers, dict):
        extra = {k: jnp.zeros((cfg.num_layers, *s), dtype) for k, s in shapes.items()}
        return {**params, "layers": {**layers, **extra}}
    out = [{**layer, **{k: jnp.zeros(s, dtype) for k, s in shapes.items()}} for layer in layers]
    return {**params, "layers": out}


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
    return {**params, "layers": base}, slots


def join_slots(params: dict, slots) -> dict:
    """split_slots' inverse."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return {**params, "layers": {**layers, **slots}}
    return {**params, "layers": [{**a, **b} for a, b in zip(layers, slots, strict=True)]}


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
    """int32[T]: each token's value of its row's (row_slots int32[S]; query_start int32[S + 1]);
    tokens past the rows (padding) get -1."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(query_start[1:], tokens, side="right")  # S for padding
    return jnp.concatenate([row_slots, jnp.full((1,), -1, row_slots.dtype)])[row]


class Batch(NamedTuple):
    """One step's adapters (step_batch): the distinct slots its rows use, and each token's."""

    token_index: jax.Array  # int32[T]: the token's adapter's place in `used`; -1: the base
    used: jax.Array  # int32[N]: the step's distinct slots, ascending, first num_used valid
    num_used: jax.Array  # int32[]


def step_batch(row_slots: jax.Array, query_start: jax.Array, num_tokens: int, num_slots: int):
    """The Batch of a step whose rows use row_slots (int32[S], -1: the base model)."""
    none = num_slots  # sorts after every slot
    distinct = jnp.unique(jnp.where(row_slots >= 0, row_slots, none), size=num_slots + 1,
                          fill_value=none)  # fmt: skip
    num_used = jnp.sum(distinct < none).astype(jnp.int32)
    row_index = jnp.where(row_slots >= 0, jnp.searchsorted(distinct, row_slots), -1)
    used = jnp.minimum(distinct[:num_slots], num_slots - 1).astype(jnp.int32)
    return Batch(token_slots(row_index.astype(jnp.int32), query_start, num_tokens), used, num_used)


def used_sizes(num_slots: int) -> tuple[int, ...]:
    """The adapter counts a step's update is specialised for (1, 4, 16, N; those <= N)."""
    return tuple(sorted({min(k, num_slots) for k in (1, 4, 16)} | {num_slots}))


def add(y: jax.Array, x: jax.Array, layer: dict, module: str, batch: Batch | None):
    """y (the projection of x, [T, ...out]) plus the LoRA update of each token's adapter;
    y as it is when LoRA is off (batch None) or the layer has no slot params for module.

    Only the step's distinct adapters are read: their A and B are gathered into the
    smallest of used_sizes that holds them (lax.switch over those sizes; none: no update)."""
    a = layer.get(a_name(module))
    if batch is None or a is None:
        return y
    b = layer[b_name(module)]  # [N, r, out]
    sizes = used_sizes(b.shape[0])
    xf = x.reshape(x.shape[0], -1)  # [T, in]

    def update(k: int):
        def run(y):
            used = batch.used[:k]
            a_k = jnp.take(a, used, axis=1)  # [in, k, r]
            b_k = jnp.take(b, used, axis=0)  # [k, r, out]
            h = jnp.einsum("ti,ikr->tkr", xf.astype(a.dtype), a_k)  # [T, k, r]
            mine = batch.token_index[:, None] == jnp.arange(k, dtype=jnp.int32)[None, :]
            h = jnp.where(mine[:, :, None], h, 0).reshape(x.shape[0], k * b.shape[1])
            delta = h @ b_k.reshape(k * b.shape[1], -1)  # [T, out]
            return y + delta.reshape(y.shape).astype(y.dtype)

        return run

    branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), batch.num_used) + 1
    branch = jnp.where(batch.num_used == 0, 0, branch)
    return jax.lax.switch(branch, [lambda y: y] + [update(k) for k in sizes], y)
