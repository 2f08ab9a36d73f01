"""LLM.embed equals transformers' pooled last hidden state, through the paged engine.

Prompts of mixed lengths are embedded together with max_num_seqs smaller than their number
and a token budget smaller than the longest (so prompts are prefilled in chunks and the
mean adds chunks up), beside a generating request; prefix caching is on and a prompt that
repeats another is embedded from its own tokens, not read from the cache.
"""

import numpy as np
import pytest
import torch
import transformers
from checkpoints import ARCHS

from jpaged import LLM, PoolingParams, SamplingParams

LENGTHS = [1, 5, 17, 40, 99]


def hf_hidden(path, prompts):
    """transformers' last_hidden_state [n, D] of each prompt alone (float64 numpy)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [
            model.model(torch.tensor([p])).last_hidden_state[0].double().numpy() for p in prompts
        ]


def normalized(x):
    return x / np.linalg.norm(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_embeddings_equal_transformers_pooled_hidden_states(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch])
    llm = LLM(path, max_num_seqs=3, max_model_len=128, max_num_batched_tokens=32, page_size=8,
              enable_prefix_caching=True)  # fmt: skip
    vocab = llm.llm_engine.model_config.vocab_size
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS]
    prompts.append(list(prompts[3]))  # the same prompt again: its pages are cached by now
    hidden = hf_hidden(path, prompts)
    last = llm.embed(prompts)
    assert [o.prompt_token_ids for o in last] == prompts
    for out, h in zip(last, hidden, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, normalized(h[-1]), atol=1e-5)
    mean = llm.embed(prompts, PoolingParams(pooling_type="mean", normalize=False))
    for out, h in zip(mean, hidden, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, h.mean(0), atol=1e-5)
    cls = llm.embed(prompts[:3], PoolingParams(pooling_type="cls", dimensions=8))
    for out, h in zip(cls, hidden[:3], strict=True):
        np.testing.assert_allclose(out.outputs.embedding, normalized(h[0, :8]), atol=1e-5)
    assert llm.stats()["pages_used"] == 0


def test_embedding_requests_batch_with_generation(tiny_checkpoints):
    """An embedding request and a generating one in the same steps: each gets what it gets
    alone (the generated tokens exactly, the embedding to float rounding)."""
    path = str(tiny_checkpoints[ARCHS[0]])
    llm = LLM(path, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, page_size=8)
    prompt = list(range(3, 40))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want_tokens = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    want = llm.embed([prompt[:20]])[0].outputs.embedding
    engine = llm.llm_engine
    engine.add_request("gen", prompt, greedy)
    from jpaged.sample.sampling_params import RequestOutputKind

    one = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("emb", prompt[:20], one, pooling=PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["gen"].outputs[0].token_ids == want_tokens and done["gen"].embedding is None
    np.testing.assert_allclose(done["emb"].embedding, want, atol=1e-6)


def test_bad_embedding_requests_are_refused_with_the_field(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints[ARCHS[0]]), max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="prompt 1: prompt must not be empty"):
        llm.embed([[3, 4], []])
    with pytest.raises(ValueError, match=r"dimensions \(4096\) must be at most the model's"):
        llm.embed([[3, 4]], PoolingParams(dimensions=4096))
    with pytest.raises(ValueError, match="max_tokens=1 and n=1"):
        llm.llm_engine.add_request("x", [3, 4], SamplingParams(max_tokens=2),
                                   pooling=PoolingParams())  # fmt: skip
    assert not llm.llm_engine.has_unfinished_requests()
