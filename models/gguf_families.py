"""llama.cpp's Gemma 2, Gemma 3 (text), Phi-3, gpt-oss and DeepSeek-V2/V3 GGUF files: their tensor names and the
ModelConfig fields their metadata gives, as llama.cpp's convert_hf_to_gguf.py writes them
and its llama-model.cpp reads them back. models/gguf.py reads everything the architectures
share (sizes, heads, rope base, norm eps, tokenizer) and asks this module for the rest.

  gemma2   sliding window on even layers ({arch}.attention.sliding_window), attention and
           final soft caps ({arch}.attn_logit_softcapping, final_logit_softcapping; llama.cpp's
           defaults 50 and 30 when absent), no lm_head (tied), post-attention and post-MLP norms
  gemma3   five sliding-window layers to one global ({arch}.attention.sliding_window_pattern:
           a period or one bool per layer, default 6), q/k norms, the local layers' rope base
           {arch}.rope.freq_base_swa (llama.cpp's 10000 when absent), linear rope scaling on
           the global layers only
  phi3     fused blk.N.attn_qkv (q, k, v rows) and blk.N.ffn_up (gate then up rows), partial
           rotary ({arch}.rope.dimension_count), a window on every layer (0: none), LongRoPE as
           the rope_factors_short / rope_factors_long tensors with
           {arch}.rope.scaling.attn_factor and original_context_length
  gpt-oss  a window on even layers ({arch}.attention.sliding_window; llama.cpp's fixed
           pattern, transformers' default layer_types), attn_sinks, attn_output.bias, the
           router's bias (ffn_gate_inp.bias), gate_up_proj split into ffn_gate_exps and
           ffn_up_exps (with .bias; MXFP4 or float), YaRN ({arch}.rope.scaling.*: factor,
           original_context_length; not truncated, as gpt-oss's config), the clamped SwiGLU
           at llama.cpp's fixed limit 7 and alpha 1.702
  deepseek2  DeepSeek-V2/V3 (and Kimi K2): latent attention ({arch}.attention.kv_lora_rank,
           q_lora_rank when the query has its LoRA, rope.dimension_count the rotary dims; a
           query head's dims in attention.key_length_mla and a value head's in
           value_length_mla, or, in files converted before llama.cpp split kv_b, in
           key_length / value_length), attn_q_a / attn_q_a_norm / attn_q_b or attn_q,
           attn_kv_a_mqa, attn_kv_a_norm, and kv_b_proj either whole (attn_kv_b) or as
           llama.cpp's converter now splits it (attn_k_b [H, r, dn], transposed, and attn_v_b
           [H, dv, r]; joined back here, kv_b_rows); rotary dims in the checkpoint's
           interleaved pairs (GGML's "norm" rope: not permuted); experts as glm4moe's
           (leading_dense_block_count, ffn_*_shexp, exp_probs_b, expert_weights_scale /
           _norm, expert_group_count / _used_count) with expert_gating_func sigmoid for V3
           (DeepseekV3ForCausalLM) and softmax for V2 (DeepseekV2ForCausalLM: groups ranked
           by their best expert, as V2's group_limited_greedy); YaRN as rope.scaling.type
           "yarn", factor, original_context_length and yarn_log_multiplier (0.1 x
           mscale_all_dim; llama.cpp assumes mscale equal to it, so the rotary embedding is
           not scaled). Multi-token-prediction blocks (nextn_predict_layers, after the
           decoder's) are left unread, as for glm4moe.

Gemma's RMSNorm multiplies by (1 + w): the converter stores every "*norm.weight" with the 1
already added (float32 sums), which is the layout's value (models/config.py), so those
tensors load as they are (`stored_norm_specs`). The converter writes no
query_pre_attn_scalar: llama.cpp scales by 1 / sqrt(head_dim), except for the 27B models
(hidden / heads), which it knows by their layer count; so does this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from models.config import LongRopeScaling, ModelConfig, YarnRopeScaling, yarn_mscale

ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",  # V2 when its experts' gating is softmax
}
# Architectures whose key and value head dims are the latent attention's (deepseek2_fields).
MLA_ARCHITECTURES = ("deepseek2",)
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
# Hugging Face layer tensor -> llama.cpp's, where these architectures differ from llama's.
_GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    },
    # The experts' names are gpt_oss_specs' (the HF checkpoint fuses gate and up).
    "gpt-oss": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.o_proj.bias": "attn_output.bias",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        "mlp.experts.gate_proj": "ffn_gate_exps.weight",
        "mlp.experts.up_proj": "ffn_up_exps.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.experts.gate_proj_bias": "ffn_gate_exps.bias",
        "mlp.experts.up_proj_bias": "ffn_up_exps.bias",
        "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    },
    "deepseek2": {
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    },
}
# Layer counts by which llama.cpp recognises Gemma's 27B models (scaled by hidden / heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0


def extra_tensors(arch: str, num_layers: int) -> set[str]:
    """Tensors of a file that are not params by name but that config_fields or kv_b_rows
    read."""
    if arch == "phi3":
        return {ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT}
    if arch == "deepseek2":
        return {f"blk.{i}.attn_{p}_b.weight" for i in range(num_layers) for p in "kv"}
    return set()


def kv_b_rows(config: ModelConfig, name: str, tensors: Any, read: Callable) -> np.ndarray | None:
    """A deepseek2 file's blk.N.attn_kv_b.weight [H * (dn + dv), r] (Hugging Face's
    kv_b_proj) joined from the halves llama.cpp's converter writes instead, attn_k_b [H, r,
    dn] (transposed) and attn_v_b [H, dv, r]; None when name is not such a missing tensor."""
    if not config.kv_lora_rank or name in tensors or not name.endswith(".attn_kv_b.weight"):
        return None
    k_name, v_name = (name.replace("attn_kv_b", f"attn_{p}_b") for p in "kv")
    if k_name not in tensors or v_name not in tensors:
        return None
    h, r = config.num_heads, config.kv_lora_rank
    dn, dv = config.qk_nope_head_dim, config.v_head_dim
    k_b, v_b = read(k_name), read(v_name)
    if k_b.shape != (h, r, dn) or v_b.shape != (h, dv, r):
        raise ValueError(
            f"tensors {k_name!r} {list(k_b.shape)} and {v_name!r} {list(v_b.shape)}, expected "
            f"{[h, r, dn]} and {[h, dv, r]} from the metadata"
        )
    return np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1).reshape(h * (dn + dv), r)


def config_fields(
    arch: str,
    field: Callable[..., Any],
    metadata: dict[str, Any],
    read: Callable[[str], np.ndarray],
    tensors: Any,
    *,
    hidden: int,
    num_heads: int,
    head_dim: int,
    num_layers: int,
    context_length: int,
    source: str,
) -> dict[str, Any]:
    """The ModelConfig fields of a gemma2, gemma3 or phi3 file beyond the shared ones.

    Args:
      field: field(key, default, required=False): the {arch}.key metadata value.
      metadata: all of the file's metadata (for per-layer arrays, which field refuses).
      read: a tensor by its GGUF name, as float32.
      tensors: the file's tensor names.

    Raises:
      ValueError: LongRoPE factors without their partner or without an original context
        length, a sliding-window pattern that does not fit the layers; naming the file.
    """
    if arch == "phi3":
        return _phi3_fields(field, read, tensors, head_dim, context_length, source)
    if arch == "gpt-oss":
        return _gpt_oss_fields(field, tensors, num_layers, source)
    if arch == "deepseek2":
        return deepseek2_fields(field, tensors, num_heads, source)
    window = int(field("attention.sliding_window", 0)) or None
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(key, 2 if arch == "gemma2" else _GEMMA3_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{source}: {key} has {len(pattern)} entries for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern(n): the last layer of every n is global
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    big = num_layers == _GEMMA_27B_LAYERS[arch]
    fields = {
        "sliding_window": window,
        "layer_windows": tuple(window if s else None for s in sliding),
        "hidden_act": "gelu_pytorch_tanh",
        "gemma_norms": True,
        "post_norms": True,
        "embed_scale": True,
        "query_pre_attn_scalar": float(hidden // num_heads if big else head_dim),
    }
    if arch == "gemma2":
        fields["attn_soft_cap"] = float(field("attn_logit_softcapping", 50.0))
        fields["final_soft_cap"] = float(field("final_logit_softcapping", 30.0))
    else:
        cap = field("final_logit_softcapping")
        fields["final_soft_cap"] = None if cap is None else float(cap)
        fields["rope_local_theta"] = float(field("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    return fields


def _phi3_fields(
    field: Callable[..., Any],
    read: Callable[[str], np.ndarray],
    tensors: Any,
    head_dim: int,
    context_length: int,
    source: str,
) -> dict[str, Any]:
    rotary = int(field("rope.dimension_count", head_dim))
    fields: dict[str, Any] = {
        "hidden_act": "silu",
        "partial_rotary_factor": rotary / head_dim,
        "sliding_window": int(field("attention.sliding_window", 0)) or None,
    }
    found = [n for n in (ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG) if n in tensors]
    if len(found) == 1:
        raise ValueError(f"{source}: LongRoPE needs both rope factor tensors; only {found[0]!r}")
    if found:
        original = int(field("rope.scaling.original_context_length", required=True))
        attention = field("rope.scaling.attn_factor")
        if attention is None:  # the converter's (and transformers') LongRoPE default
            scale = context_length / original
            attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        fields["rope_scaling"] = LongRopeScaling(
            short_factor=tuple(float(x) for x in read(ROPE_FACTORS_SHORT).reshape(-1)),
            long_factor=tuple(float(x) for x in read(ROPE_FACTORS_LONG).reshape(-1)),
            original_max_position_embeddings=original,
            attention_factor=float(attention),
        )
    return fields


def _gpt_oss_fields(field: Callable[..., Any], tensors: Any, num_layers: int, source: str):
    window = field("attention.sliding_window")
    if window is None:
        raise ValueError(f"{source}: missing metadata field 'gpt-oss.attention.sliding_window'")
    scaling = field("rope.scaling.type")
    if scaling != "yarn":
        raise ValueError(f"{source}: gpt-oss.rope.scaling.type {scaling!r}; gpt-oss uses yarn")
    factor = float(field("rope.scaling.factor", required=True))
    return {
        "sliding_window": int(window),
        "layer_windows": tuple(int(window) if i % 2 == 0 else None for i in range(num_layers)),
        "rope_scaling": YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=int(
                field("rope.scaling.original_context_length", required=True)
            ),
            beta_fast=float(field("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(field("rope.scaling.yarn_beta_slow", 1.0)),
            truncate=False,
            attention_factor=yarn_mscale(factor),
        ),
        "attention_sinks": True,
        "o_bias": "blk.0.attn_output.bias" in tensors,
        "moe_scoring": "topk_softmax",
        "router_logit_bias": True,
        "expert_bias": True,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }


# gguf.ExpertGatingFuncType: llama.cpp's codes for softmax and sigmoid router scores.
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def deepseek2_fields(field: Callable[..., Any], tensors: Any, num_heads: int, source: str):
    """DeepSeek-V2/V3's latent attention, experts and YaRN from a deepseek2 file's metadata
    (module docstring), with DeepSeek-V3's values where llama.cpp falls back on them."""
    r = int(field("attention.kv_lora_rank", required=True))
    dr = int(field("rope.dimension_count", required=True))
    q_rank = int(field("attention.q_lora_rank", 0)) if "blk.0.attn_q_a.weight" in tensors else 0
    qk = int(field("attention.key_length_mla", 0) or field("attention.key_length", required=True))
    dv = int(field("attention.value_length_mla", 0) or field("attention.value_length", 0))
    if qk <= dr or dv <= 0:
        raise ValueError(
            f"{source}: deepseek2 query head dim {qk} must exceed rope.dimension_count {dr} and "
            f"the value head dim ({dv}) be > 0"
        )
    gating = int(field("expert_gating_func", _SOFTMAX_GATING))
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ValueError(
            f"{source}: deepseek2.expert_gating_func {gating} is not supported; supported: "
            f"{_SOFTMAX_GATING} (softmax, V2), {_SIGMOID_GATING} (sigmoid, V3)"
        )
    v3 = gating == _SIGMOID_GATING
    fields: dict[str, Any] = {
        "architecture": "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM",
        "kv_lora_rank": r, "q_lora_rank": q_rank, "qk_nope_head_dim": qk - dr,
        "qk_rope_head_dim": dr, "v_head_dim": dv, "rope_interleave": True,
        "num_kv_heads": 1, "head_dim": (r + dr) // 2,
        "norm_topk_prob": bool(field("expert_weights_norm", v3)),
        "moe_scoring": "sigmoid" if v3 else "softmax",
        "router_bias": any(n.endswith(".exp_probs_b.bias") for n in tensors),
        "num_expert_groups": int(field("expert_group_count", 1)),
        "topk_groups": int(field("expert_group_used_count", 1)),
        "group_score": "top2" if v3 else "max",
        "routed_scaling_factor": float(field("expert_weights_scale", 1.0)),
        "num_shared_experts": int(field("expert_shared_count", 0)),
        "num_dense_layers": int(field("leading_dense_block_count", 0)),
    }  # fmt: skip
    scaling = field("rope.scaling.type")
    if scaling == "yarn":
        factor = float(field("rope.scaling.factor", required=True))
        fields["rope_scaling"] = YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=int(
                field("rope.scaling.original_context_length", required=True)
            ),
            beta_fast=float(field("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(field("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=1.0,
            # 0.1 x mscale_all_dim, stored as float32: 6 decimals recover the config's value.
            mscale_all_dim=round(float(field("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6),
        )
    elif scaling not in (None, "none"):
        raise ValueError(f"{source}: deepseek2.rope.scaling.type {scaling!r} is not supported")
    return fields


def gpt_oss_specs(config: ModelConfig, specs: dict[tuple, Any]) -> dict[tuple, Any]:
    """specs with gpt-oss's experts as llama.cpp stores them: gate, up and down apart, each
    [E, out, in] (to the layout's [E, in, out]), their biases [E, out]; other models' as they
    are. The HF names here are the ones LAYER_NAMES["gpt-oss"] maps."""
    if not config.expert_bias:
        return specs
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size

    def swap(w: np.ndarray) -> np.ndarray:
        return np.swapaxes(w, 1, 2)

    shapes = {
        "w_gate_exps": ("gate_proj", (e, f, d), swap),
        "w_up_exps": ("up_proj", (e, f, d), swap),
        "w_down_exps": ("down_proj", (e, d, f), swap),
        "b_gate_exps": ("gate_proj_bias", (e, f), None),
        "b_up_exps": ("up_proj_bias", (e, f), None),
        "b_down_exps": ("down_proj_bias", (e, d), None),
    }
    out = dict(specs)
    for key, spec in specs.items():
        if key[0] == "layers" and key[-1] in shapes:
            name, shape, fn = shapes[key[-1]]
            fn = fn or (lambda w: w)
            hf_name = f"model.layers.{key[1]}.mlp.experts.{name}"
            out[key] = dataclasses.replace(
                spec, hf_name=hf_name, hf_shape=shape, to_layout=fn, to_hf=fn, interleaved=None
            )
    return out


def stored_norm_specs(config: ModelConfig, specs: dict[tuple, Any]) -> dict[tuple, Any]:
    """specs with Gemma's norm weights read as stored: the file holds w + 1 already."""
    if not config.gemma_norms:
        return specs

    def as_stored(w: np.ndarray) -> np.ndarray:
        return w.astype(np.float32)

    return {
        key: dataclasses.replace(spec, to_layout=as_stored, to_hf=as_stored)
        if spec.hf_name.endswith("norm.weight")
        else spec
        for key, spec in specs.items()
    }
