"""SmolLM2-135M-Instruct's Q4_1 GGUF loaded with int8 weights (issue 29) against the same
file dequantized to float32: exact resident bytes and the perplexity of a fixed English text
(tests/perplexity.py). The issue's greedy check (the twelve real prompts agreeing on 16 tokens
for 10 of 12) is not met by this re-quantization: 6 of 12 agree (measured), so it is not
asserted here; see docs/memory.md, "Quantized weights".

With --quantization int8 the Q4_1 (and Q8_0) blocks of the file are re-quantized to int8 per
32-element block (float32 scales for Q4_1, the file's float16 ones for Q8_0): a Q4_1 block's
16 levels land on the int8 grid within half an int8 step, so the weights move by at most
max|w| / 254 per block.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.perplexity import english_token_ids, perplexity

_PROJECTIONS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
PERPLEXITY_TOKENS = 2048


@pytest.fixture(scope="module")
def engines(smollm2_gguf):
    """float32 and int8-weight engines on the same file, one shape bucket set each."""
    from jpaged import LLM

    return {
        method: LLM(
            model=str(smollm2_gguf),
            quantization=method,
            max_num_seqs=4,
            max_model_len=PERPLEXITY_TOKENS + 64,
            max_num_batched_tokens=512,
            min_token_bucket=512,
        )
        for method in (None, "int8")
    }


def test_int8_weights_are_resident_as_int8(engines, smollm2_gguf):
    """Exact resident bytes: each projection (all Q4_1 in the file) 1 byte per weight plus a
    float32 scale per 32; the embedding (the file's one Q8_0 tensor) and norms float32."""
    from gguf import GGUFReader

    f32, q8 = engines[None].stats(), engines["int8"].stats()
    assert (f32["quantization"], q8["quantization"]) == (None, "int8")
    expected = 0
    kinds = set()
    for t in GGUFReader(smollm2_gguf).tensors:
        n = int(np.prod(t.shape))
        kind = t.tensor_type.name
        if t.name.startswith("blk.") and t.name.split(".")[2] in _PROJECTIONS:
            kinds.add(kind)
            expected += n + n // 32 * 4
        else:
            expected += 4 * n  # token_embd (the tied LM head) and norms, float32
    assert kinds == {"Q4_1"}
    assert q8["weight_bytes"] == expected
    assert f32["weight_bytes"] == 4 * sum(
        int(np.prod(t.shape)) for t in GGUFReader(smollm2_gguf).tensors
    )
    # 233 MB against 538 MB: the 113 MB float32 embedding is most of what is left.
    assert q8["weight_bytes"] < 0.44 * f32["weight_bytes"]


def test_perplexity_within_3_percent_of_float32(engines):
    ids = english_token_ids(engines[None].get_tokenizer(), PERPLEXITY_TOKENS)
    f32 = perplexity(engines[None], ids)
    q8 = perplexity(engines["int8"], ids)
    assert 5 < f32 < 20  # a 135M model on English prose (9.98 measured)
    assert abs(q8 / f32 - 1) < 0.03, (f32, q8)
