"""prompt_logprobs through the engine equal transformers' on the tiny llama checkpoint, over
a chunked prefill and for a prompt already in the prefix cache (recomputed, not skipped)."""

import numpy as np
import pytest
import torch
import transformers

from jpaged import LLM, SamplingParams


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def chunked_llm(tiny_checkpoints):
    return LLM(
        str(tiny_checkpoints["llama"]),
        max_num_seqs=4,
        max_model_len=128,
        max_num_batched_tokens=16,  # a 40-token prompt is prefilled in three chunks
        page_size=8,
        num_pages=64,
    )


def test_prompt_logprobs_equal_transformers_over_chunks_and_prefix_hits(
    chunked_llm, tiny_checkpoints
):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints["llama"], torch_dtype=torch.float32
    )
    prompt = np.random.default_rng(3).integers(3, 2000, 40).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    ref = torch.log_softmax(logits, dim=-1).numpy()
    params = greedy(max_tokens=2, prompt_logprobs=3)
    for _ in range(2):  # the second run's prompt is in the prefix cache: recomputed
        out = chunked_llm.generate([prompt], params)[0]
        lp = out.prompt_logprobs
        assert len(lp) == len(prompt) and lp[0] is None
        for k in range(1, len(prompt)):
            entry = lp[k]
            assert entry[prompt[k]] == pytest.approx(ref[k - 1, prompt[k]], abs=1e-4)
            best = np.argsort(-ref[k - 1])[:3].tolist()
            assert set(best) <= set(entry)
    assert chunked_llm.stats()["prefix_cache_hit_tokens"] == 0
