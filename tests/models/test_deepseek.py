"""DeepSeek-V2/V3 (multi-head latent attention on the paged pool, DeepSeek's experts): the
config fields and the pool geometry they give (one latent row per token and layer, exact
bytes), transformers' logits and greedy tokens on tiny random checkpoints (a query LoRA with
YaRN and its mscale, a direct query projection, V2's group-limited softmax routing; a dense
first layer, then experts), whole and chunked prefill, decode, prefix hits, preemption by
recompute and by swap, and int8 pages holding the latent."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import finish_gguf, stack_expert
from dense_families import engine_greedy_and_stats, hf_logits, paged_logits, preempted_greedy
from moe_families import DEEPSEEK_FAMILIES, hf_greedy, prompts, save_tiny

from jpaged.core.memory_plan import kv_page_bytes
from models.config import ModelConfig
from models.llama import init_params, stack_layers, unstack_layers
from models.loader import load_hf_model
from pallas_kernels import kv_quant

MAX_TOKENS = 12
# One engine geometry for every float32 engine below (the GGUF's, the preemptions'), so they
# share one set of compiled programs: 14 pages of 4 tokens hold one 48-token sequence, not
# two long ones (the preemption prompts need 10 + 11 pages at once, so one is preempted).
ENGINE = {
    "max_num_seqs": 2, "max_model_len": 48, "max_num_batched_tokens": 16, "page_size": 4,
    "num_pages": 14, "compilation_cache_dir": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek")
    return {f: save_tiny(root / f, f) for f in DEEPSEEK_FAMILIES}


@pytest.fixture(scope="module")
def v3_greedy(checkpoints) -> list[list[int]]:
    """transformers' MAX_TOKENS greedy tokens of deepseek_v3 for each of prompts(160)."""
    return hf_greedy(checkpoints["deepseek_v3"], prompts(160), MAX_TOKENS)


def _hf_config(**overrides) -> dict:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 2,
        "kv_lora_rank": 12, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6,
        "v_head_dim": 5, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 4, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    }  # fmt: skip
    return {**config, **overrides}


