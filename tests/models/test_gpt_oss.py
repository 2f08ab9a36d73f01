"""gpt-oss (GptOssForCausalLM): the config fields (window and full layers, YaRN), routing,
and our logits and greedy tokens equal to transformers' for a tiny random checkpoint: 4
layers alternating a 4-token window and full attention, learned sinks that matter (std 1),
q/k/v/o biases, 4 experts of which 2 per token with biases, a SwiGLU clamp at 0.5 that
binds, YaRN rope (factor 4 over 64 positions). Prefill, chunked prefill, decode, prefix hits
and a preemption through the engine; MXFP4 expert weights (written here by quantizing the
model's own experts) dequantized exactly when loaded, and int8 under --quantization int8."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_families import (
    engine_greedy_and_stats,
    hf_beams,
    hf_greedy,
    hf_logits,
    paged_logits,
    preempted_greedy,
    prompts_with_shared_prefix,
)
from moe_families import save_tiny_gpt_oss as save_tiny
from moe_families import tiny_gpt_oss_config as tiny_config

from models import moe, mxfp4
from models.config import ModelConfig, YarnRopeScaling
from models.loader import load_hf_model

VOCAB = 160
WINDOW = 4  # tiny_gpt_oss_config's sliding window
# Engines of the greedy, forks and quantized pages tests: 4 sequence slots (two beams, or
# forks), one 32-token step bucket (each further bucket costs seconds of compiling); one
# geometry, so that the float32 ones share their compiled programs.
ENGINE = {"page_size": 4, "max_num_seqs": 4, "max_model_len": 64, "num_pages": 40,
          "max_num_batched_tokens": 32, "min_token_bucket": 32, "compilation_cache_dir": None}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("gpt_oss") / "tiny")


def _hf_dict(**overrides) -> dict:
    base = {
        "architectures": ["GptOssForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 128,
    }  # fmt: skip
    return {**base, **overrides}


def test_config_fields_and_transformers_defaults():
    cfg = ModelConfig.from_hf_config(_hf_dict())
    assert cfg.windows == (128, None, 128, None)  # transformers: sliding at even layers
    assert cfg.attention_sinks and cfg.o_bias and cfg.attention_bias and cfg.expert_bias
    assert (cfg.moe_scoring, cfg.swiglu_limit, cfg.swiglu_alpha) == ("topk_softmax", 7.0, 1.702)
    assert cfg.rope_theta == 150000.0  # GptOssConfig's, with its default YaRN
    assert cfg.rope_scaling == YarnRopeScaling(
        factor=32.0, original_max_position_embeddings=4096, truncate=False,
        attention_factor=0.1 * math.log(32) + 1,
    )  # fmt: skip
    cfg = ModelConfig.from_hf_config(
        _hf_dict(layer_types=["full_attention"] * 3 + ["sliding_attention"], swiglu_limit=3.0)
    )
    assert cfg.windows == (None, None, None, 128) and cfg.swiglu_limit == 3.0
    with pytest.raises(ValueError, match="field 'layer_types' must list"):
        ModelConfig.from_hf_config(_hf_dict(layer_types=["chunked_attention"] * 4))
    with pytest.raises(ValueError, match="field 'swiglu_limit' must be a number > 0"):
        ModelConfig.from_hf_config(_hf_dict(swiglu_limit=-1))


@pytest.mark.needs_torch
def test_yarn_frequencies_equal_transformers():
    """Our YaRN inverse frequencies and attention factor against transformers' own."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.llama import rope_inv_freq

    for truncate in (False, True):
        hf = tiny_config().to_dict()
        hf["rope_parameters"] = {**hf["rope_parameters"], "truncate": truncate}
        config = transformers.GptOssConfig(**hf)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        cfg = ModelConfig.from_hf_config({**hf, "architectures": ["GptOssForCausalLM"]})
        assert cfg.rope_scaling.attention_factor == pytest.approx(factor, rel=1e-12)
        np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=1e-6)


def test_topk_softmax_routing_is_a_softmax_over_the_chosen_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (9, 8)).astype(np.float32)
    weights, ids = moe.route_topk_softmax(jnp.asarray(logits), 3)
    want_ids = np.argsort(-logits, axis=1, kind="stable")[:, :3]
    top = np.take_along_axis(logits, want_ids, axis=1).astype(np.float64)
    want = np.exp(top - top.max(1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want / want.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.needs_torch
def test_logits_equal_transformers(checkpoint):
    """One prefill, then chunked prefill and decode steps with the layers scanned in groups of
    (window, full): every position's logits within 1e-5."""
    loaded = load_hf_model(checkpoint)
    assert loaded.config.windows == (WINDOW, None, WINDOW, None)
    ids = np.random.default_rng(1).integers(0, VOCAB, 23).tolist()
    ref = hf_logits(checkpoint, ids)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(paged_logits(loaded, [len(ids)], ids), ref, atol=1e-5, rtol=0)
    steps = paged_logits(loaded, [9, 7] + [1] * 7, ids, stacked=True)
    np.testing.assert_allclose(steps, ref, atol=1e-5, rtol=0)


@pytest.mark.needs_torch
def test_the_sinks_window_and_clamp_each_change_transformers_logits(checkpoint):
    """transformers' logits without the sinks (-1e4: no share), the window or the clamp
    differ from the model's: the logits test above holds each of them."""
    import torch
    from dense_families import hf_model

    ids = torch.tensor([np.random.default_rng(1).integers(0, VOCAB, 23).tolist()])
    model = hf_model(checkpoint)
    with torch.no_grad():
        base = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (model(ids).logits - base).abs().max() > 1e-3
        model = hf_model(checkpoint)
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.config.layer_types = ["full_attention"] * 4
        assert (model(ids).logits - base).abs().max() > 1e-3
        model = hf_model(checkpoint)
        for layer in model.model.layers:
            layer.mlp.experts.limit = 100.0
        assert (model(ids).logits - base).abs().max() > 1e-3


@pytest.mark.needs_torch
def test_engine_greedy_tokens_equal_transformers(checkpoint):
    """Five prompts sharing a prefix (prefix hits), chunked prefill, 12 greedy tokens each,
    through the engine's hybrid paging (window layers release their old pages)."""
    prompts = prompts_with_shared_prefix(VOCAB, [19, 33, 11, 26, 12], prefix=10)
    # the forks test's engine geometry (ENGINE, below), so its programs serve both
    got, stats = engine_greedy_and_stats(checkpoint, prompts, 12, enable_prefix_caching=True,
                                         **ENGINE)  # fmt: skip
    assert got == hf_greedy(checkpoint, prompts, 12)
    assert stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.needs_torch
def test_a_forced_preemption_changes_no_token(checkpoint):
    """A pool too small for both running sequences (13 pages and a 32-token budget, as
    Gemma 3's test: the window layers' old pages are released): one is preempted and
    recomputed, and the tokens are still transformers'."""
    pool = {"num_pages": 13, "max_num_batched_tokens": 32}
    ours, theirs = preempted_greedy(checkpoint, VOCAB, "recompute", **pool)
    assert ours == theirs


def test_mxfp4_round_trip_and_layout():
    """quantize packs the low nibble first and picks each block's power-of-two scale;
    dequantize inverts it exactly on representable values."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (3, 5, 64)).astype(np.uint8)
    exps = rng.integers(120, 135, (3, 5, 2)).astype(np.uint8)
    w = np.ldexp(mxfp4.FP4_VALUES[codes], exps.astype(np.int32).repeat(32, -1) - 127)
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), w)
    assert mxfp4.dequantize(np.array([[[0x71] + [0] * 15]], np.uint8),
                            np.array([[128]], np.uint8))[0, :2].tolist() == [1.0, 12.0]  # fmt: skip
    with pytest.raises(ValueError, match="do not pair up"):
        mxfp4.dequantize(blocks, scales[..., :1])


def _write_mxfp4(src, dst) -> dict[str, np.ndarray]:
    """src's experts rounded to MXFP4 as gpt-oss ships them: dst holds _blocks/_scales
    ([E, out, in / 32, 16], [E, out, in / 32]) and a quantization_config; src is rewritten
    with the exact dequantized floats (transformers' reference). Returns those floats."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    packed, exact = dict(tensors), {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4.quantize(np.swapaxes(tensors[name], 1, 2))
        exact[name] = np.swapaxes(mxfp4.dequantize(blocks, scales), 1, 2).copy()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        tensors[name] = exact[name]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    dst.mkdir()
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (dst / "config.json").write_text(json.dumps(config))
    return exact


@pytest.mark.needs_torch
def test_mxfp4_experts_load_dequantized_and_give_transformers_logits(tmp_path):
    """The loader's experts equal the exact dequantization; our logits (so our tokens) equal
    transformers' on those floats; under int8 each expert weight is the int8 rounding of
    them (within half a step of its channel's scale)."""
    from models.quantization import QuantizedWeight, dequantize

    src = save_tiny(tmp_path / "float", seed=1)
    exact = _write_mxfp4(src, tmp_path / "mxfp4")
    loaded = load_hf_model(tmp_path / "mxfp4")
    layer = loaded.params["layers"][1]
    gate_up = exact["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(layer["w_gate_exps"]), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(layer["w_up_exps"]), gate_up[..., 1::2])
    down = exact["model.layers.1.mlp.experts.down_proj"]
    np.testing.assert_array_equal(np.asarray(layer["w_down_exps"]), down)
    ids = np.random.default_rng(1).integers(0, VOCAB, 23).tolist()
    ref = hf_logits(src, ids)
    got = paged_logits(loaded, [9, 7] + [1] * 7, ids, stacked=True)  # the logits test's program
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()

    int8 = load_hf_model(tmp_path / "mxfp4", quantization="int8").params["layers"][1]
    for name, want in (("w_gate_exps", gate_up[..., 0::2]), ("w_down_exps", down)):
        w = int8[name]
        assert isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8
        error = np.abs(np.asarray(dequantize(w)) - want)
        assert (error <= np.asarray(w.scale, np.float32) / 2 + 1e-7).all(), name


def _write_gguf(hf_dir, out, *, mxfp4: bool) -> dict[str, np.ndarray]:
    """The checkpoint as llama.cpp's converter (GptOssModel) writes it: gate_up_proj split
    into ffn_gate_exps and ffn_up_exps [E, out, in] (MXFP4 blocks when mxfp4, as it repacks
    the checkpoint's), their biases split alike, attn_sinks, YaRN's factor and original
    length. Returns the experts as the file's own dequantization gives them."""
    import gguf
    from gguf import quants
    from safetensors.numpy import load_file

    from models.gguf import gguf_tensor_name

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tensors, experts = {}, {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        prefix, _, last = name.rpartition(".")
        if last in ("gate_up_proj", "gate_up_proj_bias"):
            bias = last.endswith("bias")
            for part, half in (("gate_proj", w[..., 0::2]), ("up_proj", w[..., 1::2])):
                tensors[f"{prefix}.{part}{'_bias' if bias else ''}"] = (
                    half if bias else np.swapaxes(half, 1, 2)
                )
        else:  # down_proj [E, F, D] -> [E, D, F]; the rest as they are
            tensors[name] = np.swapaxes(w, 1, 2) if last == "down_proj" else w
    for name, w in tensors.items():
        gguf_name = gguf_tensor_name(name, "gpt-oss")
        w = np.ascontiguousarray(w, np.float32)
        if mxfp4 and name.endswith(("gate_proj", "up_proj", "down_proj")):
            packed = quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
            experts[gguf_name] = quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(gguf_name, packed, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return experts


@pytest.mark.needs_torch
def test_gguf_equals_hf_directory_and_mxfp4_experts_dequantize_as_gguf_does(checkpoint, tmp_path):
    """llama.cpp's gpt-oss GGUF: config and params equal the HF directory's (float experts;
    the SwiGLU limit is llama.cpp's fixed 7); with MXFP4 experts, each expert weight equals
    gguf's own dequantization of the file's blocks."""
    import dataclasses

    from models.loader import load_model

    _write_gguf(checkpoint, tmp_path / "f32.gguf", mxfp4=False)
    from_gguf, from_hf = load_model(tmp_path / "f32.gguf"), load_hf_model(checkpoint)
    want = dataclasses.replace(from_hf.config, swiglu_limit=7.0, eos_token_ids=(),
                               bos_token_id=None)  # fmt: skip
    got = from_gguf.config
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # float32 in the file
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want
    flat_gguf = jax.tree_util.tree_leaves_with_path(from_gguf.params)
    flat_hf = jax.tree_util.tree_leaves_with_path(from_hf.params)
    assert [p for p, _ in flat_gguf] == [p for p, _ in flat_hf]
    for (p, a), (_, b) in zip(flat_gguf, flat_hf, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))

    experts = _write_gguf(checkpoint, tmp_path / "mxfp4.gguf", mxfp4=True)
    layer = load_model(tmp_path / "mxfp4.gguf").params["layers"][2]
    for name, key in (("gate", "w_gate_exps"), ("up", "w_up_exps"), ("down", "w_down_exps")):
        want = np.swapaxes(experts[f"blk.2.ffn_{name}_exps.weight"], 1, 2)
        np.testing.assert_array_equal(np.asarray(layer[key]), want)
    rounded = np.asarray(layer["w_up_exps"]) - np.asarray(from_hf.params["layers"][2]["w_up_exps"])
    assert np.abs(rounded).max() > 0  # MXFP4's rounding: the blocks were read, not the floats


@pytest.mark.needs_torch
def test_forks_and_beam_search_equal_transformers(checkpoint):
    """On the window and full groups (the window group's old pages freed, each fork holding
    its own reference to the shared ones), one engine: n = 3 greedy forks (copy-on-write of
    the prompt's partial page) each give transformers' greedy tokens of the prompt alone,
    n = 2 seeded sampling forks diverge and run to their length, and a beam search of width
    2 (beams that diverge, fork and drop, so a page written through a shared reference would
    show) gives transformers' beams, sums of logprobs within 1e-4; the pool is whole after."""
    from jpaged import LLM, BeamSearchParams, SamplingParams

    prompt = np.random.default_rng(4).integers(0, VOCAB, 11).tolist()  # a partial 3rd page
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(checkpoint), **ENGINE)
    forks, greedy_forks = [[c.token_ids for c in o.outputs] for o in
                           llm.generate([prompt, prompt], [sampled, greedy])]  # fmt: skip
    assert forks[0] != forks[1] and len(forks[0]) == len(forks[1]) == 24
    assert greedy_forks == hf_greedy(checkpoint, [prompt], 24) * 3
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=24))
    assert llm.stats()["pages_used"] == 0
    want = hf_beams(checkpoint, prompt, 2, 24)
    assert [s.token_ids for s in out.sequences] == [w[0] for w in want]
    assert want[0][0] != want[1][0]
    for seq, (_, cum) in zip(out.sequences, want, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


def _quantized_greedy(loaded, prompt: list[int], max_tokens: int, dtype) -> list[int]:
    """The greedy tokens of forward() itself over a pool of dtype pages (kv_quant's rows and
    scales; the layers scanned, every layer on one shuffled page table of max_model_len 64,
    its window masked in attention): the prompt in one chunk, then one token per step, each
    the argmax of its logits; every step padded to 32 tokens (one program)."""
    from dense_families import _forward, padded_chunk

    from models.llama import compute_logits, stack_layers
    from pallas_kernels import kv_quant

    cfg, page, n = loaded.config, 4, 16
    params = stack_layers(loaded.params)
    shape = (cfg.num_kv_heads, cfg.num_layers * (n + 1), page, cfg.head_dim)
    caches = (kv_quant.zeros(shape, dtype), kv_quant.zeros(shape, dtype))
    table = np.random.default_rng(0).permutation(np.arange(1, n + 1)).astype(np.int32)
    ids, start, out = list(prompt), 0, []
    while len(out) < max_tokens:
        pos = np.arange(start, len(ids))
        tokens, positions, slots = padded_chunk(
            ids[start:], pos, table[pos // page] * page + pos % page, 32
        )
        hidden, caches = _forward(
            params, cfg, caches, tokens, positions, slots, jnp.asarray([len(ids)], jnp.int32),
            jnp.asarray(table[None]), jnp.asarray([0, len(pos)], jnp.int32),
        )  # fmt: skip
        last = hidden[len(pos) - 1 : len(pos)]
        out.append(int(np.asarray(compute_logits(params, cfg, last)).argmax()))
        start = len(ids)
        ids.append(out[-1])
    return out


@pytest.mark.needs_torch
@pytest.mark.parametrize(("kv_cache_dtype", "stored"), [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_quantized_kv_pages_give_forwards_own_greedy_tokens(checkpoint, kv_cache_dtype, stored):
    """--kv-cache-dtype int8 / fp8 on gpt-oss (sinks, window and full groups, the window
    group's old pages freed; one sequence at a time, so the second prompt hits the first's
    cached pages of their 10 shared tokens, the window group's freed at the first's first
    decode step while its prefill was in flight): the engine's greedy tokens equal
    forward()'s own argmax path over a pool of the same dtype."""
    prompts = prompts_with_shared_prefix(VOCAB, [19, 26], prefix=10, seed=5)
    got, stats = engine_greedy_and_stats(
        checkpoint, prompts, 16, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=True,
        **{**ENGINE, "max_num_seqs": 1},
    )  # fmt: skip
    assert stats["kv_cache_dtype"] == stored and stats["prefix_cache_hit_tokens"] >= 8
    loaded = load_hf_model(checkpoint)
    dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_cache_dtype]
    assert got == [_quantized_greedy(loaded, p, 16, dtype) for p in prompts]


@pytest.mark.needs_torch
def test_int8_weights_and_an_orbax_conversion(checkpoint, tmp_path):
    """--quantization int8, stacked on the host: the projections and experts int8 with
    per-channel scales, the sinks, biases and router float; the logits of every position
    (a chunk of 9, then one of 7 reading it back) equal those of its weights dequantized
    (whose program is the logits test's: same shapes).
    An Orbax conversion restores the HF directory's params, stacked or not (the sinks and
    every bias included)."""
    import dataclasses

    from models.llama import stack_layers
    from models.loader import load_model
    from models.orbax_checkpoint import convert_hf_to_orbax
    from models.quantization import QuantizedWeight, dequantize

    is_quantized = lambda a: isinstance(a, QuantizedWeight)
    loaded = load_hf_model(checkpoint, quantization="int8", stacked=True)
    layers = loaded.params["layers"]
    assert {k for k, v in layers.items() if is_quantized(v)} == {
        "wq", "wk", "wv", "wo", "w_gate_exps", "w_up_exps", "w_down_exps",
    }  # fmt: skip
    down = layers["w_down_exps"]
    assert down.q.dtype == jnp.int8 and down.q.shape == (4, 4, 32, 64)  # [L, E, F, D]
    plain = jax.tree.map(dequantize, loaded.params, is_leaf=is_quantized)
    # 23 ids as the logits test's (its pool and table shapes), the first 16 run
    ids = np.random.default_rng(2).integers(0, VOCAB, 23).tolist()
    want = paged_logits(dataclasses.replace(loaded, params=plain), [9, 7], ids)
    np.testing.assert_allclose(paged_logits(loaded, [9, 7], ids), want, atol=1e-5, rtol=0)

    convert_hf_to_orbax(checkpoint, tmp_path / "orbax")
    from_hf = load_hf_model(checkpoint)
    assert {"sinks", "bq", "bk", "bv", "bo", "b_router", "b_gate_exps", "b_up_exps",
            "b_down_exps"} <= set(from_hf.params["layers"][0])  # fmt: skip
    for stacked in (False, True):
        restored = load_model(tmp_path / "orbax", stacked=stacked)
        assert restored.config == from_hf.config
        want = stack_layers(from_hf.params) if stacked else from_hf.params
        assert jax.tree.structure(restored.params) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
