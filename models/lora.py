"""LoRA on device: fixed-shape adapter slots in the layer params, and the batched update.

Each adapted projection W (one of the model's `modules`: all seven of a dense layer, the four
attention projections of a mixture-of-experts model) gets two stacked params next to the
layer's own weights, shaped like them over the layers, one slice per device slot
(N = max_loras):

    lora_a_<module>  [L, in, N, r]     A of slot n: [:, :, n, :]   (r = max_lora_rank)
    lora_b_<module>  [L, N, r, out]    B of slot n, scaled (lora_alpha / r, or / sqrt(r))

An adapter of a smaller rank is zero-padded to r, and a module it does not adapt is zero, so
every slot holds the same shapes and writing one (write_slots, a slot index traced) never
recompiles. Tensor parallel (models/sharding.py lora_specs): A replicated and B split over
its output for the column-parallel q/k/v/gate/up, A split over its input and B replicated
for the row-parallel o/down (their partial sums join the module's all-reduce).

A step's adapters (`Step`): each token's slot (-1: the base model; token_slots expands the
rows') and the distinct slots the step uses, `ids` int32[W], W the step's LoRA width, chosen
by the host from the adapters in the batch and bucketed (`widths`: 0, 1, powers of 4 below N,
N), so a program is compiled per width (StepKey.lora_width) and none at an adapter load:

    W = 0        no Step at all: a base-only step does no LoRA work (the program has none)
    W = 1        one adapter: its A [in, r] and B [r, out] sliced out, a rank-r update
                 masked to its tokens
    T >= 4 W     tokens grouped by adapter (make_step, Blocks: each slot's tokens in
                 consecutive rows, padded to blocks of bs = T // 2W rows, at most T + W(bs-1)
                 rows): each block's A and B gathered, two batched matmuls ("blocks")
    T <= W > 1   at most one token per distinct adapter (decode of many adapters): each
                 token's A and B gathered, a batched matvec ("gathered bmm")
    else         the W slots' A and B gathered (all N: none), two dense matmuls over W * r
                 columns with each token's other columns masked to zero

Slots are stored in --lora-dtype (storage_dtype; auto: the model's); the update runs in the
activations' dtype, so bfloat16 slots on a float32 model cost half the bytes and compute in
float32 (held as uint16 bits, widened by a shift: XLA:CPU's own bfloat16 convert ran about
3x slower than the update it fed).

Measured on the 2-core CPU (loaded, load average 5-9; 30 SmolLM2-shaped layers of the seven
projections, N 16, r 16; medians of interleaved runs): 16 decode tokens on 16 adapters, the
base 131 ms, dense over all slots 257, gathered per token 202-207, lax.ragged_dot over tokens
sorted by slot 328; one adapter, the base 192 ms, dense over all slots 320, the sliced slot
171 (the noise); 64 tokens on 16 adapters, the base 304, dense 619, gathered per token 740
(so dense above T = W); 256 tokens on 16 adapters, the base 1341, dense 2166, ragged_dot 6288.
Later (issue 55e, loaded: load average 7-14, a vLLM run beside it; minima of 3-9 interleaved
runs): 1024 tokens on 16 adapters, the base 2633 ms, dense 5869, blocks (bs 32) 3514, blocks
(bs 16) 3344; 256 tokens, the base 685, dense 1453, blocks (bs 8) 1124; 64 tokens, the base
255, dense 448, blocks (bs 2) 440, gathered 555; 16 decode tokens, the base 78, gathered 157,
gathered from bfloat16 bits 133, bfloat16 converted by XLA 292.
XLA:CPU's conditionals (lax.switch / lax.cond on the step's adapters)
cost more than they saved, which is why the width is static, chosen by the host. On
accelerators the same rules hold (the gathered bmm and the masked dense over W columns both
map to batched matmuls); lax.ragged_dot over tokens sorted by adapter is the alternative there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = MODULES[:4]


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection: the seven of a dense layer; of a
    mixture-of-experts model the attention projections only (its experts are not adaptable)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }
    if cfg.num_experts:
        return {m: dims[m] for m in ATTENTION_MODULES}
    return dims


def storage_dtype(lora_dtype: str, model_dtype):
    """The slot params' dtype for --lora-dtype (auto: the model's). bfloat16 beside float32
    activations is held as its bits (uint16; _compute widens them with a shift, exact):
    XLA:CPU's bfloat16 -> float32 convert ran about 3x slower than the update it feeds."""
    if lora_dtype == "auto":
        return jnp.dtype(model_dtype)
    dtype = jnp.dtype(lora_dtype)
    if dtype == jnp.bfloat16 and jnp.dtype(model_dtype) == jnp.float32:
        return jnp.dtype(jnp.uint16)
    return dtype


