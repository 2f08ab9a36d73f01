"""Continuous batching gives exactly transformers' greedy tokens, prompt by prompt.

Ten prompts of mixed lengths (1 to 200 tokens) are submitted together with max_num_seqs
smaller than their number, so requests join and leave mid-batch; prompts longer than the
token budget are prefilled in chunks. Each result must equal transformers' own greedy
generate for that prompt alone.
"""

import numpy as np
import pytest
import torch
import transformers
from checkpoints import ARCHS

from jpaged import LLM, SamplingParams

LENGTHS = [1, 3, 16, 17, 40, 64, 99, 128, 150, 200]
NEW_TOKENS = 32


def hf_greedy(path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch])
    rng = np.random.default_rng(3)
    llm = LLM(
        path,
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=128,
        page_size=16,
    )
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    expected = hf_greedy(path, prompts)
    for out, prompt, exp in zip(outs, prompts, expected, strict=True):
        assert out.prompt_token_ids == prompt
        (c,) = out.outputs
        assert c.token_ids == exp
        assert c.finish_reason == ("length" if len(exp) == NEW_TOKENS else "stop")
    stats = llm.stats()
    assert stats["pages_used"] == 0
    assert stats["pages_free"] == stats["pages_total"]
