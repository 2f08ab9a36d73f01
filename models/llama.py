"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as pure functions over a params pytree.

`forward` runs one ragged batch of new tokens through the model: it writes each token's K/V
into its slot of the paged pool and attends over the sequence's pages. The pool comes in and
goes out (the caller donates it), so under jit the update is in place.

One pool for every layer: K and V are each [num_kv_heads, num_layers * N, page_size,
head_dim], layer l's pages at l * N .. l * N + N - 1, so a layer's attention reads the whole
pool (a kernel operand, never a slice copy) through its page table offset by l * N, and the
layers can run under lax.scan with the pool as the loop's carry, updated in place.

Tensor parallelism: with `tp_axis` set, the functions run inside shard_map on one device's
shards (layout of models/sharding.py): the same code over local heads and columns, plus one
psum after each row-parallel matmul (wo, w_down), one for the vocab-parallel embedding, and an
all-gather of the logits. With tp_axis None nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from models.config import ModelConfig

# attention_backend -> dispatcher arguments: None/"pallas" pick the platform's best (the
# reference on CPU); "pallas_interpret" runs the GPU kernel in the Pallas interpreter.
_ATTENTION_BACKENDS = {
    None: {},
    "pallas": {},
    "reference": {"backend": "cpu"},
    "pallas_interpret": {"interpret": True},
}

# (k_pages, v_pages), each [num_kv_heads, num_layers * pages_per_layer, page_size, head_dim].
KVPool = tuple[jax.Array, jax.Array]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama 3 scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is not None:
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


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, Dh] of positions [T] (Hugging Face rotate-half layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, Dh] rotated by rope_cos_sin's tables."""
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


