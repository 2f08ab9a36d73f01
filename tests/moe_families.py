"""Tiny random Qwen3-MoE, Mixtral and OLMoE checkpoints from transformers' config classes,
and transformers' greedy tokens for them (float32, eager attention). Shared by
tests/models/test_moe.py and tests/parallel/test_expert_parallel.py (which writes them in
the test process and runs the engines in a worker with 8 CPU devices)."""

from __future__ import annotations

import functools
from pathlib import Path

FAMILIES = ("qwen3moe", "mixtral", "olmoe")
# Prompt lengths: longer than a page and than a step's token budget, sharing a prefix.
PROMPT_LENGTHS = (19, 33, 11, 26, 12)
PREFIX = 10
MAX_TOKENS = 8


def tiny_config(family: str):
    """The family's transformers config: 3 layers, 8 experts, top-2, hidden 64."""
    import transformers

    common = {
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
        )
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=8)
    if family == "olmoe":
        return transformers.OlmoeConfig(
            **common, num_experts=8, clip_qkv=0.5, eos_token_id=None, pad_token_id=None
        )
    raise ValueError(family)


def save_tiny(path: str | Path, family: str, *, seed: int = 0) -> Path:
    """A random model of the family saved with save_pretrained; norm weights perturbed so a
    misplaced norm shows, router weights scaled so routing is decisive."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(20.0)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """PROMPT_LENGTHS prompts, each starting with the same PREFIX tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, PREFIX).tolist()
    return [shared + rng.integers(0, vocab, n - PREFIX).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(path, token_prompts: list[list[int]], max_new_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens for each prompt alone."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    outs = []
    with torch.no_grad():
        for p in token_prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_logits(path, token_ids: list[int]):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def paged_logits(loaded, chunks: list[int], token_ids: list[int], *, page=4, stacked=False):
    """One sequence through models.llama.forward in chunks (1: a decode step) over a
    shuffled page table whose unused pages hold NaN; the logits of every position."""
    import jax.numpy as jnp
    import numpy as np

    from models.llama import compute_logits, stack_layers

    cfg = loaded.config
    params = stack_layers(loaded.params) if stacked else loaded.params
    num_pages = -(-len(token_ids) // page) + 8
    shape = (cfg.num_kv_heads, cfg.num_layers * num_pages, page, cfg.head_dim)
    pool = (jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
    pages = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    table = pages[None, : -(-len(token_ids) // page)].astype(np.int32)
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        hidden, pool = _jitted_forward()(
            params,
            cfg,
            pool,
            jnp.asarray(token_ids[start : start + n], jnp.int32),
            jnp.asarray(pos, jnp.int32),
            jnp.asarray(table[0][pos // page] * page + pos % page, jnp.int32),
            jnp.asarray([start + n], jnp.int32),
            jnp.asarray(table),
            jnp.asarray([0, n], jnp.int32),
            decode_only=n == 1,
        )
        out.append(np.asarray(compute_logits(params, cfg, hidden)))
        start += n
    return np.concatenate(out)


@functools.cache
def _jitted_forward():
    import jax

    from models.llama import forward

    return jax.jit(forward, static_argnums=(1,), static_argnames=("decode_only",))


def engine_greedy(path, token_prompts, max_tokens: int = MAX_TOKENS, **engine_kwargs):
    """Our greedy tokens, every prompt submitted together to one LLM; its pool is whole
    again after."""
    from jpaged import LLM, SamplingParams

    llm = LLM(str(path), **engine_kwargs)
    outs = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert llm.stats()["pages_used"] == 0
    return [o.outputs[0].token_ids for o in outs]
