"""Helpers for the Gemma 2, Gemma 3, Mistral (sliding window), Phi-3 and MoE tests: tiny random
checkpoints from a transformers config object, transformers' logits and greedy tokens, our
logits over a shuffled paged pool, and our greedy tokens through the engine.

Everything is float32 with eager attention in transformers (soft-capping needs it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import compute_logits, forward, stack_layers

_forward = jax.jit(forward, static_argnums=(1,), static_argnames=("decode_only",))


def save_tiny(path: str | Path, config, *, seed: int = 0) -> Path:
    """A random model of the transformers config, saved with save_pretrained. Norm weights
    are perturbed away from their init so that a misplaced norm (or a missing + 1) shows."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def hf_model(path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


def _reference(path):
    """hf_model(path) for the references below, which only read it: loaded once per
    checkpoint and version of its files (a module's tests ask for several references of one
    model). hf_model itself gives a fresh model, which a test may change."""
    files = sorted(Path(path).resolve().iterdir())
    return _loaded(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@functools.lru_cache(maxsize=4)
def _loaded(files: tuple) -> object:
    return hf_model(Path(files[0][0]).parent)


def hf_logits(path, token_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return _reference(path)(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone."""
    import torch

    model = _reference(path)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,  # models without one (OLMoE) would warn and guess
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_beams(path, prompt, width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """transformers' beam search (no EOS: every beam runs max_tokens): (ids, sum of logprobs)
    best first (tests/jpaged/core/test_beam_search.py's reference, length_penalty 1)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _reference(path).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
            num_return_sequences=width, max_new_tokens=max_tokens, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    rows = out.sequences[:, len(prompt) :].tolist()
    return [(r, s * max_tokens) for r, s in zip(rows, out.sequences_scores.tolist(), strict=True)]


def check_forks_and_beams(llm, path, prompt: list[int], max_tokens: int) -> None:
    """On llm (an engine of path's checkpoint): n = 2 greedy forks of the prompt (copy-on-write
    of its partial page) each give transformers' greedy tokens of the prompt alone, and a beam
    search of width 2 gives transformers' beams (they diverge, fork and drop), sums of
    logprobs within 1e-4; the pool is whole after."""
    import pytest

    from jpaged import BeamSearchParams, SamplingParams

    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([prompt], greedy)
    assert [c.token_ids for c in out.outputs] == hf_greedy(path, [prompt], max_tokens) * 2
    (beams,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=max_tokens))
    assert llm.stats()["pages_used"] == 0
    want = hf_beams(path, prompt, 2, max_tokens)
    assert [s.token_ids for s in beams.sequences] == [w[0] for w in want]
    assert want[0][0] != want[1][0]
    for seq, (_, cum) in zip(beams.sequences, want, strict=True):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


def paged_logits(loaded, chunks: list[int], token_ids: list[int], *, page=4, stacked=False):
    """One sequence through forward() in chunks (1: a decode step) over a shuffled page
    table whose unused pages hold NaN; the logits of every position [len(token_ids), V].
    Prefill chunks are padded to the longest one as the engine pads a step (padding tokens
    write the null page, which the sequence's table never names), so one program serves them."""
    cfg = loaded.config
    params = stack_layers(loaded.params) if stacked else loaded.params
    num_pages = -(-len(token_ids) // page) + 8
    shape = (cfg.num_kv_heads, cfg.num_layers * num_pages, page, cfg.head_dim)
    caches = (jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
    pages = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    table = pages[None, : -(-len(token_ids) // page)].astype(np.int32)
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        tokens, positions, slots = padded_chunk(
            token_ids[start : start + n], pos, table[0][pos // page] * page + pos % page,
            1 if n == 1 else max(chunks),
        )  # fmt: skip
        hidden, caches = _forward(
            params,
            cfg,
            caches,
            tokens,
            positions,
            slots,
            jnp.asarray([start + n], jnp.int32),
            jnp.asarray(table),
            jnp.asarray([0, n], jnp.int32),
            decode_only=n == 1,
        )
        out.append(np.asarray(compute_logits(params, cfg, hidden[:n])))
        start += n
    return np.concatenate(out)


def padded_chunk(token_ids, positions, slots, size: int):
    """A chunk's token ids, positions and slots (int32[..., n]) padded to `size` tokens the
    way jpaged/worker/step_inputs.py pads a step: token 0 at position 0 into slot 0 (the null
    page) of every slot row."""
    n = len(token_ids)
    slots = np.asarray(slots, np.int32)
    pad = [(0, 0)] * (slots.ndim - 1) + [(0, size - n)]
    return (
        jnp.asarray(np.pad(np.asarray(token_ids, np.int32), (0, size - n))),
        jnp.asarray(np.pad(np.asarray(positions, np.int32), (0, size - n))),
        jnp.asarray(np.pad(slots, pad)),
    )


def prompts_with_shared_prefix(vocab: int, lengths: list[int], *, prefix: int, seed: int = 0):
    """Prompts of the given lengths, each starting with the same `prefix` tokens (so that
    prefix caching shares their first pages)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix).tolist()
    return [shared + rng.integers(0, vocab, n - prefix).tolist() for n in lengths]


def engine_greedy(path, prompts, max_tokens: int, **engine_kwargs) -> list[list[int]]:
    """Our greedy tokens, every prompt submitted together to one LLM; its pool must be
    whole again after."""
    return engine_greedy_and_stats(path, prompts, max_tokens, **engine_kwargs)[0]


def engine_greedy_and_stats(
    path, prompts, max_tokens: int, **engine_kwargs
) -> tuple[list[list[int]], dict]:
    """engine_greedy's tokens and the engine's stats() after (num_preemptions, ...).

    With max_num_batched_tokens given, every step runs in that one token bucket unless
    min_token_bucket says otherwise: a tiny model's padded step takes milliseconds, each
    further bucket seconds of compiling (tests/jpaged/core/test_paging_groups.py ran 165 s
    with the default buckets, 110 s with one)."""
    from jpaged import LLM, SamplingParams

    if "max_num_batched_tokens" in engine_kwargs:
        engine_kwargs.setdefault("min_token_bucket", engine_kwargs["max_num_batched_tokens"])
    llm = LLM(str(path), **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    stats = llm.stats()
    assert stats["pages_used"] == 0
    return [o.outputs[0].token_ids for o in outs], stats


# A pool too small for two of the preemption prompts at once: 2 sequences of 30 and 33
# tokens plus 8 new need 10 + 11 pages of 4 tokens, the pool holds 14 (one sequence of
# max_model_len 44 fits, so every request is admitted and one is preempted).
PREEMPTION_LENGTHS = [30, 33, 26]
PREEMPTION_ENGINE = {
    "max_num_seqs": 2,
    "page_size": 4,
    "num_pages": 14,
    "max_model_len": 44,
    "max_num_batched_tokens": 48,
}


def preempted_greedy(path, vocab: int, mode: str, max_tokens: int = 8, **engine_kwargs):
    """(our tokens, transformers') for the PREEMPTION_LENGTHS prompts on PREEMPTION_ENGINE's
    pool (engine_kwargs override it) with prefix caching on, after asserting that a sequence
    was preempted (mode: recompute or swap)."""
    prompts = prompts_with_shared_prefix(vocab, PREEMPTION_LENGTHS, prefix=8, seed=3)
    ours, stats = engine_greedy_and_stats(
        path,
        prompts,
        max_tokens,
        preemption_mode=mode,
        enable_prefix_caching=True,
        **{**PREEMPTION_ENGINE, **engine_kwargs},
    )
    assert stats["num_preemptions"] >= 1
    return ours, hf_greedy(path, prompts, max_tokens)


def hf_greedy_incremental(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens one forward per token over its cache, without generate
    (Phi-3's generate drops its cache once a sequence first passes the LongRoPE original
    length and recomputes it with the long factors; a paged engine keeps its keys)."""
    import torch

    model = _reference(path)
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for j in range(len(p), len(p) + max_new_tokens - 1):
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                    position_ids=torch.tensor([[j]]),
                )
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs
