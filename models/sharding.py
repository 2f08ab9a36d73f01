"""Tensor-parallel layout of the params and the KV pools: a Mesh and one PartitionSpec per array.

Mesh axes ("data", "kv", "rep") of shape (D, kv, rep), with T = kv * rep devices per replica:

    kv  = min(T, num_kv_heads)    KV heads are split over "kv"
    rep = T // kv                 each KV head is held by `rep` devices (T > num_kv_heads)

The tensor-parallel axis is the pair TP = ("kv", "rep"), kv-major. Query heads, the MLP's
intermediate dim and the vocab are split over TP; the K/V projections and the page pools only
over "kv" (replicated over "rep"). Because query head h uses KV head h // (Hq / Hkv) and TP is
kv-major, the device at (i, r) holds query heads whose KV head is exactly its KV head i:

    q heads:  | kv 0: r0 r1 | kv 1: r0 r1 |      (T = 4, Hkv = 2, Hq = 8: 2 q heads each)
    kv heads: | 0     0     | 1     1     |

Megatron layout: wq/wk/wv, w_gate/w_up and lm_head are column-parallel (output dim split),
wo and w_down row-parallel (input dim split, followed by one all-reduce each), embed is
vocab-parallel (masked lookup + all-reduce). Norms are replicated. Experts (models/moe.py):
the router replicated; each expert's F split like w_gate/w_down, or with expert parallelism
(ModelConfig.expert_parallel) whole experts split over TP, E / T per device; the router
bias replicated, shared experts split over their F like a dense MLP under either layout.
gpt-oss: sinks split as the query heads; the o and down biases replicated (added once after
the all-reduce); the gate/up expert biases split as their experts' F, or with the experts.
Dense MLP layers before the expert layers (GLM-4.5) are split as a dense model's. Latent
attention (DeepSeek, models/mla.py): the query and up-projections split over heads, the
latent's projection and the one-head pool replicated (kv = 1). Per-device
pool bytes are total / min(T, num_kv_heads).

A quantized param (models/quantization.py QuantizedWeight) is split as the float weight it
replaces (quantized_spec): its int8/fp8 values exactly so; per-output-channel scales along the
output axes (column-parallel: split with the channels; row-parallel wo, w_down: replicated);
per-block scales and offsets (GGUF) with their blocks, which needs each device's slice of the
blocked axis to be whole blocks (else a ValueError naming the tensor).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import lora as lora_params
from models.config import ModelConfig
from models.quantization import QuantizedWeight, is_quantized

DATA = "data"
KV = "kv"
REP = "rep"
TP = (KV, REP)  # the tensor-parallel axis (kv-major)
# [num_kv_heads, num_layers * num_pages, page_size, head_dim]: split over KV heads
POOL_SPEC = P(KV, None, None, None)


def tp_split(num_kv_heads: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(kv, rep): KV-head shards and the replication of each KV head."""
    kv = min(tensor_parallel_size, num_kv_heads)
    return kv, tensor_parallel_size // kv