def test_config_fields_and_the_latent_pool_geometry():
    cfg = ModelConfig.from_hf_config(_hf_config())
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim) == (12, 8, 4)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (1, 8, 4)  # a row of 16 in halves
    assert cfg.rope_interleave and cfg.sm_scale == pytest.approx(10**-0.5)
    assert (cfg.num_dense_layers, cfg.routed_scaling_factor, cfg.moe_scoring) == (1, 2.5, "sigmoid")
    assert cfg.router_bias and cfg.norm_topk_prob and cfg.num_shared_experts == 1
    # A page's bytes: (kv_lora_rank + rope) values per token and layer, no V copy.
    assert kv_page_bytes(cfg, 16, 2) == 3 * 16 * (12 + 4) * 2
    int8 = kv_quant.storage_dtype("int8", np.float32)
    assert kv_page_bytes(cfg, 16, 1, int8) == 3 * 16 * (12 + 4 + 2 * 2)  # 2 halves' scales
    v2 = ModelConfig.from_hf_config(_hf_config(architectures=["DeepseekV2ForCausalLM"],
                                               q_lora_rank=None, topk_method="greedy"))  # fmt: skip
    assert (v2.q_lora_rank, v2.moe_scoring, v2.norm_topk_prob, v2.num_expert_groups) == (
        0, "softmax", False, 1)  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    cfg = ModelConfig.from_hf_config(_hf_config(rope_scaling=yarn))
    assert cfg.rope_scaling.attention_factor == 1.0
    assert cfg.sm_scale == pytest.approx(10**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_rope_head_dim \(15\) .* must be even"):
        ModelConfig.from_hf_config(_hf_config(kv_lora_rank=11))
    with pytest.raises(ValueError, match="topk_method 'greedy' is not supported"):
        ModelConfig.from_hf_config(_hf_config(topk_method="greedy"))
    with pytest.raises(ValueError, match="attention_bias is not supported"):
        ModelConfig.from_hf_config(_hf_config(attention_bias=True))


# DeepSeek-V3's real attention and expert dims (config.json).
DEEPSEEK_V3_ATTENTION = {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
}  # fmt: skip


def test_deepseek_v3_kv_bytes_per_token_against_full_heads():
    """DeepSeek-V3's real attention dims (docs/memory.md): 61 layers, latent 512 + rope 64
    against 128 heads of K (128 + 64) and V (128), bfloat16: 70,272 bytes a token, 71x less."""
    cfg = ModelConfig.from_hf_config(_hf_config(**DEEPSEEK_V3_ATTENTION))
    mla = kv_page_bytes(cfg, 1, 2)
    full_heads = 61 * 128 * ((128 + 64) + 128) * 2
    assert (mla, full_heads) == (70_272, 4_997_120)


def test_kimi_k2_config_is_deepseek_v3s_with_one_group():
    """Kimi K2 (DeepseekV3ForCausalLM: 64 heads, 384 experts in one group, one dense layer,
    YaRN factor 32 over 4,096): its fields, and the same latent row as DeepSeek-V3's, so
    the same 70,272 bytes per token in bfloat16 whatever its heads."""
    yarn = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}
    cfg = ModelConfig.from_hf_config(_hf_config(**{
        **DEEPSEEK_V3_ATTENTION, "num_attention_heads": 64, "n_routed_experts": 384,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827, "rope_scaling": yarn, "vocab_size": 163840,
    }))  # fmt: skip
    assert (cfg.num_heads, cfg.num_experts, cfg.num_expert_groups, cfg.topk_groups) == (
        64, 384, 1, 1)  # fmt: skip
    assert (cfg.num_dense_layers, cfg.routed_scaling_factor, cfg.moe_scoring) == (
        1, 2.827, "sigmoid")  # fmt: skip
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling.factor == 32.0
    assert cfg.sm_scale == pytest.approx(192**-0.5 * (0.1 * np.log(32) + 1) ** 2)
    assert kv_page_bytes(cfg, 1, 2) == 61 * (512 + 64) * 2 == 70_272


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_at_equal_memory_the_latent_pool_holds_its_bytes_ratio_more_sequences(kv_cache_dtype):
    """The engine's memory plan for DeepSeek-V3's real attention dims (bfloat16 activations)
    against the same model with full K/V (128 KV heads of 160 values: K's 192 and V's 128 per
    head, the same bytes), in the same 320 GiB pool budget: each holds sequences of 1,024
    tokens as its bytes per token say, within one page per sequence, so the latent pool holds
    the ratio of their bytes per token (71x in bfloat16) more, within that too."""
    import dataclasses

    from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
    from jpaged.core.memory_plan import plan_memory

    mla = ModelConfig.from_hf_config(_hf_config(**DEEPSEEK_V3_ATTENTION))
    full = dataclasses.replace(mla, kv_lora_rank=0, num_kv_heads=128, head_dim=160)
    budget, length, page = 320 << 30, 1024, 16
    engine = EngineConfig(
        cache=CacheConfig(page_size=page, kv_cache_memory_bytes=budget,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_model_len=length, max_num_seqs=8192),
    )  # fmt: skip
    held, per_token = {}, {}
    for name, cfg in (("mla", mla), ("full", full)):
        plan = plan_memory(engine, cfg, jnp.bfloat16, "cpu")
        per_token[name] = kv_page_bytes(cfg, page, 2, plan.kv_dtype) / page
        held[name] = (plan.num_pages - 1) // (length // page)  # the null page is no one's
        # as its bytes per token say, within one page per sequence
        assert budget // ((length + page) * per_token[name]) <= held[name]
        assert held[name] <= budget // (length * per_token[name])
    ratio = per_token["full"] / per_token["mla"]
    assert ratio > (71 if kv_cache_dtype == "auto" else 71.4)  # docs/memory.md's 71.1x, 71.5x
    assert held["full"] >= 60
    assert ratio * held["full"] * length / (length + page) <= held["mla"]
    assert held["mla"] <= ratio * (held["full"] + 1) * (length + page) / length


def test_params_stack_with_the_latent_attention():
    cfg = ModelConfig.from_hf_config(_hf_config())
    params = init_params(cfg)
    layers = stack_layers(params)["layers"]
    assert layers["wq_b"].shape == (3, 8, 2, 10) and layers["wkv_a"].shape == (3, 16, 16)
    assert layers["wkv_b"].shape == (3, 12, 2, 11) and layers["wo"].shape == (3, 2, 5, 16)
    assert "wk" not in layers and layers["router"].shape == (2, 16, 8)
    for i, layer in enumerate(unstack_layers({"layers": layers})["layers"]):
        assert layer.keys() == params["layers"][i].keys()


@pytest.mark.needs_torch
@pytest.mark.parametrize("family", DEEPSEEK_FAMILIES)
def test_logits_equal_transformers(checkpoints, family):
    loaded = load_hf_model(checkpoints[family])
    cfg = loaded.config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.num_dense_layers) == (1, 16, 1)
    ids = prompts(cfg.vocab_size)[1]
    ref = hf_logits(checkpoints[family], ids)
    # V3: one whole prefill (layers unrolled), then chunked prefill and decode steps (the
    # expert layers scanned); V2 (a direct query, softmax routing over the best groups): the
    # steps only, whose first chunk is a prefill; V3 without a query LoRA: one whole prefill,
    # scanned (it differs from V3 in its query projection only)
    if family != "deepseek_v2":
        whole = paged_logits(loaded, [len(ids)], ids, stacked=family != "deepseek_v3")
        np.testing.assert_allclose(whole, ref, atol=1e-5, rtol=0)
    if family == "deepseek_v3_no_q_lora":
        return
    steps = paged_logits(loaded, [13, 12] + [1] * (len(ids) - 25), ids, stacked=True)
    np.testing.assert_allclose(steps, ref, atol=1e-5, rtol=0)


@pytest.mark.needs_torch
def test_engine_greedy_tokens_of_a_gguf_equal_transformers(checkpoints, v3_greedy, tmp_path):
    """The deepseek2 GGUF of deepseek_v3 (kv_b split as llama.cpp writes it today; its params
    exactly the HF directory's, test_gguf_equals_hf_directory) through the engine: five
    prompts sharing a prefix (prefix hits), chunked prefill, 12 greedy tokens each, two
    sequences in a pool that holds one long one (preemptions); the pool's bytes per token are
    the latent row's."""
    path = tmp_path / "deepseek_v3.gguf"
    _write_gguf(checkpoints["deepseek_v3"], path, split_kv_b=True)
    got, stats = engine_greedy_and_stats(path, prompts(160), MAX_TOKENS,
                                         enable_prefix_caching=True, **ENGINE)  # fmt: skip
    assert got == v3_greedy
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_bytes_per_token"] == 3 * (24 + 8) * 4  # float32 latent rows, 3 layers


@pytest.mark.needs_torch
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_give_transformers_tokens(checkpoints, mode):
    """deepseek_v3's HF directory on the GGUF test's engine geometry (its programs)."""
    extra = {"num_swap_pages": 64} if mode == "swap" else {}
    ours, want = preempted_greedy(checkpoints["deepseek_v3"], 160, mode, **ENGINE, **extra)
    assert ours == want