def _compute(w: jax.Array, dtype) -> jax.Array:
    """Slot weights in the update's dtype (uint16: bfloat16 bits, storage_dtype)."""
    if w.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(w.astype(jnp.uint32) << 16, jnp.float32).astype(dtype)
    return w.astype(dtype)


def _stored(w: jax.Array, dtype) -> jax.Array:
    """_compute's inverse: weights (float32) in the slots' dtype, rounded to nearest."""
    if dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)
    return w.astype(dtype)


def a_name(module: str) -> str:
    return f"lora_a_{module}"


def b_name(module: str) -> str:
    return f"lora_b_{module}"


def a_b_names(cfg: ModelConfig) -> list[str]:
    """The slot params' names of one layer."""
    return [name(m) for m in module_dims(cfg) for name in (a_name, b_name)]


def slot_shapes(cfg: ModelConfig, num_slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    """Each slot param's shape for one layer (without the leading layer axis)."""
    return slot_shapes_of(module_dims(cfg), num_slots, rank)


def slot_shapes_of(dims: dict[str, tuple[int, int]], num_slots: int, rank: int) -> dict:
    """slot_shapes for modules of (in, out) features."""
    shapes = {}
    for module, (n_in, n_out) in dims.items():
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
        new = jnp.expand_dims(_stored(new, array.dtype), axis)
        start = [0] * array.ndim
        start[axis] = index
        return jax.lax.dynamic_update_slice(array, new, start)

    if isinstance(slots, dict):
        return {k: put(v, weights[k], k) for k, v in slots.items()}
    return [
        {k: put(v, weights[k][i], k) for k, v in layer.items()} for i, layer in enumerate(slots)
    ]


def widths(max_loras: int) -> tuple[int, ...]:
    """The LoRA widths programs are compiled for (StepKey.lora_width): 0, 1, the powers of 4
    below max_loras, and max_loras."""
    out, w = [0, 1], 4
    while w < max_loras:
        out.append(w)
        w *= 4
    return tuple(sorted({*out, max_loras}))


def width_for(num_adapters: int, max_loras: int) -> int:
    """The smallest width holding num_adapters distinct adapters."""
    return next(w for w in widths(max_loras) if w >= num_adapters)


def step_ids(row_slots: np.ndarray, width: int, max_loras: int) -> np.ndarray:
    """int32[width] (host): the distinct slots of row_slots (-1: none) padded with -1, or
    every slot when width is max_loras."""
    if width == max_loras:
        return np.arange(max_loras, dtype=np.int32)
    used = np.unique(row_slots[row_slots >= 0]).astype(np.int32)
    if len(used) > width:
        raise ValueError(f"{len(used)} adapters in a step of LoRA width {width}")
    return np.concatenate([used, np.full(width - len(used), -1, np.int32)])


class Blocks(NamedTuple):
    """A step's tokens grouped by adapter (make_step): each slot's tokens in consecutive
    rows of a padded [NB * bs] layout, in whole blocks of bs rows that hold one slot each.

        tokens  t0(s3) t1(s1) t2(s3) t3(-1) t4(s1)          bs = 2
        rows    [t1 t4] [t0 t2] [-  -] ...                 slot [1, 3, *, ...]
    """

    src: jax.Array  # int32[NB * bs]: each row's token, T: none (a zero row)
    slot: jax.Array  # int32[NB]: each block's slot (unused blocks: any, their rows are zero)
    pos: jax.Array  # int32[T]: each token's row, NB * bs: none (base-model or padding token)


class Step(NamedTuple):
    """A step's adapters on the device (see the module docstring)."""

    slots: jax.Array  # int32[T]: each token's slot, -1: the base model
    ids: jax.Array  # int32[W]: the distinct slots the step uses, -1 padding (W = N: all)
    blocks: Blocks | None = None  # the tokens grouped by slot (block_size(T, W) > 0)


def block_size(num_tokens: int, width: int) -> int:
    """Rows per block of the grouped formulation for T tokens at width W (static), 0 where it
    is not used: W > 1 and T >= 4 W, blocks of T // (2 W) rows, so the padding (at most
    bs - 1 rows for each of the W adapters) stays under half of T."""
    if width <= 1 or num_tokens < 4 * width:
        return 0
    return num_tokens // (2 * width)


def make_step(slots: jax.Array, ids: jax.Array, num_slots: int) -> Step:
    """The step's Step from each token's slot (token_slots) and its ids, with the tokens
    grouped by slot (Blocks) where block_size says so. Computed once per step, before the
    layers: counts per slot, each token's rank among its slot's tokens, then its row."""
    num_tokens, width = slots.shape[0], ids.shape[0]
    bs = block_size(num_tokens, width)
    if not bs:
        return Step(slots, ids)
    num_blocks = -(-(num_tokens + width * (bs - 1)) // bs)  # at most W slots' partial blocks
    c = jnp.clip(slots, 0, num_slots - 1)
    mine = slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]  # [T, N]
    counts = mine.sum(0, dtype=jnp.int32)
    blocks = (counts + bs - 1) // bs  # [N]
    ends = jnp.cumsum(blocks)  # [N]: the block after each slot's last
    rank = jnp.take_along_axis(jnp.cumsum(mine, 0, dtype=jnp.int32), c[:, None], 1)[:, 0] - 1
    none = num_blocks * bs
    pos = jnp.where(slots >= 0, (ends - blocks)[c] * bs + rank, none).astype(jnp.int32)
    src = jnp.full((none + 1,), num_tokens, jnp.int32).at[pos].set(
        jnp.arange(num_tokens, dtype=jnp.int32)
    )[:none]  # the base tokens' writes land on the dropped last row
    block_slot = jnp.searchsorted(ends, jnp.arange(num_blocks, dtype=jnp.int32), side="right")
    block_slot = jnp.minimum(block_slot, num_slots - 1).astype(jnp.int32)
    return Step(slots, ids, Blocks(src, block_slot, pos))


def num_slots_of(params: dict) -> int:
    """N, the device slots of params with LoRA slot params (with_slots)."""
    layers = params["layers"]
    layer = layers if isinstance(layers, dict) else layers[0]
    b = next(v for k, v in layer.items() if k.startswith("lora_b_"))
    return b.shape[-3]


def weight_specs(slot_specs):
    """The PartitionSpecs of write_slots' weights (A [L, in, r], B [L, r, out]) from the slot
    params' (stacked [L, in, N, r] / [L, N, r, out], or a list of per-layer dicts): the
    slot axis dropped (a list's per-layer specs gain the layer axis)."""
    from jax.sharding import PartitionSpec as P

    def drop(name, spec):
        entries = list(spec) + [None] * (4 - len(spec))
        axis = 2 if name.startswith("lora_a_") else 1
        return P(*(entries[:axis] + entries[axis + 1 :]))

    if isinstance(slot_specs, dict):
        return {k: drop(k, v) for k, v in slot_specs.items()}
    return {k: drop(k, P(None, *v)) for k, v in slot_specs[0].items()}


def token_slots(row_slots: jax.Array, query_start: jax.Array, num_tokens: int) -> jax.Array:
    """int32[T]: each token's adapter slot, its row's (row_slots int32[S], -1: the base;
    query_start int32[S + 1]); tokens past the rows (padding) get -1."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(query_start[1:], tokens, side="right")  # S for padding
    return jnp.concatenate([row_slots, jnp.full((1,), -1, row_slots.dtype)])[row]


def add(y: jax.Array, x: jax.Array, layer: dict, module: str, step: Step | None):
    """y (the projection of x, [T, ...out]) plus the LoRA update of each token's adapter
    (step: Step, or None: LoRA off, y as it is; also when the layer has no slot params for
    module). The formulation follows the step's static width (the module docstring)."""
    a = layer.get(a_name(module))
    if step is None or a is None:
        return y
    b = layer[b_name(module)]  # [N, r, out]
    num_slots, rank = b.shape[0], b.shape[1]
    slots, ids, blocks = step
    num_tokens, width = x.shape[0], ids.shape[0]
    dtype = jnp.promote_types(x.dtype, jnp.float32 if a.dtype == jnp.uint16 else a.dtype)
    xf = x.reshape(num_tokens, -1).astype(dtype)  # [T, in]
    up = functools.partial(_compute, dtype=dtype)  # each selection of the slots, widened
    if width == 1:  # one adapter: its rank-r update on its tokens
        i = jnp.maximum(ids[0], 0)
        a1 = up(jax.lax.dynamic_index_in_dim(a, i, a.ndim - 2, keepdims=False))  # [in, r]
        b1 = up(jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False))  # [r, out]
        h = jnp.where(((slots == ids[0]) & (ids[0] >= 0))[:, None], xf @ a1, 0)  # [T, r]
        delta = h @ b1
    elif blocks is not None:  # tokens grouped by slot: each block's A and B
        num_blocks = blocks.slot.shape[0]
        xe = jnp.concatenate([xf, jnp.zeros((1, xf.shape[1]), xf.dtype)])[blocks.src]
        xe = xe.reshape(num_blocks, -1, xf.shape[1])  # [NB, bs, in]
        h = jnp.einsum("nbi,inr->nbr", xe, up(jnp.take(a, blocks.slot, axis=a.ndim - 2)))
        d = jnp.einsum("nbr,nro->nbo", h, up(jnp.take(b, blocks.slot, axis=0)))
        d = d.reshape(-1, d.shape[-1])  # [NB * bs, out]
        delta = jnp.concatenate([d, jnp.zeros((1, d.shape[1]), d.dtype)])[blocks.pos]
    elif num_tokens <= width:  # gathered bmm: each token's own A and B
        c = jnp.clip(slots, 0, num_slots - 1)
        h = jnp.einsum("ti,itr->tr", xf, up(jnp.take(a, c, axis=a.ndim - 2)))  # [T, r]
        h = jnp.where((slots >= 0)[:, None], h, 0)
        delta = jnp.einsum("tr,tro->to", h, up(jnp.take(b, c, axis=0)))
    else:  # dense over the step's W slots, other slots' columns masked
        if width < num_slots:
            c = jnp.clip(ids, 0, num_slots - 1)
            a = jnp.take(a, c, axis=a.ndim - 2)  # [in, W, r]
            b = jnp.take(b, c, axis=0)  # [W, r, out]
        else:
            ids = jnp.arange(num_slots, dtype=slots.dtype)
        a, b = up(a), up(b)
        h = jnp.einsum("ti,inr->tnr", xf, a)  # [T, W, r]
        mine = (slots[:, None] == ids[None, :]) & (ids >= 0)[None, :]  # [T, W]
        h = jnp.where(mine[:, :, None], h, 0).reshape(num_tokens, width * rank)
        delta = h @ b.reshape(width * rank, -1)  # [T, out]
    return y + delta.reshape(y.shape).astype(y.dtype)