def check_tp(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raises ValueError naming the dimension that tensor_parallel_size does not divide."""
    t = tensor_parallel_size
    if t < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {t}")
    hkv = cfg.num_kv_heads
    if (hkv % t) if t <= hkv else (t % hkv):
        raise ValueError(
            f"tensor_parallel_size ({t}) must divide num_key_value_heads ({hkv}) or be a "
            "multiple of it"
        )
    split = [("num_attention_heads", cfg.num_heads)]
    if not cfg.num_experts or cfg.num_dense_layers:
        split.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts and cfg.num_shared_experts:
        split.append(("the shared experts' intermediate size", cfg.shared_intermediate_size))
    if cfg.num_experts and cfg.expert_parallel:
        split.append(("num_experts", cfg.num_experts))
    elif cfg.num_experts:
        split.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, size in split:
        if size % t:
            raise ValueError(f"tensor_parallel_size ({t}) must divide {name} ({size})")


def make_mesh(
    cfg: ModelConfig, tensor_parallel_size: int, data_parallel_size: int = 1, devices=None
) -> Mesh:
    """Mesh ("data", "kv", "rep") over the first D * T devices (jax.devices() by default)."""
    check_tp(cfg, tensor_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel_size * data_parallel_size ({tensor_parallel_size} x "
            f"{data_parallel_size}) exceeds the {len(devices)} devices available"
        )
    kv, rep = tp_split(cfg.num_kv_heads, tensor_parallel_size)
    return Mesh(np.array(devices[:n]).reshape(data_parallel_size, kv, rep), (DATA, KV, REP))


def replica_mesh(mesh: Mesh, index: int) -> Mesh:
    """The (1, kv, rep) sub-mesh of data-parallel replica `index`."""
    return Mesh(mesh.devices[index : index + 1], mesh.axis_names)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[KV] * mesh.shape[REP]


def vocab_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> bool:
    """Embedding and LM head are split over the vocab when it divides evenly (else replicated)."""
    return cfg.vocab_size % tensor_parallel_size == 0


def lora_specs(cfg: ModelConfig) -> dict:
    """The LoRA slot params' specs of one layer (models/lora.py, A [in, N, r], B [N, r, out]):
    a column-parallel module's A replicated and B split over its output as the module's (q,
    gate, up over TP; k, v over "kv"); a row-parallel one's (o, down) A split over its input
    and B replicated, the partial update joining the module's all-reduce."""
    out_split = {"q_proj": TP, "k_proj": KV, "v_proj": KV, "gate_proj": TP, "up_proj": TP}
    specs = {}
    for module in lora_params.module_dims(cfg):
        if module in out_split:
            a, b = P(), P(None, None, out_split[module])
        else:
            a, b = P(TP, None, None), P()
        specs[lora_params.a_name(module)], specs[lora_params.b_name(module)] = a, b
    return specs


def param_specs(
    cfg: ModelConfig, tensor_parallel_size: int, *, stacked: bool = False, lora: bool = False
) -> dict:
    """PartitionSpecs in the params layout of models/config.py; stacked: "layers" as one
    dict of [num_layers, ...] arrays (models/llama.py stack_layers), each spec led by None.
    lora: with the LoRA slot params in every layer (lora_specs)."""
    vocab = TP if vocab_parallel(cfg, tensor_parallel_size) else None
    col = P(None, TP)  # [hidden, F]
    heads_q = P(None, TP, None)  # [hidden, H, Dh]
    heads_kv = P(None, KV, None)
    layer = {
        "input_norm": P(),
        "post_attn_norm": P(),
        "wq": heads_q,
        "wk": heads_kv,
        "wv": heads_kv,
        "wo": P(TP, None, None),  # [Hq, Dh, hidden]: row-parallel
        "w_gate": col,
        "w_up": col,
        "w_down": P(TP, None),  # [F, hidden]: row-parallel
    }
    if cfg.attention_bias:
        layer.update(bq=P(TP, None), bk=P(KV, None), bv=P(KV, None))
    if cfg.o_bias:  # added after wo's all-reduce
        layer.update(bo=P())
    if cfg.attention_sinks:  # [Hq]: split as the query heads
        layer.update(sinks=P(TP))
    if cfg.qk_norm:
        layer.update(q_norm=P(), k_norm=P())
    if cfg.post_norms:
        layer.update(attn_out_norm=P(), mlp_out_norm=P())
    if cfg.qk_norm_full:  # [H, Dh], split as the heads
        layer.update(q_norm=P(TP, None), k_norm=P(KV, None))
    if cfg.kv_lora_rank:  # latent attention (models/mla.py): heads split, the latent's not
        for name in ("wq", "wk", "wv"):
            del layer[name]
        layer.update(wkv_a=P(), kv_a_norm=P(), wkv_b=P(None, TP, None))
        if cfg.q_lora_rank:
            layer.update(wq_a=P(), q_a_norm=P(), wq_b=P(None, TP, None))
        else:
            layer["wq"] = heads_q
    expert_layer = {}
    if cfg.num_experts:  # [E, D, F], [E, F, D]: experts split, or each expert's F
        if cfg.expert_parallel:
            up = down = P(TP, None, None)
        else:
            up, down = P(None, None, TP), P(None, TP, None)
        expert_layer = {"router": P(), "w_gate_exps": up, "w_up_exps": up, "w_down_exps": down}
        if cfg.router_bias:
            expert_layer["router_bias"] = P()
        if cfg.router_logit_bias:
            expert_layer["b_router"] = P()
        if cfg.expert_bias:  # [E, F] as the experts' F (or experts); [E, D] replicated
            bias = P(TP, None) if cfg.expert_parallel else P(None, TP)
            expert_layer.update(b_gate_exps=bias, b_up_exps=bias, b_down_exps=P())
        if cfg.num_shared_experts:
            expert_layer.update(w_gate_shared=col, w_up_shared=col, w_down_shared=P(TP, None))
    mlp = ("w_gate", "w_up", "w_down")

    def layer_specs(i: int) -> dict:  # layer i's names (models/config.py)
        if not cfg.has_experts(i):
            return dict(layer)
        return {**{k: v for k, v in layer.items() if k not in mlp}, **expert_layer}

    lora_layer = lora_specs(cfg) if lora else {}
    layer.update(lora_layer)  # expert layers take the attention's from layer
    every = {**layer, **expert_layer}
    if cfg.num_experts and not cfg.num_dense_layers:
        every = layer_specs(0)
    specs = {
        "embed": P(vocab, None),
        "layers": (
            {name: P(None, *spec) for name, spec in every.items()}
            if stacked
            else [layer_specs(i) for i in range(cfg.num_layers)]
        ),
        "final_norm": P(),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, vocab)
    return specs


def param_shardings(cfg: ModelConfig, mesh: Mesh, *, stacked: bool = False) -> dict:
    """NamedShardings in the params layout (replicated over "data"); stacked as param_specs."""
    specs = param_specs(cfg, tp_size(mesh), stacked=stacked)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)


