"""SmolLM2-135M-Instruct's Q4_1 GGUF loaded with int8 weights (issue 29) against the same
file dequantized to float32: exact resident bytes, the perplexity of a fixed English text and
the greedy continuations of the twelve real prompts (tests/perplexity.py).

With --quantization int8 the file's Q4_1 projections keep their blocks without loss
(models/gguf.py decode_blocks): the 4-bit levels 0..15 as int8 with each block's float16
scale d and minimum m as stored, so q * d + m is the float32 load's weight. Measured: the
greedy tokens agree with the float32 load's on all 16 tokens for 12 of the 12 prompts (6 of
12 when Q4_1 was re-quantized to symmetric int8); the issue asks 10.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.perplexity import REAL_PROMPTS, english_token_ids, perplexity

# The real model's accuracy and end-to-end behaviour: CI proves it under Python 3.11; its
# programs and code paths run under 3.12 in the tiny-model tests (pyproject's `once`).
pytestmark = pytest.mark.once

_PROJECTIONS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
PERPLEXITY_TOKENS = 2048
NUM_GREEDY = 16


@pytest.fixture(scope="module")
def engines(smollm2_gguf):
    """float32 and int8-weight engines on the same file, one shape bucket set each."""
    from jpaged import LLM

    return {
        method: LLM(
            model=str(smollm2_gguf),
            quantization=method,
            max_num_seqs=len(REAL_PROMPTS),
            max_model_len=PERPLEXITY_TOKENS + 64,
            max_num_batched_tokens=512,
            min_token_bucket=512,
        )
        for method in (None, "int8")
    }


def test_int8_weights_are_resident_as_int8(engines, smollm2_gguf):
    """Exact resident bytes: each projection (all Q4_1 in the file) 1 byte per weight plus a
    float16 scale and a float16 offset per 32 (the file's d and m); the embedding (the file's
    one Q8_0 tensor) and norms float32."""
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
            expected += n + n // 32 * (2 + 2)
        else:
            expected += 4 * n  # token_embd (the tied LM head) and norms, float32
    assert kinds == {"Q4_1"}
    assert q8["weight_bytes"] == expected == 232_826_112
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


def test_greedy_outputs_agree_on_16_tokens_with_float32(engines):
    """The issue's check: at least 10 of the 12 real prompts give the float32 load's first 16
    greedy tokens (12 of 12 measured); all twelve in one generate call per engine."""
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    runs = {
        method: [list(o.outputs[0].token_ids) for o in llm.generate(REAL_PROMPTS, params)]
        for method, llm in engines.items()
    }
    base, q8 = runs[None], runs["int8"]
    assert len(base) == len(REAL_PROMPTS) == 12 and all(len(t) == NUM_GREEDY for t in base)
    agree = [b == q for b, q in zip(base, q8, strict=True)]
    assert sum(agree) >= 10, agree
