"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3) as pure functions
over a params pytree. The families differ only in ModelConfig flags; layers with different
attention (Gemma's sliding-window and full layers) run in groups of their repeating pattern.

`forward` runs one ragged batch of new tokens through the model: it writes each token's K/V
into its slot of the paged pool and attends over the sequence's pages. The pool comes in and
goes out (the caller donates it), so under jit the update is in place.

One pool for every layer: K and V are each [num_kv_heads, num_layers * N, page_size,
head_dim], layer l's pages at l * N .. l * N + N - 1, so a layer's attention reads the whole
pool (a kernel operand, never a slice copy) through its page table offset by l * N, and the
layers can run under lax.scan with the pool as the loop's carry, updated in place.

Mixture-of-experts configs (cfg.num_experts) run models/moe.py in place of the gated MLP,
after cfg.num_dense_layers layers of the gated MLP (GLM-4.5); stacked, those first layers run
unrolled and the expert layers after them under lax.scan.

Latent-attention configs (cfg.kv_lora_rank: DeepSeek-V2/V3) run models/mla.py in place of
the q/k/v attention; the pool then holds one latent row per token, split over K and V.

Tensor parallelism: with `tp_axis` set, the functions run inside shard_map on one device's
shards (layout of models/sharding.py): the same code over local heads and columns, plus one
psum after each row-parallel matmul (wo, w_down), one for the vocab-parallel embedding, and an
all-gather of the logits. With tp_axis None nothing changes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from models import lora, mla, moe, packed, quantization
from models.config import (
    LinearRopeScaling,
    LongRopeScaling,
    ModelConfig,
    RopeScaling,
    YarnRopeScaling,
)
from models.kv_groups import KVGroups, single_group
from pallas_kernels import kv_quant

# attention_backend -> dispatcher arguments: None/"pallas" pick the platform's best (the
# reference on CPU); "pallas_interpret" runs the GPU kernel in the Pallas interpreter.
_ATTENTION_BACKENDS = {
    None: {},
    "pallas": {},
    "reference": {"backend": "cpu"},
    "pallas_interpret": {"interpret": True},
}

# (k_pages, v_pages), each [num_kv_heads, num_layers * pages_per_layer, page_size, head_dim],
# or each a pallas_kernels.kv_quant.QuantizedPages (int8/fp8 rows and their scales).
KVPool = tuple[jax.Array, jax.Array]


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False, long: bool = False) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2], scaled as configured.

    local: a sliding-window layer's, which has its own base and no scaling when
    cfg.rope_local_theta is set (Gemma 3). long: LongRoPE's long factors (else short)."""
    dim = cfg.rotary_dim
    own_base = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if own_base else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = None if own_base else cfg.rope_scaling
    if isinstance(rs, LinearRopeScaling):
        inv_freq = inv_freq / rs.factor
    elif isinstance(rs, LongRopeScaling):
        inv_freq = inv_freq / np.asarray(rs.long_factor if long else rs.short_factor)
    elif isinstance(rs, YarnRopeScaling):
        inv_freq = _yarn_inv_freq(inv_freq, rs, dim, theta)
    elif isinstance(rs, RopeScaling):
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, rs: YarnRopeScaling, dim: int, theta: float):
    """YaRN's blend of inv_freq and inv_freq / factor (transformers' _compute_yarn_parameters):
    dims below the correction range keep their frequency, dims above it are interpolated,
    a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return inv_freq / rs.factor * (1 - keep) + inv_freq * keep


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, Dh] of positions [T] (Hugging Face rotate-half layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, Dh] rotated by rope_cos_sin's tables (partial rotary: tables narrower than
    Dh rotate the first dims and pass the rest)."""
    if cos.shape[-1] != x.shape[-1]:
        r = cos.shape[-1]
        return jnp.concatenate([rotate(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [T, H, Dh] rotated by positions [T] (Hugging Face rotate-half layout)."""
    return rotate(x, *rope_cos_sin(positions, inv_freq))


def _computed_once(*tables: jax.Array) -> tuple[jax.Array, ...]:
    """The tables [..., n], materialised once. XLA on CPU fuses an elementwise producer such
    as cos(positions * inv_freq) into each consumer, so every layer's rotation of q and k
    would evaluate cos and sin again for each head's elements (a third of a prefill step's
    non-matmul time on SmolLM2). A dot is never fused into its consumers, and a dot with the
    identity is exact (one product by 1, the rest by 0, of finite values). Elsewhere the
    tables pass through."""
    if jax.default_backend() != "cpu":
        return tables
    eye = jnp.eye(tables[0].shape[-1], dtype=jnp.float32)
    return tuple(
        jnp.einsum("...d,de->...e", t, eye, precision=jax.lax.Precision.HIGHEST) for t in tables
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: the product with the weight (stored with Gemma's + 1) in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _rope_tables(cfg, positions, context_lens, query_start) -> dict[bool, tuple]:
    """cos and sin [T, 1, rotary_dim] for each rope a layer can have: {False: the full-
    attention layers' (every layer's, without a local base), True: the sliding-window
    layers' (cfg.rope_local_theta)}. LongRoPE picks each token's factors by its sequence's
    length this step (long past original_max_position_embeddings, as transformers picks by
    the length of its forward) and scales the tables by attention_factor."""
    kinds = [False] + ([True] if cfg.rope_local_theta is not None else [])
    rs = cfg.rope_scaling
    tables = {}
    for local in kinds:
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, local=local))
        if isinstance(rs, LongRopeScaling) and not (local and cfg.rope_local_theta is not None):
            cos_long, sin_long = rope_cos_sin(positions, rope_inv_freq(cfg, local=local, long=True))
            tokens = jnp.arange(positions.shape[0], dtype=jnp.int32)
            seq = jnp.searchsorted(query_start, tokens, side="right") - 1
            seq = jnp.clip(seq, 0, context_lens.shape[0] - 1)
            long = (context_lens[seq] > rs.original_max_position_embeddings)[:, None, None]
            cos = jnp.where(long, cos_long, cos) * rs.attention_factor
            sin = jnp.where(long, sin_long, sin) * rs.attention_factor
        elif isinstance(rs, YarnRopeScaling) and not (local and cfg.rope_local_theta is not None):
            cos, sin = cos * rs.attention_factor, sin * rs.attention_factor
        tables[local] = _computed_once(cos, sin)
    return tables


def layer_pattern(cfg: ModelConfig) -> int:
    """The period of the layers' kinds (window, rope, experts) after the dense prefix
    (_first_scanned): the smallest p with layer first + i's kind that of layer first + i % p
    (1: uniform layers; Gemma 2: 2; Gemma 3: 6)."""
    kinds = _layer_kinds(cfg)[_first_scanned(cfg) :]
    return next(
        (p for p in range(1, len(kinds) + 1)
         if all(kinds[i] == kinds[i % p] for i in range(len(kinds)))),
        1,
    )  # fmt: skip


def _first_scanned(cfg: ModelConfig) -> int:
    """The first layer of the repeating pattern: the dense MLP layers before the expert
    layers (GLM-4.5's first_k_dense_replace) run unrolled before it."""
    return cfg.num_dense_layers if cfg.num_experts else 0


def _layer_kinds(cfg: ModelConfig) -> list[tuple]:
    """Each layer's static settings: (sliding window, local rope, experts)."""
    local = cfg.rope_local_theta is not None
    return [(w, local and w is not None, cfg.has_experts(i)) for i, w in enumerate(cfg.windows)]


def _rows(value) -> int:
    """The layers a stacked param holds (its leading dim; a QuantizedWeight's q's)."""
    return jax.tree.leaves(value)[0].shape[0]


def layer_at(layers: dict, i, *, experts: bool | None = None) -> dict:
    """Layer i's params out of stacked layers (models/config.py): a name stacked over every
    layer gives row i; an expert param (moe.EXPERT_PARAMS), stacked over the last layers
    only, row i - (num_layers - rows); a dense MLP param, stacked over the first layers, row
    i. A name layer i lacks is left out. i may be traced (a scan's index) when experts
    (whether layer i runs experts) is given; a traced row is read by dynamic index, so no
    stacked array is copied.

        w_gate    [k, ...]        rows 0 .. k-1        = layers 0 .. k-1
        router    [L - k, ...]    rows 0 .. L-k-1      = layers k .. L-1
        wq        [L, ...]        rows 0 .. L-1        = layers 0 .. L-1
    """
    num_layers = max(_rows(v) for v in layers.values())
    out = {}
    for name, value in layers.items():
        n, row = _rows(value), i
        if n != num_layers and name in moe.EXPERT_PARAMS:
            if not (i >= num_layers - n if experts is None else experts):
                continue
            row = i - (num_layers - n)
        elif n != num_layers and not (i < n if experts is None else not experts):
            continue
        if isinstance(row, int):
            out[name] = value[row]
        else:
            index = lambda a, r=row: jax.lax.dynamic_index_in_dim(a, r, keepdims=False)
            out[name] = jax.tree.map(index, value)
    return out


def _write_kv(pages, new: jax.Array, slot_mapping: jax.Array):
    """Writes new [T, Hkv, Dh] into flat slots (page * page_size + offset) of pages
    (quantized, with each row's scale, when pages is a kv_quant.QuantizedPages)."""
    return kv_quant.write(pages, new, slot_mapping)


def layer_offsets(groups: KVGroups, k_pages: jax.Array) -> jax.Array:
    """int32[num_layers]: the first physical page of each layer's part of the pool (its slot
    times the pages per slot, models/kv_groups.py)."""
    per_slot = k_pages.shape[1] // groups.slots_per_page
    return jnp.asarray(groups.layer_slots, jnp.int32) * per_slot


def forward(
    params: dict,
    cfg: ModelConfig,
    kv_pages: KVPool,
    token_ids: jax.Array,  # int32[T]
    positions: jax.Array,  # int32[T]
    slot_mapping: jax.Array,  # int32[G, T] (or [T]): flat slot (page * page_size + offset)
    context_lens: jax.Array,  # int32[S]: cached tokens per sequence after this step
    page_table: jax.Array,  # int32[G, S, P] (or [S, P]): each group's pages (0 = null page)
    query_start: jax.Array,  # int32[S + 1]
    *,
    kv_groups: KVGroups | None = None,
    decode_only: bool = False,
    max_query_len: int | None = None,
    attention_backend: str | None = None,
    tp_axis: str | tuple[str, ...] | None = None,
    lora_slots: lora.Step | None = None,  # the step's adapters (models/lora.py)
) -> tuple[jax.Array, KVPool]:
    """Runs the decoder over a ragged batch; returns final hidden states [T, D] and the pool.

    The pool holds every layer: layer l's page p is physical page j * N + p, j its slot
    (kv_groups, models/kv_groups.py; None: one group, slot l for layer l) and N the pages
    per slot, so each layer's attention reads the whole pool through its group's page table
    and slot mapping (row g of page_table and slot_mapping; 2-D ones are one group's) offset
    by j * N (layer_offsets), a plain kernel operand, never a slice copy; page 0 of each
    slot is its null page. Layers run under lax.scan when params["layers"] is stacked
    (a dict of [num_layers, ...] arrays, models/config.py), unrolled when it is a list of
    per-layer dicts; the same layer function runs either way.

    decode_only (static): every sequence has exactly one query token and row s of the
    token arrays belongs to sequence s (T == S), so the decode kernel can serve the step.
    max_query_len (static): the query tokens per sequence the step usually has at most (a
    verification step's k + 1; None: no bound), a hint for the CPU attention.
    tp_axis (static): the shard_map axis params and pools are split over (None: unsplit).
    lora_slots: with LoRA slot params in the layers (models/lora.py), the step's adapters.
    """
    attn_kwargs = dict(
        sm_scale=cfg.sm_scale,
        soft_cap=cfg.attn_soft_cap,
        **_ATTENTION_BACKENDS[attention_backend],
    )
    norm = gemma_rms_norm if cfg.gemma_norms else rms_norm
    act = _ACTIVATIONS[cfg.hidden_act]
    ropes = _rope_tables(cfg, positions, context_lens, query_start)
    kinds = _layer_kinds(cfg)
    dtype = params["final_norm"].dtype
    if "tied_head" in params:  # the tied table kept only as [D, V] (switch_layers)
        x = packed.columns(params["tied_head"], token_ids).astype(dtype)  # [T, D]
    else:
        x = _embed(params["embed"], cfg, token_ids, tp_axis, dtype)  # [T, D]
    if cfg.embed_scale:  # in the activation dtype, as transformers scales
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
    k_pages, v_pages = kv_pages
    page_size = k_pages.shape[2]
    groups = kv_groups or single_group(cfg.num_layers)
    if page_table.ndim == 2:
        page_table = page_table[None]
    if slot_mapping.ndim == 1:
        slot_mapping = slot_mapping[None]
    offsets = layer_offsets(groups, k_pages)
    layer_groups = jnp.asarray(groups.layer_groups, jnp.int32)
    # Quantized keys are stored rotated, and queries rotated alike (kv_quant.key_rotation).
    rotate_keys = kv_quant.is_quantized(k_pages.dtype)
    # The step's real tokens, before its bucket's padding: packed products compute only them.
    valid = query_start[-1]

    def project(layer, x):  # a layer's first half up to attention: (q, k, v) [T, H, Dh]
        h = norm(x, layer["input_norm"], cfg.rms_norm_eps)
        if "wqkv" in layer:  # one product, split (fuse_projections; unsharded: every head)
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
            ends = np.cumsum(heads)[:2] * cfg.head_dim
            qkv = jnp.split(packed.dense(h, layer["wqkv"], valid), ends, axis=1)  # [T, H * Dh]
            qkv = (y.reshape(y.shape[0], n, cfg.head_dim) for y, n in zip(qkv, heads, strict=True))
        else:
            qkv = (quantization.einsum("td,dhk->thk", h, layer[w]) for w in ("wq", "wk", "wv"))
        q, k, v = (
            lora.add(y, h, layer, m, lora_slots)
            for y, m in zip(qkv, ("q_proj", "k_proj", "v_proj"), strict=True)
        )
        if cfg.attention_bias:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
        if cfg.qk_norm:
            q = norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = norm(k, layer["k_norm"], cfg.rms_norm_eps)
        if cfg.qk_norm_full:
            q = _full_rms_norm(q, layer["q_norm"], cfg.rms_norm_eps, cfg.num_heads, tp_axis)
            k = _full_rms_norm(k, layer["k_norm"], cfg.rms_norm_eps, cfg.num_kv_heads, _kv_axis(tp_axis))
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
        return q, k, v

    def attend(qkv, k_pages, v_pages, offset, group, kind, sinks=None):
        """Rope, the K/V writes and paged attention of one layer: ([T, H, Dh], pool)."""
        q, k, v = qkv
        window, local, _ = kind  # static: a layer group's own
        cos, sin = ropes[local]
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin)
        if rotate_keys:
            q, k = kv_quant.rotate_keys(q).astype(q.dtype), kv_quant.rotate_keys(k)
        slots = slot_mapping[group] + offset * page_size
        k_pages = _write_kv(k_pages, k, slots)
        v_pages = _write_kv(v_pages, v, slots)
        table = page_table[group] + offset
        # gpt-oss's sink logits per query head (None: the other families' programs unchanged)
        kw = attn_kwargs if sinks is None else {**attn_kwargs, "sinks": sinks}
        if decode_only:
            attn = pallas_kernels.paged_decode_attention(
                q, k_pages, v_pages, context_lens, table, sliding_window=window, **kw
            )
        else:
            attn = pallas_kernels.paged_prefill_attention(
                q, k_pages, v_pages, context_lens, table, query_start,
                max_query_len=max_query_len, sliding_window=window, **kw
            )
        return attn, k_pages, v_pages

    def finish(layer, x, attn, experts=kinds[0][2]):  # the o projection and the MLP: x [T, D]
        if isinstance(layer["wo"], packed.PackedWeight):  # [Hq * Dh, D] (switch_layers)
            out = packed.dense(attn.reshape(attn.shape[0], -1), layer["wo"], valid)
        else:
            out = quantization.einsum("thk,hkd->td", attn, layer["wo"])
        out = _reduce(lora.add(out, attn, layer, "o_proj", lora_slots), tp_axis)
        if "bo" in layer:  # after the reduce: added once, not once per device
            out = out + layer["bo"]
        if cfg.post_norms:
            out = norm(out, layer["attn_out_norm"], cfg.rms_norm_eps)
        return _mlp_residual(x + out, layer, cfg, norm, act, tp_axis, experts, lora_slots, valid)

    def run_layer(carry, layer_and_offset, kind=kinds[0]):
        x, k_pages, v_pages = carry
        layer, offset, group = layer_and_offset
        group = 0 if groups.num_groups == 1 else group  # a traced index only when needed
        _, local, experts = kind  # static: a layer group's own
        cos, sin = ropes[local]
        if cfg.kv_lora_rank:  # latent attention (models/mla.py)
            h = norm(x, layer["input_norm"], cfg.rms_norm_eps)
            out, k_pages, v_pages = mla.attention(
                h, layer, cfg, cos, sin, k_pages, v_pages,
                slot_mapping[group] + offset * page_size, page_table[group] + offset,
                context_lens, query_start, norm=norm, rotate=rotate, decode_only=decode_only,
                max_query_len=max_query_len, attn_kwargs=attn_kwargs,
            )  # fmt: skip
            return _feed_forward(x + _reduce(out, tp_axis), layer, cfg, norm, act, tp_axis,
                                 experts, (k_pages, v_pages), lora_slots)  # fmt: skip
        attn, k_pages, v_pages = attend(
            project(layer, x), k_pages, v_pages, offset, group, kind, layer.get("sinks")
        )
        return (finish(layer, x, attn, experts), k_pages, v_pages), None

    def run_switched(carry, i):
        """Layer i of a tuple of per-layer params (switch_layers): its projections chosen by
        lax.switch, so each reads its own weights where they lie."""
        x, k_pages, v_pages = carry
        qkv = jax.lax.switch(i, [functools.partial(project, layer) for layer in layers], x)
        attn, k_pages, v_pages = attend(qkv, k_pages, v_pages, offsets[i], 0, kinds[0])
        x = jax.lax.switch(i, [functools.partial(finish, layer) for layer in layers], x, attn)
        return (x, k_pages, v_pages), None

    carry = (x, k_pages, v_pages)
    layers = params["layers"]
    period = layer_pattern(cfg)
    first = _first_scanned(cfg)
    per_slot = k_pages.shape[1] // groups.slots_per_page
    if isinstance(layers, dict) and first and period < cfg.num_layers - first:
        for i in range(first):  # the dense layers before the scanned expert layers
            layer = layer_at(layers, i, experts=False)
            offset = groups.layer_slots[i] * per_slot
            carry, _ = run_layer(carry, (layer, offset, groups.layer_groups[i]), kinds[i])
        carry = _scan_groups(
            run_layer, carry, layers, offsets, layer_groups, kinds, period, start=first
        )
    elif isinstance(layers, dict) and period == 1 and not first:  # stacked: one traced layer
        carry, _ = jax.lax.scan(run_layer, carry, (layers, offsets, layer_groups))
    elif isinstance(layers, dict) and period < cfg.num_layers and not first:
        carry = _scan_groups(run_layer, carry, layers, offsets, layer_groups, kinds, period)
    elif isinstance(layers, tuple) and switchable(cfg) and groups.num_groups == 1 and not tp_axis:
        carry, _ = jax.lax.scan(run_switched, carry, jnp.arange(len(layers), dtype=jnp.int32))
    else:
        if isinstance(layers, dict):  # no repeating pattern: unrolled
            layers = [layer_at(layers, i) for i in range(cfg.num_layers)]
        for i, layer in enumerate(layers):
            offset = groups.layer_slots[i] * per_slot
            carry, _ = run_layer(carry, (layer, offset, groups.layer_groups[i]), kinds[i])
    x, k_pages, v_pages = carry
    return norm(x, params["final_norm"], cfg.rms_norm_eps), (k_pages, v_pages)


def _scan_groups(
    run_layer, carry, layers: dict, offsets, layer_groups, kinds, period: int, start: int = 0
):
    """Stacked layers from `start` on whose kinds repeat every `period` layers: lax.scan over
    the groups, each running its `period` layers unrolled with their own static kinds, then
    the layers past the last whole group unrolled. A group's layers are read from the stacked
    arrays by index (as scan reads its xs; layer_at), so no weights are copied into a grouped
    layout; so are each layer's pool offset and paging group (models/kv_groups.py), which
    need not follow it.

        layers  0 1 2 3 4 5 | 6 7 8 9 10 11 | ... | 24 25
        scan    group 0     | group 1       | ... | leftover (unrolled)
    """
    num_layers = len(kinds)
    num_groups = (num_layers - start) // period

    def run_group(carry, g):
        for j in range(period):
            i = start + g * period + j
            kind = kinds[start + j]
            layer = layer_at(layers, i, experts=kind[2])
            carry, _ = run_layer(carry, (layer, offsets[i], layer_groups[i]), kind)
        return carry, None

    carry, _ = jax.lax.scan(run_group, carry, jnp.arange(num_groups, dtype=jnp.int32))
    for i in range(start + num_groups * period, num_layers):
        layer = layer_at(layers, i, experts=kinds[i][2])
        carry, _ = run_layer(carry, (layer, offsets[i], layer_groups[i]), kinds[i])
    return carry


def stack_layers(params: dict, place=None) -> dict:
    """params with "layers" as one dict of [num_layers, ...] arrays (for lax.scan); params
    itself is not changed. place(name, array), if given, puts each stacked array where it
    belongs (its sharding). params without layers (a runner that only replays device calls)
    are returned as they are."""
    layers = params.get("layers")
    if not layers or isinstance(layers, dict):
        return params
    stacked = {}
    # Each name over the layers that have it (layer_at: dense MLP and expert layers differ).
    for name in dict.fromkeys(name for layer in layers for name in layer):
        parts = [layer[name] for layer in layers if name in layer]
        array = jax.tree.map(lambda *a: jnp.stack(a), *parts)
        stacked[name] = array if place is None else place(name, array)
    return {**params, "layers": stacked}


def switchable(cfg: ModelConfig) -> bool:
    """Whether forward can run cfg's layers from a tuple of per-layer params (switch_layers):
    uniform layers (one kind: layer_pattern 1) of q/k/v attention and a gated MLP."""
    return not (cfg.kv_lora_rank or cfg.num_experts or cfg.attention_sinks) and (
        layer_pattern(cfg) == 1
    )


def switches_layers(cfg: ModelConfig, platform: str, *, sharded: bool) -> bool:
    """Whether scanned layers run switched (switch_layers) rather than stacked: on the CPU,
    unsharded, for the models forward can switch. Elsewhere the stacked scan's slices cost
    no copy worth a change to the accelerators' programs."""
    return platform == "cpu" and not sharded and switchable(cfg)


# The largest tied embedding switch_layers keeps transposed for the LM head (SmolLM2's float32
# table is 113 MB; Llama-3.2-1B's, 1 GB, stays [V, D]: its transposing copy at load would
# briefly hold both).
TIED_HEAD_MAX_BYTES = 256 << 20


def switch_layers(params: dict, tied_head: bool = True, fuse: bool = True,
                  pack: bool = True) -> dict:
    """params with "layers" as a tuple of per-layer dicts: forward then runs them under
    lax.scan over the layer index, each layer's projections picked by lax.switch, so every
    dot reads its weights where they lie. XLA:CPU copies a stacked layer's slice out before
    each dot (about 16% of SmolLM2's decode step at batch 32), and unrolled layers compile
    4x longer (docs/benchmarks.md, issue 53). Models forward cannot switch (switchable)
    run the tuple unrolled.

    tied_head: a tied float embedding [V, D] of at most TIED_HEAD_MAX_BYTES is kept
    transposed instead, as "tied_head" [D, V] ("embed" dropped, so no second copy): the LM
    head multiplies it as an untied lm_head and the lookup takes its columns. SmolLM2's
    one-row decode step 7% faster, batch 32 within noise (docs/benchmarks.md, "The page
    gather and the LM head").

    fuse: plain q/k/v and gate/up weights merged (fuse_projections): the one-row decode
    step 9% faster (26.4 against 28.9 ms), the (4, 4), 32-row and 512-token steps within
    noise (docs/benchmarks.md, "One row, one token").

    pack: the plain float32 projections (wqkv, wo as [Hq * Dh, D], w_gate_up, w_down, and the
    unfused ones) and the tied head packed for the CPU's matmul kernel (models/packed.py):
    SmolLM2's 32-row decode step 89.5 -> 66.8 ms (docs/benchmarks.md, "Prefill, sampling
    and products through CPU kernels")."""
    layers = unstack_layers(params)["layers"]
    if fuse:
        layers = [fuse_projections(layer) for layer in layers]
    if pack:
        layers = [pack_projections(layer) for layer in layers]
    params = {**params, "layers": tuple(layers)}
    embed = params.get("embed")
    if (
        tied_head
        and "lm_head" not in params
        and isinstance(embed, jax.Array | np.ndarray)
        and embed.nbytes <= TIED_HEAD_MAX_BYTES
    ):
        head = jnp.asarray(embed).T.copy()  # [D, V], row-major
        params["tied_head"] = packed.pack(head) if pack else head
        del params["embed"]
    return params


PACKED_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")


def pack_projections(layer: dict) -> dict:
    """A per-layer dict with its plain float32 projections packed (models/packed.py; wo
    [Hq, Dh, D] flattened to [Hq * Dh, D] first; each left as it was where packing does not
    apply)."""
    layer = dict(layer)
    for name in PACKED_PROJECTIONS:
        w = layer.get(name)
        if isinstance(w, jax.Array | np.ndarray):
            flat = w.reshape(-1, w.shape[-1])
            if packed.pack_applies(flat):
                layer[name] = packed.pack(flat)
    return layer


def fuse_projections(layer: dict) -> dict:
    """A per-layer dict with its plain (unquantized) q/k/v weights as one "wqkv" [D, (Hq +
    2 Hkv) * Dh] and gate/up as one "w_gate_up" [D, 2 F], as vLLM's merged linears: one
    product reads x once and splits its output (forward, _mlp), fewer and larger dots for
    XLA:CPU to thread. Quantized weights stay separate."""
    layer = dict(layer)
    names = ("wq", "wk", "wv")
    if all(isinstance(layer.get(n), jax.Array | np.ndarray) for n in names):
        ws = [layer.pop(n) for n in names]
        layer["wqkv"] = jnp.concatenate([w.reshape(w.shape[0], -1) for w in ws], axis=1)
    if all(isinstance(layer.get(n), jax.Array | np.ndarray) for n in ("w_gate", "w_up")):
        layer["w_gate_up"] = jnp.concatenate([layer.pop("w_gate"), layer.pop("w_up")], axis=1)
    return layer


def unstack_layers(params: dict) -> dict:
    """params with "layers" as a list of per-layer dicts (for the unrolled loop)."""
    layers = params.get("layers")
    if not isinstance(layers, dict):
        return params
    num = max(_rows(v) for v in layers.values())
    return {**params, "layers": [layer_at(layers, i) for i in range(num)]}


def compute_logits(
    params: dict,
    cfg: ModelConfig,
    hidden: jax.Array,
    tp_axis: str | tuple[str, ...] | None = None,
    valid: jax.Array | None = None,
) -> jax.Array:
    """hidden [N, D] -> float32 logits [N, vocab] (gathered over tp_axis when vocab-split).
    valid: int32[], the rows that matter, a prefix (packed.dense; None: all): a packed head
    gives zeros for the rest."""
    if "tied_head" in params:  # the tied embedding stored transposed (switch_layers)
        logits = packed.dense(hidden, params["tied_head"], valid)
    elif cfg.tie_word_embeddings or "lm_head" not in params:
        logits = quantization.tied_logits(hidden, params["embed"])
    else:
        logits = hidden @ params["lm_head"]
    logits = logits.astype(jnp.float32)
    if cfg.final_soft_cap is not None:
        logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
    if tp_axis is not None and logits.shape[-1] != cfg.vocab_size:
        logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)
    return logits


def _feed_forward(x, layer, cfg, norm, act, tp_axis, experts, pool, lora_slots=None):
    """A layer's second half as run_layer's carry (_mlp_residual)."""
    return (_mlp_residual(x, layer, cfg, norm, act, tp_axis, experts, lora_slots), *pool), None


def _mlp_residual(x, layer, cfg, norm, act, tp_axis, experts, lora_slots=None, valid=None):
    """x plus the (post-normed) MLP of normed x (valid: packed.dense's, the real rows)."""
    h = norm(x, layer["post_attn_norm"], cfg.rms_norm_eps)
    out = _mlp(h, layer, cfg, act, tp_axis, experts, lora_slots, valid)
    if cfg.post_norms:
        out = norm(out, layer["mlp_out_norm"], cfg.rms_norm_eps)
    return x + out


def _mlp(
    h: jax.Array,
    layer: dict,
    cfg: ModelConfig,
    act,
    tp_axis,
    experts: bool,
    lora_slots=None,
    valid: jax.Array | None = None,
) -> jax.Array:
    """The feed-forward of normed h [T, D]: the gated MLP, or (experts: static, the layer's
    kind) the experts (models/moe.py); lora_slots: each token's adapter (models/lora.py);
    valid: packed.dense's, the real rows (None: all)."""
    if experts:
        return moe.moe_mlp(h, layer, cfg, act, tp_axis)
    if "w_gate_up" in layer:  # one product, split (fuse_projections)
        gate, up = jnp.split(packed.dense(h, layer["w_gate_up"], valid), 2, axis=-1)
    else:
        gate, up = packed.dense(h, layer["w_gate"], valid), packed.dense(h, layer["w_up"], valid)
    gate = act(lora.add(gate, h, layer, "gate_proj", lora_slots))
    gated = gate * lora.add(up, h, layer, "up_proj", lora_slots)
    out = lora.add(packed.dense(gated, layer["w_down"], valid), gated, layer, "down_proj",
                   lora_slots)
    return _reduce(out, tp_axis)


def _kv_axis(tp_axis):
    """The mesh axis the KV heads are split over: the first of the kv-major TP pair
    (models/sharding.py); each KV head's shard is replicated over the second."""
    return tp_axis[0] if isinstance(tp_axis, tuple) else tp_axis


def _full_rms_norm(x: jax.Array, weight: jax.Array, eps: float, num_heads: int, axis) -> jax.Array:
    """RMSNorm of x [T, H, Dh] over all num_heads heads' dims at once (OLMoE's q/k norm,
    weight [H, Dh]); with axis set the heads are split over it and the mean is summed."""
    xf = x.astype(jnp.float32)
    if axis is None:
        mean = jnp.mean(xf.reshape(xf.shape[0], -1) ** 2, axis=-1)
    else:
        total = jax.lax.psum(jnp.sum(xf * xf, axis=(1, 2)), axis)
        mean = total / (num_heads * x.shape[-1])
    xf = xf * jax.lax.rsqrt(mean + eps)[:, None, None]
    return weight * xf.astype(x.dtype)


def _reduce(x: jax.Array, tp_axis) -> jax.Array:
    """Sums a row-parallel matmul's partial results over the tensor-parallel devices."""
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


def _embed(table, cfg: ModelConfig, token_ids: jax.Array, tp_axis, dtype) -> jax.Array:
    """Embedding lookup in dtype (a quantized table: its rows dequantized); a vocab-split
    table [V / T, D] looks up its own ids and all-reduces."""
    rows = table.shape[0]
    if tp_axis is None or rows == cfg.vocab_size:
        return quantization.embed_rows(table, token_ids, dtype)
    local = token_ids - jax.lax.axis_index(tp_axis) * rows
    mine = (local >= 0) & (local < rows)
    found = quantization.embed_rows(table, jnp.clip(local, 0, rows - 1), dtype)
    x = jnp.where(mine[:, None], found, 0)
    return jax.lax.psum(x, tp_axis)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params in the layout of models.config (numpy RNG, deterministic)."""
    rng = np.random.default_rng(seed)
    d, f, hq, hkv, dh = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )

    def w(*shape):
        return jnp.asarray(rng.normal(0.0, scale, shape).astype(np.float32), dtype=dtype)

    def ones(*shape):
        return jnp.ones(shape, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        layer = {
            "input_norm": ones(d),
            "post_attn_norm": ones(d),
            "wq": w(d, hq, dh),
            "wk": w(d, hkv, dh),
            "wv": w(d, hkv, dh),
            "wo": w(hq, dh, d),
            "w_gate": w(d, f),
            "w_up": w(d, f),
            "w_down": w(f, d),
        }
        if cfg.attention_bias:
            layer.update(bq=w(hq, dh), bk=w(hkv, dh), bv=w(hkv, dh))
        if cfg.o_bias:
            layer.update(bo=w(d))
        if cfg.attention_sinks:
            layer.update(sinks=w(hq))
        if cfg.qk_norm:
            layer.update(q_norm=ones(dh), k_norm=ones(dh))
        if cfg.qk_norm_full:
            layer.update(q_norm=ones(hq, dh), k_norm=ones(hkv, dh))
        if cfg.post_norms:
            layer.update(attn_out_norm=ones(d), mlp_out_norm=ones(d))
        if cfg.kv_lora_rank:
            for name in ("wq", "wk", "wv", "wo"):
                del layer[name]
            layer.update(mla.init_attention(cfg, w, ones))
        if cfg.has_experts(i):
            e, fe, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
            del layer["w_gate"], layer["w_up"], layer["w_down"]
            layer.update(
                router=w(d, e), w_gate_exps=w(e, d, fe), w_up_exps=w(e, d, fe),
                w_down_exps=w(e, fe, d),
            )
            if cfg.router_bias:
                layer.update(router_bias=w(e))
            if cfg.router_logit_bias:
                layer.update(b_router=w(e))
            if cfg.expert_bias:
                layer.update(b_gate_exps=w(e, fe), b_up_exps=w(e, fe), b_down_exps=w(e, d))
            if fs:
                layer.update(w_gate_shared=w(d, fs), w_up_shared=w(d, fs), w_down_shared=w(fs, d))
        layers.append(layer)
    params = {"embed": w(cfg.vocab_size, d), "layers": layers, "final_norm": ones(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(d, cfg.vocab_size)
    return params
