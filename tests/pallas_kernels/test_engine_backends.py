"""The engine gives the same greedy tokens through the Pallas kernel path (interpret mode on
this CPU) as through the pure-jnp reference, for a mixed batch with chunked prefill."""

import pytest
from numpy_checkpoints import make_llama_checkpoint

from jpaged import LLM, SamplingParams

PROMPTS = [[7], [3, 9, 27, 81, 243], list(range(100, 119)), list(range(500, 541))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # head_dim 64 (the kernels' smallest tested size), 2 query heads per KV head.
    path = tmp_path_factory.mktemp("kernel_ckpt")
    return make_llama_checkpoint(path / "llama", hidden=128, heads=2, kv_heads=1)


def greedy_tokens(path, backend):
    llm = LLM(
        str(path),
        attention_backend=backend,
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=16,  # the 41-token prompt is prefilled in chunks
        page_size=8,
        num_pages=40,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_pallas_interpret_equals_reference(checkpoint):
    reference = greedy_tokens(checkpoint, "reference")
    assert all(len(t) == 8 for t in reference)
    assert greedy_tokens(checkpoint, "pallas_interpret") == reference