@pytest.mark.needs_torch
@pytest.mark.parametrize(("kv_cache_dtype", "stored"), [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_quantized_pages_hold_the_latent(checkpoints, v3_greedy, kv_cache_dtype, stored):
    """An int8 or fp8 (e4m3) pool: a token's row is 32 one-byte values and two bfloat16
    scales per layer (108 bytes against float32's 384), and its greedy tokens are
    transformers' (prefix hits and chunked prefill included)."""
    path = checkpoints["deepseek_v3"]
    got, stats = engine_greedy_and_stats(path, prompts(160)[:3], MAX_TOKENS,
                                         kv_cache_dtype=kv_cache_dtype,
                                         enable_prefix_caching=True, **ENGINE)  # fmt: skip
    assert stats["kv_cache_dtype"] == stored
    assert stats["kv_bytes_per_token"] == 3 * 2 * (16 + 2)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert got == v3_greedy[:3]


@pytest.mark.needs_torch
def test_forks_and_beam_search_equal_transformers(checkpoints):
    """On the engine geometry above (its programs): n = 2 greedy forks (copy-on-write of the
    prompt's partial page in the latent pool) each give transformers' greedy tokens of the
    prompt alone, and a beam search of width 2 (beams that diverge, fork and drop) gives
    transformers' beams, sums of logprobs within 1e-4; the pool is whole after."""
    from dense_families import check_forks_and_beams

    from jpaged import LLM

    prompt = np.random.default_rng(4).integers(0, 160, 11).tolist()  # a partial 3rd page
    llm = LLM(str(checkpoints["deepseek_v3"]), **ENGINE)
    check_forks_and_beams(llm, checkpoints["deepseek_v3"], prompt, MAX_TOKENS)


@pytest.mark.needs_torch
def test_int8_weights_give_the_logits_of_their_dequantized_weights(checkpoints):
    """--quantization int8, stacked on the host: the output projection, the dense, shared
    and routed experts' projections int8 with per-channel scales (the latent projections,
    norms and router float); the logits of every position (a chunk of 13, then one of 12
    reading it back) equal those of its weights dequantized (the logits test's program)."""
    import dataclasses

    import jax

    from models.quantization import QuantizedWeight, dequantize

    is_quantized = lambda a: isinstance(a, QuantizedWeight)
    loaded = load_hf_model(checkpoints["deepseek_v3"], quantization="int8", stacked=True)
    quantized = {k for k, v in loaded.params["layers"].items() if is_quantized(v)}
    assert {"wo", "w_gate", "w_gate_exps", "w_down_exps", "w_up_shared"} <= quantized
    assert not quantized & {"wkv_a", "kv_a_norm", "router", "router_bias"}
    plain = jax.tree.map(dequantize, loaded.params, is_leaf=is_quantized)
    ids = prompts(loaded.config.vocab_size)[1]
    want = paged_logits(dataclasses.replace(loaded, params=plain), [13, 12], ids)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(paged_logits(loaded, [13, 12], ids), want, atol=1e-5, rtol=0)


@pytest.mark.needs_torch
def test_a_decode_step_on_the_interpreted_gpu_kernel_equals_the_reference(checkpoints):
    """The model's decode step with the latent GPU kernel (Pallas interpreter) in every layer
    gives the reference's hidden states, from a pool holding 11 tokens' rows (random: no
    prefill program to compile)."""
    import jax
    import jax.numpy as jnp

    from models.llama import forward

    loaded = load_hf_model(checkpoints["deepseek_v3"])
    cfg, page = loaded.config, 4
    params = stack_layers(loaded.params)  # the expert layers scanned: one kernel for both
    ids = prompts(cfg.vocab_size)[0][:12]
    shape = (1, cfg.num_layers * 5, page, cfg.head_dim)
    # 11 tokens' latent rows (normed latents and rotated keys are of order 1) in every layer
    rng = np.random.default_rng(0)
    pool = tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    table = jnp.asarray([[3, 1, 4, 2]], jnp.int32)
    slots = np.asarray([3, 1, 4])[np.arange(12) // page] * page + np.arange(12) % page
    run = jax.jit(forward, static_argnums=(1,),
                  static_argnames=("decode_only", "attention_backend"))  # fmt: skip
    out = {}
    for backend in ("reference", "pallas_interpret"):
        out[backend], _ = run(
            params, cfg, pool, jnp.asarray(ids[11:]), jnp.asarray([11]),
            jnp.asarray(slots[11:], jnp.int32), jnp.asarray([12]), table,
            jnp.asarray([0, 1], jnp.int32), decode_only=True, attention_backend=backend,
        )
    np.testing.assert_allclose(out["pallas_interpret"], out["reference"], atol=2e-5, rtol=0)


def _write_gguf(hf_dir, out, *, split_kv_b: bool, gating: int | None = None) -> None:
    """The checkpoint as llama.cpp's converter (DeepseekV2Model) writes a deepseek2 file:
    experts stacked per layer, rotary dims as stored (GGML's "norm" rope takes the pairs),
    YaRN's log multiplier 0.1 x mscale_all_dim, V3's MTP block counted in block_count (as
    GLM-4.5's files do; one of its tensors written); split_kv_b: as it writes them today
    (kv_b_proj split into attn_k_b [H, r, dn], transposed, and attn_v_b [H, dv, r]; one
    latent "KV head" of key length r + dr, the head dims in *_length_mla), else as before
    that split (attn_kv_b whole, the head dims in key_length / value_length)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    n, heads, r = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    v3 = cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    writer = gguf.GGUFWriter(str(out), "deepseek2")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(n + 1 if v3 else n)  # V3: its multi-token-prediction block after
    if v3:
        writer.add_nextn_predict_layers(1)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(r)
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(r + dr)
        writer.add_value_length(r)
        writer.add_key_length_mla(dn + dr)
        writer.add_value_length_mla(dv)
    else:
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_key_length(dn + dr)
        writer.add_value_length(dv)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    writer.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
    if gating is None:
        gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_uint32("deepseek2.expert_gating_func", int(gating))
    if v3 or cfg.get("topk_method") == "group_limited_greedy":
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    writer.add_rope_dimension_count(dr)
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n)
    out_tensors = {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if ".experts." in name and ".shared_experts." not in name:  # [E, out, in] stacks
            stack_expert(out_tensors, names, name, w, cfg["n_routed_experts"])
            continue
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            kv_b = w.reshape(heads, dn + dv, r)
            out_tensors[names.get_name(name.replace("kv_b", "k_b"), try_suffixes=(".weight",))] = (
                np.swapaxes(kv_b[:, :dn], 1, 2)
            )
            out_tensors[names.get_name(name.replace("kv_b", "v_b"), try_suffixes=(".weight",))] = (
                kv_b[:, dn:]
            )
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        out_tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    if v3:  # one of the MTP block's tensors (left unread)
        out_tensors[f"blk.{n}.nextn.eh_proj.weight"] = np.zeros((cfg["hidden_size"], 128))
    for name, w in out_tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    finish_gguf(writer)


@pytest.mark.needs_torch
@pytest.mark.parametrize(("family", "split_kv_b"), [("deepseek_v3", True), ("deepseek_v2", False)])
def test_gguf_equals_hf_directory(checkpoints, tmp_path, family, split_kv_b):
    """llama.cpp's deepseek2 file (V3: a query LoRA, YaRN, sigmoid routing, kv_b split as the
    converter writes it today, a multi-token-prediction block after the decoder's, left
    unread; V2: a direct query, softmax routing limited to groups, kv_b
    whole as older files hold it) loads the HF directory's config and exactly its params."""
    import dataclasses

    import jax

    from models.loader import load_model

    path = tmp_path / f"{family}.gguf"
    _write_gguf(checkpoints[family], path, split_kv_b=split_kv_b)
    from_gguf, from_hf = load_model(path), load_hf_model(checkpoints[family])
    fields = dataclasses.asdict(from_hf.config)
    fields.update(eos_token_ids=(), bos_token_id=None)  # the tokenizer's, none written here
    got = dataclasses.asdict(from_gguf.config)
    assert got.pop("rms_norm_eps") == pytest.approx(fields.pop("rms_norm_eps"))  # float32
    assert {k: v for k, v in got.items() if k in fields} == fields
    flat_gguf = jax.tree_util.tree_leaves_with_path(from_gguf.params)
    flat_hf = jax.tree_util.tree_leaves_with_path(from_hf.params)
    assert [p for p, _ in flat_gguf] == [p for p, _ in flat_hf]
    for (p, a), (_, b) in zip(flat_gguf, flat_hf, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
    _write_gguf(checkpoints[family], tmp_path / "bad.gguf", split_kv_b=split_kv_b, gating=3)
    with pytest.raises(ValueError, match=r"bad.gguf: deepseek2.expert_gating_func 3 is not "):
        load_model(tmp_path / "bad.gguf")


@pytest.mark.needs_torch
def test_a_prefill_step_on_the_interpreted_gpu_kernel_equals_the_reference(checkpoints):
    """The model's ragged prefill step with the latent prefill kernel (Pallas interpreter) in
    every layer gives the reference's hidden states and pool rows: a chunk of 5 tokens starting
    mid-page after 7 cached tokens (a prefix hit), beside a whole 3-token prompt."""
    import jax
    import jax.numpy as jnp

    from models.llama import forward

    loaded = load_hf_model(checkpoints["deepseek_v3"])
    cfg, page = loaded.config, 4
    params = stack_layers(loaded.params)
    ids = prompts(cfg.vocab_size)[0]
    shape = (1, cfg.num_layers * 6, page, cfg.head_dim)
    rng = np.random.default_rng(1)  # the 7 cached tokens' rows (and garbage elsewhere)
    pool = tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    table = jnp.asarray([[3, 1, 4], [5, 0, 0]], jnp.int32)
    pos = np.concatenate([np.arange(7, 12), np.arange(3)])
    pages = np.concatenate([np.asarray([3, 1, 4])[pos[:5] // page], [5, 5, 5]])
    step = (jnp.asarray(np.concatenate([ids[7:12], ids[:3]])), jnp.asarray(pos, jnp.int32),
            jnp.asarray(pages * page + pos % page, jnp.int32), jnp.asarray([12, 3], jnp.int32),
            table, jnp.asarray([0, 5, 8], jnp.int32))
    run = jax.jit(forward, static_argnums=(1,), static_argnames=("attention_backend",))
    out = {}
    for backend in ("reference", "pallas_interpret"):
        out[backend] = run(params, cfg, pool, *step, attention_backend=backend)
    hidden, got_pool = out["pallas_interpret"]
    assert np.abs(np.asarray(out["reference"][0])).max() > 0.1
    np.testing.assert_allclose(hidden, out["reference"][0], atol=2e-5, rtol=0)
    for got, want in zip(got_pool, out["reference"][1], strict=True):  # later layers' rows
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)  # follow the hidden states
    text = str(jax.make_jaxpr(lambda p, kv: forward(p, cfg, kv, *step,
                                                    attention_backend="pallas_interpret"))(
        params, pool))  # fmt: skip
    assert "jpaged_gpu_mla_prefill" in text
