"""Beam search on the paged cache equals transformers' beam search, beam for beam.

The checkpoint is the tiny Llama with its lm_head scaled up (a random tiny model is nearly
uniform, so beams would be near ties that float rounding decides) and its EOS id set to a
token that is often among the top candidates, so that beams do end with EOS. Every case
runs several prompts at once in one small engine (beams of different requests share steps)
and compares token ids exactly and scores to 1e-4 with generate(num_beams=W, ...).
"""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from checkpoints import load_torch_model
from safetensors.numpy import load_file, save_file

from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.core.beam_search import BeamSearchOutput

EOS = 802  # often in the top 8 of this checkpoint's next-token distributions
LM_HEAD_SCALE = 25.0
PAGE_SIZE = 4
MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 9, 12, 3, 7)

# (beam_width, length_penalty, early_stopping)
CASES = [
    (2, 1.0, False),
    (2, 0.5, False),
    (2, -1.0, False),
    (4, 1.0, False),
    (4, 0.5, False),
    (4, -1.0, False),
    (4, 2.0, "never"),
    (4, 0.5, True),
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("beam") / "llama_eos"
    shutil.copytree(tiny_checkpoints["llama"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * LM_HEAD_SCALE
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for name, value in (("config.json", EOS), ("generation_config.json", [EOS])):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = value
        (path / name).write_text(json.dumps(cfg))
    return path


# A small engine: 8 sequence slots (two requests of four beams), few step shapes.
ENGINE_ARGS = {"max_num_seqs": 8, "max_model_len": 64, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), page_size=PAGE_SIZE, num_pages=128, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_torch_model(checkpoint)


@pytest.fixture(scope="module")
def prompts(llm):
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.vocab_size
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def hf_beam_search(model, prompt, params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """transformers' beams for one prompt: (generated ids cut after the first EOS, score)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            pad_token_id=EOS,
            return_dict_in_generate=True,
            output_scores=True,
        )
    beams = []
    for row, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()):
        if EOS in row:
            row = row[: row.index(EOS) + 1]
        beams.append((row, score))
    return beams


def assert_matches(out: BeamSearchOutput, expected, params: BeamSearchParams):
    assert [s.token_ids for s in out.sequences] == [e[0] for e in expected]
    for seq, (_, score) in zip(out.sequences, expected, strict=True):
        # Scores are log-probability sums scaled by n ** -length_penalty (x12 at -1), so
        # the sums are held to 1e-4 and the scores to that, scaled.
        norm = len(seq.token_ids) ** params.length_penalty
        assert seq.cum_logprob == pytest.approx(score * norm, abs=1e-4)
        assert seq.score == pytest.approx(score, abs=1e-4 / norm)
        assert seq.score == pytest.approx(seq.cum_logprob / norm, rel=1e-9)
        assert seq.finish_reason == ("stop" if seq.token_ids[-1] == EOS else "length")
        if seq.finish_reason == "length":
            assert len(seq.token_ids) == params.max_tokens


def test_beam_search_equals_transformers(llm, hf_model, prompts):
    finish_reasons = {2: [], 4: []}
    eos_not_best = 0
    for width, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        outs = llm.beam_search(prompts, params)
        assert len(outs) == len(prompts)
        for out, prompt in zip(outs, prompts, strict=True):
            assert out.prompt_token_ids == prompt
            assert len(out.sequences) == width
            assert_matches(out, hf_beam_search(hf_model, prompt, params), params)
            finish_reasons[width] += [s.finish_reason for s in out.sequences]
            eos_not_best += sum(s.finish_reason == "stop" for s in out.sequences[1:])
        stats = llm.stats()
        assert stats["pages_used"] == 0
        assert stats["num_running"] == stats["num_waiting"] == 0
    # The EOS path is covered for both widths, and EOS beams also rank below the best.
    for width in (2, 4):
        assert finish_reasons[width].count("stop") >= 2
        assert finish_reasons[width].count("length") >= 2
    assert eos_not_best >= 1


def test_text_prompt_and_text(llm, hf_model):
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.7)
    (out,) = llm.beam_search("Paged attention", params)
    ids = tok.encode("Paged attention")
    assert out.prompt == "Paged attention"
    assert out.prompt_token_ids == ids
    assert_matches(out, hf_beam_search(hf_model, ids, params), params)
    for s in out.sequences:
        assert s.text == tok.decode(s.token_ids, True)


def test_beams_share_pages(llm, hf_model, prompts):
    """Four beams of a 30-token prompt hold its pages once: the peak stays far below four
    full copies, and everything is freed at the end."""
    prompt = (prompts[2] * 3)[:30]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    llm.reset_stats()
    assert llm.stats()["pages_used"] == 0
    (out,) = llm.beam_search([prompt], params)
    assert_matches(out, hf_beam_search(hf_model, prompt, params), params)
    stats = llm.stats()
    prompt_pages = math.ceil(len(prompt) / PAGE_SIZE)  # 8
    own_pages = math.ceil(MAX_TOKENS / PAGE_SIZE) + 1  # a beam's tokens + its copied page
    full_copies = 4 * math.ceil((len(prompt) + MAX_TOKENS) / PAGE_SIZE)  # 44
    assert stats["peak_pages_used"] <= prompt_pages + 4 * own_pages  # 24
    assert stats["peak_pages_used"] < full_copies // 2
    assert stats["pages_used"] == 0


def test_small_pool_preempts_beams(checkpoint, hf_model, prompts):
    """16 usable pages (one sequence of max_model_len) hold neither two requests' beams nor
    one request's four beams at their longest (5 prompt pages + 4 x 3): beams are preempted
    and recomputed (with prefix hits), and the results are still transformers'."""
    small = LLM(str(checkpoint), page_size=PAGE_SIZE, num_pages=17, **ENGINE_ARGS)
    long_prompts = [(p * 4)[:20] for p in prompts[:3]]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.5)
    outs = small.beam_search(long_prompts, params)
    for out, prompt in zip(outs, long_prompts, strict=True):
        assert_matches(out, hf_beam_search(hf_model, prompt, params), params)
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["pages_used"] == 0


def test_ignore_eos_runs_to_max_tokens(llm, prompts):
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.beam_search(prompts[1:3], params)
    for out in outs:
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert len(s.token_ids) == MAX_TOKENS
            assert s.finish_reason == "length"
    assert any(EOS in s.token_ids for o in outs for s in o.sequences)
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be >= 1"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width must be an integer"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be >= 1"),
        (
            {"beam_width": 2, "max_tokens": 4, "length_penalty": "1"},
            "length_penalty must be a number",
        ),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf}, "must be a finite number"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": "always"}, "early_stopping must be"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": 1}, "early_stopping must be"),
    ],
)
def test_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_engine_limits(llm, prompts):
    # With one EOS id a beam needs its top 2 x beam_width tokens; the sampler returns 20.
    with pytest.raises(ValueError, match=r"beam_width must be <= 10 \(each beam's top 2"):
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match=r"beam_width must be <= max_num_seqs \(8\), got 9"):
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=9, max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt 1: 60 tokens \+ max_tokens \(5\) exceed"):
        llm.beam_search([prompts[0], [1] * 60], BeamSearchParams(beam_width=2, max_tokens=5))
    with pytest.raises(ValueError, match="prompt 0: prompt must not be empty"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=5))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(prompts[:1], {"beam_width": 2, "max_tokens": 4})
    llm.llm_engine.add_request("busy", prompts[0], SamplingParams(max_tokens=4))
    try:
        with pytest.raises(RuntimeError, match="needs an idle engine"):
            llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4))
    finally:
        llm.llm_engine.abort_request("busy")
    assert llm.stats()["pages_used"] == 0