def quantized_spec(spec: P, w: QuantizedWeight, mesh: Mesh, name: str) -> QuantizedWeight:
    """The specs of w's arrays (a QuantizedWeight of PartitionSpecs) when spec is the float
    weight's: q takes spec; the scale (and offset) keep spec's entry on every axis where they
    have one value per element or per block of q, and are unsplit where they have one value
    for the whole axis (a per-channel scale's contraction axes, size 1).

        w_down [F, D] row-parallel P(TP, None), per channel: scale [1, D]      P(None, None)
                                                 per block g: scale [F / g, D]  P(TP, None)

    Raises:
      ValueError: a split axis of per-block scales whose slice per device is not whole
        blocks (the one combination that cannot shard), naming name and the sizes.
    """
    entries = tuple(spec) + (None,) * (w.q.ndim - len(spec))
    out = []
    for axis, entry in enumerate(entries):
        if entry is None or (w.scale.shape[axis] == 1 and w.q.shape[axis] != 1):
            out.append(None)
            continue
        n = int(np.prod([mesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,))]))
        if w.scale.shape[axis] % n:
            size, group = w.q.shape[axis], w.q.shape[axis] // w.scale.shape[axis]
            raise ValueError(
                f"{name}: tensor parallelism over {n} devices gives each {size // n} of its "
                f"{size} blocked elements, not whole quantization blocks of {group}; use a "
                f"tensor_parallel_size dividing {w.scale.shape[axis]}, or no --quantization"
            )
        out.append(entry)
    scale = P(*out)
    offset = None if w.offset is None else scale
    return QuantizedWeight(spec, scale, w.group, w.group_axis, offset)


def specs_for(specs: dict, params: dict, mesh: Mesh) -> dict:
    """specs (param_specs, same layout as params) with each quantized param's spec expanded
    by quantized_spec, so that the two trees match (shard_map's in_specs, device_put).
    Without quantized params, specs as they are (params may then be a partial tree)."""
    if not any(map(is_quantized, jax.tree_util.tree_leaves(params, is_leaf=is_quantized))):
        return specs

    def one(path, spec, value):
        if not is_quantized(value):
            return spec
        return quantized_spec(spec, value, mesh, jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(one, specs, params)


def quantized_shardings(sharding: NamedSharding, w: QuantizedWeight, name: str) -> QuantizedWeight:
    """quantized_spec as NamedShardings on sharding's mesh (sharding: the float weight's)."""
    specs = quantized_spec(sharding.spec, w, sharding.mesh, name)
    return jax.tree_util.tree_map(lambda s: NamedSharding(sharding.mesh, s), specs)


def comm_bytes_per_step(
    *,
    hidden: int,
    num_layers: int,
    vocab: int,
    num_tokens: int,
    num_seqs: int,
    tensor_parallel_size: int,
    itemsize: int = 2,
) -> dict[str, float]:
    """Bytes each device sends in one step under this layout (ring collectives).

    Per layer two all-reduces of the [tokens, hidden] activations (after wo and w_down), one
    for the vocab-parallel embedding, and one all-gather of float32 logits [seqs, vocab]. A
    ring all-reduce of B bytes sends 2 (T - 1) / T * B per device; an all-gather (T - 1) / T * B.
    """
    t = tensor_parallel_size
    act = num_tokens * hidden * itemsize
    all_reduce = 2 * (t - 1) / t * act
    layers = 2 * num_layers * all_reduce
    embed = all_reduce
    logits = (t - 1) / t * num_seqs * vocab * 4
    return {
        "all_reduces": 2 * num_layers + 1,
        "layers": layers,
        "embedding": embed,
        "logits": logits,
        "total": layers + embed + logits,
    }
