"""GGUF files of Gemma 2, Gemma 3 (text) and Phi-3 load equal to the Hugging Face directory
they were converted from (issue 28.1), and their metadata errors.

Both forms are written here without torch: a Hugging Face directory of random float32
weights (numpy, safetensors) with the demo tokenizer, and the GGUF llama.cpp's
convert_hf_to_gguf.py makes of it, written with gguf.GGUFWriter: tensor names from gguf's own
name map (gguf.get_tensor_name_map), Gemma's "*norm.weight" stored with the 1 of its (1 + w)
added, Gemma 2's lm_head dropped, Phi-3's fused attn_qkv / ffn_up kept fused and its LongRoPE
factors as rope_factors_short / rope_factors_long, and the metadata keys the converter writes.
The two loads give the same ModelConfig (up to GGUF's float32 metadata), exactly the same
params, and the same greedy tokens through the engine; a Q8_0 file's projections (Phi-3's
fused ones split) keep their blocks as int8 under --quantization int8.
"""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
from checkpoints import add_gguf_tokenizer, assert_same_params, finish_gguf
from dense_families import engine_greedy

from models import quantization as quant
from models.config import LongRopeScaling
from models.gguf import read_gguf_config
from models.loader import load_hf_model, load_model

WINDOW = 8
_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "gemma2": {
        **_COMMON,
        "architectures": ["Gemma2ForCausalLM"],
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # llama.cpp scales by 1 / sqrt(head_dim) (Gemma 2 2B / 9B); GGUF has no field for it.
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    # 8 layers of the 5 local : 1 global pattern; linear scaling on the global layers.
    "gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 8,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "phi3": {
        **_COMMON,
        "architectures": ["Phi3ForCausalLM"],
        "num_hidden_layers": 3,
        "original_max_position_embeddings": 256,
        "sliding_window": WINDOW,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # LongRoPE from an original context of 16 tokens: prompt and generation cross into the
    # long factors.
    "phi3_longrope": {
        **_COMMON,
        "architectures": ["Phi3ForCausalLM"],
        "num_hidden_layers": 2,
        "original_max_position_embeddings": 16,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.125 * i for i in range(8)],
            "long_factor": [1.0 + 0.5 * i for i in range(8)],
        },
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}
_GGUF_ARCHS = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def _hf_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under the architecture's Hugging Face names: N(0, 0.1), norms about 0
    for Gemma's (1 + w) and about 1 for Phi-3's."""
    arch = cfg["architectures"][0]
    gemma = arch.startswith("Gemma")
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or d // hq

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return w(n) if gemma else 1 + w(n)

    out = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(d)
        out[p + "post_attention_layernorm.weight"] = norm(d)
        out[p + "self_attn.o_proj.weight"] = w(d, hq * dh)
        out[p + "mlp.down_proj.weight"] = w(d, f)
        if gemma:
            out[p + "pre_feedforward_layernorm.weight"] = norm(d)
            out[p + "post_feedforward_layernorm.weight"] = norm(d)
            out[p + "self_attn.q_proj.weight"] = w(hq * dh, d)
            out[p + "self_attn.k_proj.weight"] = w(hkv * dh, d)
            out[p + "self_attn.v_proj.weight"] = w(hkv * dh, d)
            out[p + "mlp.gate_proj.weight"] = w(f, d)
            out[p + "mlp.up_proj.weight"] = w(f, d)
        else:
            out[p + "self_attn.qkv_proj.weight"] = w((hq + 2 * hkv) * dh, d)
            out[p + "mlp.gate_up_proj.weight"] = w(2 * f, d)
        if arch == "Gemma3ForCausalLM":
            out[p + "self_attn.q_norm.weight"] = norm(dh)
            out[p + "self_attn.k_norm.weight"] = norm(dh)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, d)
    return out


def write_hf_dir(path, family: str, *, seed: int = 0):
    """The family's Hugging Face directory: config.json, model.safetensors, the demo
    tokenizer.json and generation_config.json."""
    from safetensors.numpy import save_file

    from models.demo import BOS_TOKEN, EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    cfg = {
        **FAMILIES[family],
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos]}) + "\n"
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tensors = _hf_tensors(cfg, np.random.default_rng(seed))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_gguf(
    hf_dir,
    out,
    *,
    skip: tuple[str, ...] = (),
    metadata: dict | None = None,
    q8_0: bool = False,
) -> None:
    """The directory as convert_hf_to_gguf.py converts it (Gemma2Model, Gemma3Model,
    Phi3MiniModel), every tensor F32, or with q8_0 the layers' projections Q8_0. skip: GGUF
    tensor names left out; metadata: more key/value pairs ({arch} formatted; int -> UINT32,
    float -> FLOAT32, list -> array)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCHS[cfg["architectures"][0]]
    n_layers, d, hq = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(d)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(hq)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    extra_tensors = {}
    if arch.startswith("gemma"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg["rope_theta"])  # the global layers'
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        scaling = cfg.get("rope_scaling") or {}
        if scaling.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":
        original = cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(cfg.get("partial_rotary_factor", 1.0) * d) // hq)
        writer.add_rope_freq_base(cfg["rope_theta"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        scaling = cfg.get("rope_scaling")
        if scaling is not None:
            scale = cfg["max_position_embeddings"] / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            for kind, key in (("LONG", "long_factor"), ("SHORT", "short_factor")):
                name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[f"ROPE_FACTORS_{kind}"]] + ".weight"
                extra_tensors[name] = np.asarray(scaling[key], np.float32)
    add_gguf_tokenizer(writer, hf_dir, cfg["bos_token_id"], cfg["eos_token_id"])
    for key, value in (metadata or {}).items():
        key = key.format(arch=arch)
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            {int: writer.add_uint32, float: writer.add_float32}[type(value)](key, value)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    tensors = dict(extra_tensors)
    for hf_name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue  # the converter drops it: Gemma 2 is tied
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            w = w + np.float32(1)
        stem, suffix = hf_name.rsplit(".", 1)
        tensors[f"{names.get_name(stem)}.{suffix}"] = w
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, w in tensors.items():
        if name in skip:
            continue
        if q8_0 and name.startswith("blk.") and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    finish_gguf(writer)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _as_stored(cfg):
    """The config with the fields GGUF stores as float32 rounded to float32."""
    rs = cfg.rope_scaling
    if isinstance(rs, LongRopeScaling):
        rs = dataclasses.replace(
            rs,
            short_factor=tuple(_f32(x) for x in rs.short_factor),
            long_factor=tuple(_f32(x) for x in rs.long_factor),
            attention_factor=_f32(rs.attention_factor),
        )
    return dataclasses.replace(cfg, rms_norm_eps=_f32(cfg.rms_norm_eps), rope_scaling=rs)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """family -> (Hugging Face directory, its GGUF)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for family in FAMILIES:
        hf_dir = write_hf_dir(root / family, family)
        write_gguf(hf_dir, root / f"{family}.gguf")
        out[family] = (hf_dir, root / f"{family}.gguf")
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_equals_hf_directory(converted, family):
    hf_dir, path = converted[family]
    from_gguf = load_model(path, dtype="float32")
    from_hf = load_hf_model(hf_dir, dtype="float32")
    assert from_gguf.config == _as_stored(from_hf.config)
    assert read_gguf_config(path) == from_gguf.config
    assert_same_params(from_gguf.params, from_hf.params)
    assert from_gguf.eos_token_ids == from_hf.eos_token_ids


def test_family_fields_survive_conversion(converted):
    """The fields that make each family what it is, spelled out (the equality above would
    also hold if both loaders dropped one)."""
    g2 = read_gguf_config(converted["gemma2"][1])
    assert g2.windows == (WINDOW, None, WINDOW, None)
    assert (g2.attn_soft_cap, g2.final_soft_cap, g2.sm_scale) == (2.0, 3.0, 16**-0.5)
    assert g2.gemma_norms and g2.post_norms and g2.embed_scale and g2.tie_word_embeddings
    g3 = read_gguf_config(converted["gemma3"][1])
    assert g3.windows == (WINDOW,) * 5 + (None,) + (WINDOW,) * 2
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.factor) == (1e6, 1e4, 2.0)
    assert g3.qk_norm and g3.attn_soft_cap is None and g3.final_soft_cap is None
    phi3 = read_gguf_config(converted["phi3"][1])
    assert (phi3.sliding_window, phi3.rotary_dim, phi3.rope_scaling) == (WINDOW, 8, None)
    assert not phi3.tie_word_embeddings and phi3.hidden_act == "silu"
    long = read_gguf_config(converted["phi3_longrope"][1]).rope_scaling
    assert long.original_max_position_embeddings == 16
    assert long.short_factor[:2] == (1.0, 1.125) and long.long_factor[-1] == 4.5
    assert long.attention_factor == _f32(math.sqrt(2))  # sqrt(1 + ln 16 / ln 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_equal(converted, family):
    hf_dir, path = converted[family]
    prompt = [np.random.default_rng(1).integers(3, 2000, 14).tolist()]  # past the window
    engine = {
        "max_num_seqs": 1,
        "page_size": 4,
        "num_pages": 12,
        "max_model_len": 32,
        "compilation_cache_dir": None,
    }
    ours = engine_greedy(path, prompt, 6, **engine)
    assert len(ours[0]) >= 1
    assert ours == engine_greedy(hf_dir, prompt, 6, **engine)


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_q8_0_projections_load_as_int8_without_loss(converted, tmp_path, family):
    """--quantization int8 keeps a Q8_0 file's blocks, Phi-3's fused attn_qkv / ffn_up split
    into wq/wk/wv and w_gate/w_up: each dequantizes to exactly the float load's value."""
    path = tmp_path / f"{family}.q8_0.gguf"
    write_gguf(converted[family][0], path, q8_0=True)
    floats = load_model(path, dtype="float32").params["layers"]
    kept = load_model(path, dtype="float32", quantization="int8").params["layers"]
    for i, layer in enumerate(kept):
        # (wo's contraction axis, head_dim 16, is shorter than a block: re-quantized instead)
        for name in ("wq", "wk", "wv", "w_gate", "w_up", "w_down"):
            assert quant.is_quantized(layer[name]) and layer[name].group == 32, (i, name)
            np.testing.assert_array_equal(
                np.asarray(quant.dequantize(layer[name])),
                np.asarray(floats[i][name]),
                err_msg=f"{i} {name}",
            )


def test_gemma3_pattern_as_layer_flags_and_local_rope_base(converted, tmp_path):
    """attention.sliding_window_pattern as one flag per layer (True: sliding) and
    rope.freq_base_swa, as newer converters write them."""
    path = tmp_path / "g3.gguf"
    flags = [True, False] * 4
    metadata = {"{arch}.attention.sliding_window_pattern": flags, "{arch}.rope.freq_base_swa": 5e4}
    write_gguf(converted["gemma3"][0], path, metadata=metadata)
    cfg = read_gguf_config(path)
    assert cfg.windows == (WINDOW, None) * 4
    assert cfg.rope_local_theta == 5e4


def test_gemma_27b_scales_queries_by_hidden_over_heads(tmp_path):
    """llama.cpp's rule for a file without query_pre_attn_scalar: Gemma 3 27B (62 layers)
    scales by hidden / heads (5376 / 32 = 168), every other size by head_dim."""
    for layers, scalar in ((62, 168.0), (34, 128.0)):
        path = tmp_path / f"gemma3_{layers}.gguf"
        writer = gguf.GGUFWriter(str(path), "gemma3")
        writer.add_context_length(128)
        writer.add_embedding_length(5376)
        writer.add_block_count(layers)
        writer.add_feed_forward_length(64)
        writer.add_head_count(32)
        writer.add_head_count_kv(16)
        writer.add_key_length(128)
        writer.add_value_length(128)
        writer.add_sliding_window(1024)
        writer.add_tensor("token_embd.weight", np.zeros((4, 5376), np.float32))
        finish_gguf(writer)
        assert read_gguf_config(path).query_pre_attn_scalar == scalar


def test_one_longrope_factor_tensor_is_an_error(converted, tmp_path):
    path = tmp_path / "half.gguf"
    write_gguf(converted["phi3_longrope"][0], path, skip=("rope_factors_long.weight",))
    with pytest.raises(
        ValueError,
        match=r"half\.gguf: LongRoPE needs both rope factor tensors; only "
        r"'rope_factors_short\.weight'",
    ):
        read_gguf_config(path)


def test_phi3_missing_fused_tensor(converted, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(converted["phi3"][0], path, skip=("blk.1.attn_qkv.weight",))
    with pytest.raises(ValueError, match=r"m\.gguf: missing tensor 'blk\.1\.attn_qkv\.weight'"):
        load_model(path)
