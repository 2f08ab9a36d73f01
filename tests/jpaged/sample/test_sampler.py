"""Sampling against transformers: filters, penalties and log-probabilities.

The sampler is checked on transformers' own logits for a tiny checkpoint: top-k / top-p /
min-p keep exactly the candidates transformers' warpers keep, and many seeded draws follow the
distribution computed in numpy from those logits; repetition penalty equals transformers'
logits processor, presence / frequency penalties the OpenAI formula. End to end, the engine's
log-probabilities equal log_softmax of transformers' logits at every generated position, and
every sampled token lies in the candidate set transformers' warpers allow there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoints import load_torch_model
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jpaged import LLM, SamplingParams
from jpaged.sample.sampler import (
    Penalties,
    SamplingInputs,
    apply_penalties,
    sample,
    seed_to_key_data,
)

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints):
    return load_torch_model(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def hf_logits(hf_model) -> np.ndarray:
    """float32[V]: transformers' next-token logits after PROMPT."""
    with torch.no_grad():
        return hf_model(torch.tensor([PROMPT])).logits[0, -1].numpy()


def hf_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """Candidate mask and renormalised probabilities after transformers' warpers, in its order."""
    scores = torch.tensor(logits)[None]
    ids = torch.tensor([PROMPT])
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        scores = w(ids, scores)
    scores = scores[0].numpy().astype(np.float64)
    allowed = np.isfinite(scores)
    probs = np.zeros_like(scores)
    probs[allowed] = np.exp(scores[allowed] - scores[allowed].max())
    return allowed, probs / probs.sum()


def draws(logits: np.ndarray, num: int, *, temperature, top_k=0, top_p=1.0, min_p=0.0, seed=7):
    """num tokens sampled by jpaged from the same logits, one row per draw."""
    inputs = SamplingInputs(
        temperature=jnp.full(num, temperature, jnp.float32),
        top_k=jnp.full(num, top_k, jnp.int32),
        top_p=jnp.full(num, top_p, jnp.float32),
        min_p=jnp.full(num, min_p, jnp.float32),
        key_data=jnp.tile(seed_to_key_data(seed), (num, 1)),
        num_generated=jnp.arange(num, dtype=jnp.int32),  # a fresh stream per draw
        banned=jnp.full((num, 1), -1, jnp.int32),
    )
    batch = jnp.broadcast_to(jnp.asarray(logits), (num, logits.shape[0]))
    out = jax.jit(sample, static_argnames="num_logprobs")(batch, inputs, num_logprobs=0)
    return np.asarray(out.tokens)


def assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit of the drawn tokens to probs (bins of expected count >= 5,
    the rest merged). The draws are seeded, so the outcome is fixed; a wrong distribution
    (a filter off by one token, a temperature applied twice) gives p-values far below 1e-3."""
    num = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    big = probs * num >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(probs[big] * num, probs[~big].sum() * num)
    if expected[-1] < 5:  # nothing left to merge into a bin of its own
        observed, expected = observed[:-1], expected[:-1]
        observed[-1] += counts[~big].sum()
    assert chisquare(observed, expected).pvalue > 1e-3


FILTERS = [
    # (temperature, top_k, top_p, min_p)
    (0.05, 0, 0.5, 0.0),
    (0.05, 0, 0.9, 0.0),
    (0.05, 0, 1.0, 0.2),
    (0.05, 5, 1.0, 0.0),
    (0.05, 12, 0.8, 0.05),
    (0.1, 0, 0.95, 0.01),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS)
def test_filters_keep_transformers_candidates_and_follow_its_distribution(
    hf_logits, temperature, top_k, top_p, min_p
):
    allowed, probs = hf_allowed(hf_logits, temperature, top_k, top_p, min_p)
    assert 2 <= allowed.sum() < len(allowed) // 2  # a real restriction, not all or one
    tokens = draws(hf_logits, 8192, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = np.bincount(tokens, minlength=len(allowed))
    assert counts[~allowed].sum() == 0  # nothing outside transformers' candidate set
    assert (counts > 0)[allowed & (probs > 2e-3)].all()  # every likely candidate is drawn
    assert_follows(tokens, probs)


def test_temperature_without_filters_follows_softmax(hf_logits):
    scaled = hf_logits.astype(np.float64) / 0.05
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    assert_follows(draws(hf_logits, 8192, temperature=0.05), probs)
    # The same check rejects a distribution at another temperature.
    hotter = np.exp(scaled / 1.2 - (scaled / 1.2).max())
    with pytest.raises(AssertionError):
        assert_follows(draws(hf_logits, 8192, temperature=0.05), hotter / hotter.sum())


def test_repetition_penalty_matches_transformers(hf_logits):
    prompt = np.array(PROMPT, np.int32)
    output = np.array([11, 300, 11, 2047], np.int32)
    seen = torch.tensor([[*PROMPT, *output.tolist()]])
    for rep in (1.3, 0.7):
        want = RepetitionPenaltyLogitsProcessor(rep)(seen, torch.tensor(hf_logits)[None])[0]
        got = apply_penalties(
            jnp.asarray(hf_logits)[None],
            Penalties(
                prompt_tokens=jnp.asarray(prompt)[None],
                output_tokens=jnp.asarray(np.concatenate([output, [-1, -1]]))[None],
                presence=jnp.zeros(1),
                frequency=jnp.zeros(1),
                repetition=jnp.full(1, rep),
            ),
        )[0]
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, atol=1e-6)
        changed = np.flatnonzero(np.asarray(got) != hf_logits)
        assert set(changed) <= set(PROMPT) | set(output.tolist())


def test_presence_and_frequency_penalties_follow_the_openai_formula(hf_logits):
    output = np.array([11, 300, 11, 2047, 11], np.int32)
    got = apply_penalties(
        jnp.asarray(hf_logits)[None],
        Penalties(
            prompt_tokens=jnp.asarray(np.array(PROMPT, np.int32))[None],
            output_tokens=jnp.asarray(output)[None],
            presence=jnp.full(1, 0.5),
            frequency=jnp.full(1, 0.25),
            repetition=jnp.ones(1),
        ),
    )[0]
    want = hf_logits.astype(np.float64).copy()
    counts = np.bincount(output, minlength=len(want))
    want -= 0.25 * counts + 0.5 * (counts > 0)  # prompt tokens are not penalised here
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_banned_tokens_are_never_sampled(hf_logits):
    best = int(np.argmax(hf_logits))
    inputs = SamplingInputs(
        temperature=jnp.array([0.0, 1.0]),
        top_k=jnp.zeros(2, jnp.int32),
        top_p=jnp.ones(2),
        min_p=jnp.zeros(2),
        key_data=jnp.zeros((2, 2), jnp.uint32),
        num_generated=jnp.zeros(2, jnp.int32),
        banned=jnp.array([[best, -1], [best, -1]], jnp.int32),
    )
    logits = jnp.asarray(hf_logits).at[best].set(100.0)
    out = sample(jnp.stack([logits, logits]), inputs, num_logprobs=0)
    assert best not in np.asarray(out.tokens).tolist()


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(
        str(tiny_checkpoints["llama"]),
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=32,
        page_size=8,
        num_pages=32,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True),
        SamplingParams(
            temperature=0.05,
            top_p=0.8,
            min_p=0.05,
            top_k=20,
            max_tokens=12,
            logprobs=5,
            seed=11,
            ignore_eos=True,
        ),
    ],
    ids=["greedy", "filtered"],
)
def test_logprobs_and_samples_match_transformers_position_by_position(llm, hf_model, params):
    (out,) = llm.generate([PROMPT], params)
    c = out.outputs[0]
    assert len(c.token_ids) == len(c.logprobs) == 12
    full = torch.tensor([PROMPT + c.token_ids])
    with torch.no_grad():
        logits = hf_model(full).logits[0, len(PROMPT) - 1 : -1].numpy()  # [12, V]
    ref = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1).numpy()
    cumulative = 0.0
    for i, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        top5 = np.argsort(-ref[i])[:5]
        assert set(pos) == {tok, *top5.tolist()}
        for t, lp in pos.items():
            assert abs(lp - ref[i, t]) < 1e-4, (i, t, lp, ref[i, t])
        cumulative += ref[i, tok]
        if params.greedy:
            assert tok == top5[0]
        else:
            allowed, _ = hf_allowed(
                logits[i], params.temperature, params.top_k, params.top_p, params.min_p
            )
            assert allowed[tok], (i, tok)
    assert abs(c.cumulative_logprob - cumulative) < 1e-3
