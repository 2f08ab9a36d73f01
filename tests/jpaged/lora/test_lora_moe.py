"""LoRA on mixture-of-experts models (issue 55): an adapter of the attention projections gives
transformers' greedy tokens on the checkpoint with it merged in (Qwen3-MoE, Mixtral), mixed
with the base in one batch; an adapter of an expert or router module is a one-line error
naming the adapter and the module, and the engine serves on."""

from __future__ import annotations

import pytest
from dense_families import hf_greedy
from lora_adapters import merge, write_adapter
from moe_families import save_tiny

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.lora import LoRAError

pytestmark = pytest.mark.needs_torch  # left out by --without-torch (tests/needs_torch.py)

PROMPTS = [[1, 5, 9, 13, 17, 21, 3, 7, 11], [2, 4, 6, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_attention_adapter_equals_transformers_merged(family, tmp_path):
    base = save_tiny(tmp_path / "base", family)
    adapter = write_adapter(tmp_path / "attn", base, rank=8, seed=21, modules=ATTENTION)
    want = hf_greedy(merge(base, adapter, tmp_path / "merged"), PROMPTS, 6)
    plain = hf_greedy(base, PROMPTS, 6)
    assert want != plain  # the adapter changes the tokens
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
              max_model_len=64, num_pages=64, page_size=4, max_num_batched_tokens=32)  # fmt: skip
    req = LoRARequest("attn", 1, str(adapter))
    outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=[req, req, None, None])
    assert [o.outputs[0].token_ids for o in outs] == want + plain
    expert = write_adapter(tmp_path / "expert", base, rank=4, seed=22, modules=("q_proj", "up_proj"))
    with pytest.raises(LoRAError, match=r"'expert': target module\(s\) up_proj: a mixture-of-"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("expert", 2, str(expert)))
    outs = llm.generate(PROMPTS, GREEDY, lora_request=req)  # serves on
    assert [o.outputs[0].token_ids for o in outs] == want