def _write_kv(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes new [T, Hkv, Dh] into flat slots (page * page_size + offset) of pages."""
    hkv, num_pages, page_size, dh = pages.shape
    flat = pages.reshape(hkv, num_pages * page_size, dh)
    flat = flat.at[:, slot_mapping].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype))
    return flat.reshape(hkv, num_pages, page_size, dh)


def layer_offsets(cfg: ModelConfig, k_pages: jax.Array) -> jax.Array:
    """int32[num_layers]: the first physical page of each layer's part of the pool."""
    return jnp.arange(cfg.num_layers, dtype=jnp.int32) * (k_pages.shape[1] // cfg.num_layers)


def forward(
    params: dict,
    cfg: ModelConfig,
    kv_pages: KVPool,
    token_ids: jax.Array,  # int32[T]
    positions: jax.Array,  # int32[T]
    slot_mapping: jax.Array,  # int32[T]: flat slot (page * page_size + offset) in one layer
    context_lens: jax.Array,  # int32[S]: cached tokens per sequence after this step
    page_table: jax.Array,  # int32[S, P]: pages of one layer (0 = the null page)
    query_start: jax.Array,  # int32[S + 1]
    *,
    decode_only: bool = False,
    max_query_len: int | None = None,
    attention_backend: str | None = None,
    tp_axis: str | tuple[str, ...] | None = None,
) -> tuple[jax.Array, KVPool]:
    """Runs the decoder over a ragged batch; returns final hidden states [T, D] and the pool.

    The pool holds every layer: layer l's page p is physical page l * N + p (N pages per
    layer), so each layer's attention reads the whole pool through its page table offset by
    l * N (layer_offsets), a plain kernel operand, never a slice copy; page 0 of each layer
    is that layer's null page. Layers run under lax.scan when params["layers"] is stacked
    (a dict of [num_layers, ...] arrays, models/config.py), unrolled when it is a list of
    per-layer dicts; the same layer function runs either way.

    decode_only (static): every sequence has exactly one query token and row s of the
    token arrays belongs to sequence s (T == S), so the decode kernel can serve the step.
    max_query_len (static): the query tokens per sequence the step usually has at most (a
    verification step's k + 1; None: no bound), a hint for the CPU attention.
    tp_axis (static): the shard_map axis params and pools are split over (None: unsplit).
    """
    attn_kwargs = dict(
        sm_scale=cfg.sm_scale,
        sliding_window=cfg.sliding_window,
        **_ATTENTION_BACKENDS[attention_backend],
    )
    cos, sin = _computed_once(*rope_cos_sin(positions, rope_inv_freq(cfg)))
    x = _embed(params["embed"], cfg, token_ids, tp_axis)  # [T, D]
    k_pages, v_pages = kv_pages
    page_size = k_pages.shape[2]
    offsets = layer_offsets(cfg, k_pages)

    def run_layer(carry, layer_and_offset):
        x, k_pages, v_pages = carry
        layer, offset = layer_and_offset
        h = rms_norm(x, layer["input_norm"], cfg.rms_norm_eps)
        q = jnp.einsum("td,dhk->thk", h, layer["wq"])
        k = jnp.einsum("td,dhk->thk", h, layer["wk"])
        v = jnp.einsum("td,dhk->thk", h, layer["wv"])
        if cfg.attention_bias:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
        if cfg.qk_norm:
            q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin)
        slots = slot_mapping + offset * page_size
        k_pages = _write_kv(k_pages, k, slots)
        v_pages = _write_kv(v_pages, v, slots)
        table = page_table + offset
        if decode_only:
            attn = pallas_kernels.paged_decode_attention(
                q, k_pages, v_pages, context_lens, table, **attn_kwargs
            )
        else:
            attn = pallas_kernels.paged_prefill_attention(
                q, k_pages, v_pages, context_lens, table, query_start,
                max_query_len=max_query_len, **attn_kwargs
            )
        x = x + _reduce(jnp.einsum("thk,hkd->td", attn, layer["wo"]), tp_axis)
        h = rms_norm(x, layer["post_attn_norm"], cfg.rms_norm_eps)
        gate = jax.nn.silu(h @ layer["w_gate"])
        x = x + _reduce((gate * (h @ layer["w_up"])) @ layer["w_down"], tp_axis)
        return (x, k_pages, v_pages), None

    carry = (x, k_pages, v_pages)
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked: one traced layer
        carry, _ = jax.lax.scan(run_layer, carry, (layers, offsets))
    else:
        for i, layer in enumerate(layers):
            carry, _ = run_layer(carry, (layer, i * (k_pages.shape[1] // cfg.num_layers)))
    x, k_pages, v_pages = carry
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), (k_pages, v_pages)


def stack_layers(params: dict, place=None) -> dict:
    """params with "layers" as one dict of [num_layers, ...] arrays (for lax.scan); params
    itself is not changed. place(name, array), if given, puts each stacked array where it
    belongs (its sharding). params without layers (a runner that only replays device calls)
    are returned as they are."""
    layers = params.get("layers")
    if not layers or isinstance(layers, dict):
        return params
    stacked = {}
    for name in layers[0]:
        array = jnp.stack([layer[name] for layer in layers])
        stacked[name] = array if place is None else place(name, array)
    return {**params, "layers": stacked}


def unstack_layers(params: dict) -> dict:
    """params with "layers" as a list of per-layer dicts (for the unrolled loop)."""
    layers = params.get("layers")
    if not isinstance(layers, dict):
        return params
    num = len(next(iter(layers.values())))
    return {**params, "layers": [{k: v[i] for k, v in layers.items()} for i in range(num)]}


def compute_logits(
    params: dict, cfg: ModelConfig, hidden: jax.Array, tp_axis: str | tuple[str, ...] | None = None
) -> jax.Array:
    """hidden [N, D] -> float32 logits [N, vocab] (gathered over tp_axis when vocab-split)."""
    if cfg.tie_word_embeddings or "lm_head" not in params:
        logits = hidden @ params["embed"].T
    else:
        logits = hidden @ params["lm_head"]
    logits = logits.astype(jnp.float32)
    if tp_axis is not None and logits.shape[-1] != cfg.vocab_size:
        logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)
    return logits


def _reduce(x: jax.Array, tp_axis) -> jax.Array:
    """Sums a row-parallel matmul's partial results over the tensor-parallel devices."""
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


def _embed(table: jax.Array, cfg: ModelConfig, token_ids: jax.Array, tp_axis) -> jax.Array:
    """Embedding lookup; a vocab-split table [V / T, D] looks up its own ids and all-reduces."""
    rows = table.shape[0]
    if tp_axis is None or rows == cfg.vocab_size:
        return table[token_ids]
    local = token_ids - jax.lax.axis_index(tp_axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], 0)
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
    for _ in range(cfg.num_layers):
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
        if cfg.qk_norm:
            layer.update(q_norm=ones(dh), k_norm=ones(dh))
        layers.append(layer)
    params = {"embed": w(cfg.vocab_size, d), "layers": layers, "final_norm": ones(d)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(d, cfg.vocab_size)
    return params
