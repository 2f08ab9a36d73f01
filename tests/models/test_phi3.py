"""Phi-3 and windowed Mistral on the paged pool equal transformers (issue 28.1).

Phi-3: the fused qkv_proj and gate_up_proj split into our layout at load and joined again by
save_hf_model; a sliding window (as Phi-3-mini-4k has), partial rotary, and LongRoPE with an
original context of 16 tokens, so that prompts and generations cross from the short factors
to the long ones. Mistral: every layer windowed (window 8, prompts up to 37 tokens).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from dense_families import (
    engine_greedy,
    hf_greedy,
    hf_greedy_incremental,
    hf_logits,
    paged_logits,
    preempted_greedy,
    prompts_with_shared_prefix,
    save_tiny,
)
from safetensors.numpy import load_file

from models.config import LongRopeScaling, ModelConfig
from models.loader import load_hf_model, save_hf_model

VOCAB = 320
_SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}
_PHI3 = {**_SMALL, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LONG_ROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [1.0 + 0.5 * i for i in range(8)],
}
CONFIGS = {
    "phi3_window": lambda: transformers.Phi3Config(
        **_PHI3, original_max_position_embeddings=256, sliding_window=8
    ),
    "phi3_partial": lambda: transformers.Phi3Config(
        **_PHI3, original_max_position_embeddings=256, partial_rotary_factor=0.5
    ),
    "phi3_longrope": lambda: transformers.Phi3Config(
        **_PHI3, original_max_position_embeddings=16, rope_scaling=LONG_ROPE
    ),
    "mistral_window": lambda: transformers.MistralConfig(**_SMALL, sliding_window=8),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {name: save_tiny(root / name, make()) for name, make in CONFIGS.items()}


def test_longrope_config_as_transformers_computes_it(checkpoints):
    cfg = load_hf_model(checkpoints["phi3_longrope"]).config
    rs = cfg.rope_scaling
    assert isinstance(rs, LongRopeScaling)
    assert rs.original_max_position_embeddings == 16
    # factor 256 / 16: sqrt(1 + ln(16) / ln(16))
    assert rs.attention_factor == pytest.approx(2**0.5)
    assert rs.long_factor == tuple(LONG_ROPE["long_factor"])
    with pytest.raises(ValueError, match="short_factor has 3 entries, expected 8"):
        hf = json.loads((checkpoints["phi3_longrope"] / "config.json").read_text())
        hf["rope_parameters"]["short_factor"] = [1.0] * 3
        ModelConfig.from_hf_config(hf)


def test_fused_projections_round_trip(checkpoints, tmp_path):
    path = checkpoints["phi3_window"]
    loaded = load_hf_model(path)
    layer = loaded.params["layers"][0]
    assert layer["wq"].shape == (64, 4, 16) and layer["wk"].shape == (64, 2, 16)
    assert layer["w_gate"].shape == layer["w_up"].shape == (64, 128)
    config = json.loads((path / "config.json").read_text())
    out = save_hf_model(tmp_path / "resaved", config, loaded.params)
    original, resaved = (
        load_file(str(path / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert original.keys() == resaved.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(resaved[name], value, err_msg=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    path = checkpoints[name]
    loaded = load_hf_model(path)
    for n in (12, 37):  # LongRoPE: short factors, then long ones
        ids = np.random.default_rng(n).integers(0, VOCAB, n).tolist()
        ours = paged_logits(loaded, [n], ids, stacked=True)
        np.testing.assert_allclose(ours, hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["phi3_longrope", "mistral_window"])
def test_engine_greedy_equals_transformers(checkpoints, name):
    """LongRoPE: the 10- and 14-token prompts cross the original 16 tokens while decoding;
    their new tokens then use the long factors over the cached keys, as transformers' model
    does forward by forward (its generate recomputes the cache at that point instead, which
    the engine does not: hf_greedy_incremental). The others equal generate's."""
    path = checkpoints[name]
    # No shared prefix under LongRoPE: a page cached by a short sequence holds keys of the
    # short factors, which a long prompt must not reuse (the engine turns prefix caching off
    # for LongRoPE: test_a_longrope_engine_turns_prefix_caching_off).
    prefix = 0 if name == "phi3_longrope" else 8
    prompts = prompts_with_shared_prefix(VOCAB, [8, 10, 14, 20, 30], prefix=prefix, seed=1)
    ours = engine_greedy(
        path,
        prompts,
        8,
        max_num_seqs=2,
        page_size=4,
        num_pages=24,
        max_model_len=64,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    assert ours == hf_greedy_incremental(path, prompts, 8)
    generated = hf_greedy(path, prompts, 8)
    crossing = [1, 2] if name == "phi3_longrope" else []
    for i, (a, b) in enumerate(zip(ours, generated, strict=True)):
        if i not in crossing:
            assert a == b, i


@pytest.mark.parametrize(
    ("name", "mode"), [("phi3_window", "recompute"), ("mistral_window", "swap")]
)
def test_a_forced_preemption_changes_no_token(checkpoints, name, mode):
    """A pool too small for both running sequences: one is preempted (recomputed or swapped
    to host and back) and the tokens are still transformers'. Every layer is windowed, so
    pages before the window are freed (docs/memory.md, "Hybrid paging") and the shared pool
    of 14 pages would not preempt: 11 pages with a 32-token budget do (a chunk of the second
    prompt takes the last free pages while the first needs one)."""
    ours, theirs = preempted_greedy(
        checkpoints[name], VOCAB, mode, num_pages=12, max_num_batched_tokens=32
    )
    assert ours == theirs


def test_a_longrope_engine_turns_prefix_caching_off(checkpoints):
    """A LongRoPE key depends on its sequence's length, so a cached page is not reusable."""
    from jpaged import LLM

    for name, cached in (("phi3_longrope", False), ("mistral_window", True)):
        llm = LLM(str(checkpoints[name]), max_num_seqs=2, max_model_len=64, num_pages=24,
                  page_size=4, enable_prefix_caching=True)  # fmt: skip
        assert llm.llm_engine.config.cache.enable_prefix_caching is cached, name
        assert llm.llm_engine.allocator.enable_prefix_caching is cached, name
