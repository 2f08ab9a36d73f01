"""Verification of proposals: exact where exactness is possible, chi-square where not.

Greedy rows give the argmax chain on hand-built logits, and with penalties and min_tokens
bans the tokens of step-by-step greedy sampling. A row without proposals samples exactly the
sampler's token. Sampling rows keep the target's distribution: 20,000 rows in one call, for a
draft model and for n-gram point masses, at the first position, at the second given the first
was accepted, and for the bonus token; the same chi-square bound rejects the usual wrong rules
(always accepting, drawing from p instead of the residual, an unnormalised residual). Outputs
of a seeded row do not depend on its position or neighbours in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from jpaged.sample.rejection_sampler import draft_sample, processed_probs, verify
from jpaged.sample.sampler import Penalties, SamplingInputs, sample, seeds_to_key_data

V = 8
N = 20_000
# Chi-square critical value at 1e-6: the keys are fixed, so this only guards against a seed
# that happens to sit in the far tail; the wrong rules below exceed it by orders of magnitude.
SIGNIFICANCE = 1e-6

verify_jit = jax.jit(verify, static_argnames="num_logprobs")
sample_jit = jax.jit(sample, static_argnames="num_logprobs")


def make_inputs(
    num: int,
    *,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seeds=None,
    num_generated=0,
    banned=None,
    penalties=None,
) -> SamplingInputs:
    def col(value, dtype):
        return jnp.asarray(np.broadcast_to(np.asarray(value, dtype), (num,)))

    seeds = range(num) if seeds is None else seeds
    return SamplingInputs(
        temperature=col(temperature, np.float32),
        top_k=col(top_k, np.int32),
        top_p=col(top_p, np.float32),
        min_p=col(min_p, np.float32),
        key_data=jnp.asarray(seeds_to_key_data(list(seeds))),
        num_generated=col(num_generated, np.int32),
        banned=jnp.full((num, 1), -1, jnp.int32) if banned is None else jnp.asarray(banned),
        penalties=penalties,
    )


def chi2_stat(samples: np.ndarray, p: np.ndarray) -> float:
    """Pearson's statistic of samples against p (inf if a token outside p's support appears)."""
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    support = p > 0
    if counts[~support].sum() > 0:
        return np.inf
    expected = p[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum())


def chi2_bound(p: np.ndarray) -> float:
    return float(chi2.ppf(1 - SIGNIFICANCE, df=int((p > 0).sum()) - 1))


def np_processed(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """Temperature then top-k, in float64: the reference target distribution."""
    scaled = logits.astype(np.float64) / temperature
    kth = np.sort(scaled)[::-1][top_k - 1]
    scaled = np.where(scaled < kth, -np.inf, scaled)
    e = np.exp(scaled - scaled.max())
    return e / e.sum()


# ---------------------------------------------------------------------------------------------
# Greedy rows: exact.


def chain_logits(chain: list[int], rng) -> np.ndarray:
    """float32[len(chain), V] whose argmax at position i is chain[i]."""
    logits = rng.normal(0.0, 0.3, (len(chain), V)).astype(np.float32)
    logits[np.arange(len(chain)), chain] += 3.0
    return logits


def test_greedy_accepts_the_argmax_prefix():
    rng = np.random.default_rng(0)
    chains = [[1, 2, 3, 4], [5, 0, 7, 2], [3, 3, 6, 1], [2, 7, 1, 0], [6, 1, 4, 5]]
    logits = np.stack([chain_logits(c, rng) for c in chains] + [np.zeros((4, V), np.float32)])
    proposals = np.array(
        [
            [1, 2, 3],  # all accepted
            [4, 0, 7],  # first rejected
            [3, 3, 0],  # two accepted, third rejected
            [-1, 5, 9],  # nothing proposed (entries ignored)
            [6, 1, 4],  # two proposed: the matching third is ignored
            [-1, -1, -1],  # padding row
        ],
        np.int32,
    )
    num_proposed = np.array([3, 3, 3, 0, 2, 0], np.int32)
    out = verify_jit(
        jnp.asarray(logits), jnp.asarray(proposals), jnp.asarray(num_proposed), make_inputs(6)
    )
    assert np.asarray(out.num_accepted).tolist() == [3, 0, 2, 0, 2, 0]
    assert np.asarray(out.tokens).tolist() == [
        [1, 2, 3, 4],
        [5, -1, -1, -1],
        [3, 3, 6, -1],
        [2, -1, -1, -1],
        [6, 1, 4, -1],
        [0, -1, -1, -1],
    ]
    tokens = np.asarray(out.tokens)
    raw = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    expected = np.where(
        tokens >= 0,
        np.take_along_axis(np.asarray(raw), np.maximum(tokens, 0)[..., None], -1)[..., 0],
        0.0,
    )
    np.testing.assert_allclose(np.asarray(out.logprobs), expected, rtol=1e-6)


def penalties_for(num: int, prompt: list[int], output: list[list[int]]) -> Penalties:
    out = np.full((num, 8), -1, np.int32)  # one width: one compile of the sampler
    for row, o in enumerate(output):
        out[row, : len(o)] = o
    return Penalties(
        prompt_tokens=jnp.asarray(np.tile(np.asarray(prompt, np.int32), (num, 1))),
        output_tokens=jnp.asarray(out),
        presence=jnp.full(num, 0.6, jnp.float32),
        frequency=jnp.full(num, 0.5, jnp.float32),
        repetition=jnp.full(num, 1.4, jnp.float32),
    )


def test_greedy_with_penalties_and_bans_equals_step_by_step_sampling():
    """Each position's penalties count the proposals before it; the min_tokens ban covers only
    the first num_banned_positions positions."""
    k, eos = 4, 0
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 0.4, (k + 1, V)).astype(np.float32)
    logits[0, eos] += 3.0  # the raw favourite at position 0, banned there
    logits[:, 5] += 0.9  # a favourite that the penalties push down once generated
    prompt, history = [3, 4], [5]

    def step_by_step(with_penalties: bool) -> list[int]:
        """The chain a non-speculative engine produces, one sampler call per token."""
        chain: list[int] = []
        for i in range(k + 1):
            inputs = make_inputs(
                1,
                num_generated=len(history) + i,
                banned=[[eos if i < 1 else -1]],
                penalties=penalties_for(1, prompt, [history + chain]) if with_penalties else None,
            )
            out = sample_jit(jnp.asarray(logits[i : i + 1]), inputs, num_logprobs=0)
            chain.append(int(out.tokens[0]))
        return chain

    chain = step_by_step(True)
    assert np.argmax(logits[0]) == eos and chain[0] != eos  # the ban matters
    assert chain != step_by_step(False)  # and so do the penalties

    wrong = list(chain[:k])
    wrong[2] = (wrong[2] + 1) % V
    inputs = make_inputs(
        2,
        num_generated=len(history),
        banned=[[eos], [eos]],
        penalties=penalties_for(2, prompt, [history, history]),
    )
    out = verify_jit(
        jnp.asarray(np.stack([logits, logits])),
        jnp.asarray(np.array([chain[:k], wrong], np.int32)),
        jnp.array([k, k], jnp.int32),
        inputs,
        num_banned_positions=jnp.array([1, 1], jnp.int32),
    )
    assert np.asarray(out.num_accepted).tolist() == [k, 2]
    assert np.asarray(out.tokens)[0].tolist() == chain
    assert np.asarray(out.tokens)[1].tolist() == chain[:3] + [-1, -1]


# ---------------------------------------------------------------------------------------------
# Rows without proposals, and the bonus token: the sampler's own token.


def mixed_rows(num_pos: int):
    """Six rows with different parameters (greedy, temperature, top-k, top-p, min-p,
    penalties and a ban) and their logits float32[6, num_pos, V]."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0.0, 1.0, (6, num_pos, V)).astype(np.float32)
    inputs = make_inputs(
        6,
        temperature=[0.0, 1.0, 0.7, 0.9, 1.2, 0.8],
        top_k=[0, 0, 3, 0, 0, 0],
        top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.2, 0.0],
        seeds=[11, 12, 13, 14, 15, 16],
        num_generated=[0, 3, 7, 2, 9, 4],
        banned=[[-1], [-1], [2], [-1], [-1], [1]],
        penalties=penalties_for(6, [1, 2], [[3], [4, 4], [5], [], [6], [7, 3]]),
    )
    return logits, inputs


@pytest.mark.parametrize("k", [0, 2])
def test_no_proposals_sample_the_samplers_token(k):
    logits, inputs = mixed_rows(k + 1)
    out = verify_jit(
        jnp.asarray(logits),
        jnp.zeros((6, k), jnp.int32),
        jnp.zeros(6, jnp.int32),
        inputs,
        num_logprobs=3,
    )
    ref = sample_jit(jnp.asarray(logits[:, 0]), inputs, num_logprobs=3)
    assert np.asarray(out.num_accepted).tolist() == [0] * 6
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, 0], np.asarray(ref.logprobs), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], np.asarray(ref.top_ids))
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs)[:, 0], np.asarray(ref.top_logprobs), rtol=1e-6
    )


def test_bonus_token_is_the_samplers_token_at_its_index():
    """All proposals certain under the target (p = 1): all accepted, and the token after them is
    the sampler's token for index num_generated + k, with the proposals counted as output."""
    k = 2
    logits, inputs = mixed_rows(k + 1)
    proposals = np.array([[4, 6]] * 6, np.int32)
    logits[:, :k] = -100.0
    logits[:, np.arange(k), proposals[0]] = 100.0  # exp(-200) is 0 in float32: p = 1 exactly
    inputs.banned = jnp.full((6, 1), -1, jnp.int32)
    out = verify_jit(jnp.asarray(logits), jnp.asarray(proposals), jnp.full(6, k, jnp.int32), inputs)
    assert np.asarray(out.num_accepted).tolist() == [k] * 6
    history = [[3], [4, 4], [5], [], [6], [7, 3]]
    bonus_inputs = make_inputs(
        6,
        temperature=np.asarray(inputs.temperature),
        top_k=np.asarray(inputs.top_k),
        top_p=np.asarray(inputs.top_p),
        min_p=np.asarray(inputs.min_p),
        seeds=[11, 12, 13, 14, 15, 16],
        num_generated=np.asarray(inputs.num_generated) + k,
        penalties=penalties_for(6, [1, 2], [h + [4, 6] for h in history]),
    )
    ref = sample_jit(jnp.asarray(logits[:, k]), bonus_inputs, num_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, k], np.asarray(ref.tokens))
    assert (np.asarray(out.tokens)[:, :k] == proposals).all()


def test_processed_probs_matches_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(0.0, 1.0, (3, V)).astype(np.float32)
    inputs = make_inputs(3, temperature=[0.0, 0.8, 1.3], top_k=[0, 5, 0])
    probs = np.asarray(processed_probs(jnp.asarray(logits), inputs))
    assert probs[0].tolist() == np.eye(V)[np.argmax(logits[0])].tolist()
    np.testing.assert_allclose(probs[1], np_processed(logits[1], 0.8, 5), atol=1e-6)
    np.testing.assert_allclose(probs[2], np_processed(logits[2], 1.3, V), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Sampling rows: the output follows the target's distribution.

TEMPERATURE, TOP_K = 0.8, 6
TARGET = np.array(
    [
        [1.2, 0.3, 0.9, -0.5, 0.0, 1.6, -2.0, -1.0],
        [0.1, 1.1, -0.3, 0.8, -1.5, 0.4, 1.4, -0.2],
        [-0.6, 0.2, 1.3, 0.0, 0.9, -1.1, 0.5, 1.0],
    ],
    np.float32,
)
# A draft that often disagrees (about half of the first proposals rejected): it puts mass on
# tokens the target's top-k excludes and none on one the target likes.
DRAFT = np.array(
    [
        [1.0, 1.2, 0.1, 0.6, 0.3, 0.9, 1.3, -0.5],
        [0.3, 1.2, 0.7, 0.6, 0.9, -0.9, 1.1, -0.4],
    ],
    np.float32,
)


def target_probs() -> np.ndarray:
    return np.stack([np_processed(row, TEMPERATURE, TOP_K) for row in TARGET])  # [3, V]


def sampling_inputs(num_generated=5) -> SamplingInputs:
    return make_inputs(N, temperature=TEMPERATURE, top_k=TOP_K, num_generated=num_generated)


@functools.cache
def draft_model_run():
    """N rows: proposals drawn by draft_sample from DRAFT, verified against TARGET."""
    inputs = sampling_inputs()
    draft = jnp.broadcast_to(jnp.asarray(DRAFT), (N, 2, V))
    x0, q0 = jax.jit(draft_sample)(draft[:, 0], inputs, 0)
    x1, q1 = jax.jit(draft_sample)(draft[:, 1], inputs, 1)
    out = verify_jit(
        jnp.broadcast_to(jnp.asarray(TARGET), (N, 3, V)),
        jnp.stack([x0, x1], axis=1),
        jnp.full(N, 2, jnp.int32),
        inputs,
        jnp.stack([q0, q1], axis=1),
    )
    return np.asarray(x0), np.asarray(q0[0]), np.asarray(out.tokens), np.asarray(out.num_accepted)


def wrong_first_tokens(x0: np.ndarray, p: np.ndarray, q: np.ndarray, rule: str) -> np.ndarray:
    """First tokens under a wrong rule, with fresh uniforms (numpy)."""
    rng = np.random.default_rng(9)
    accept = rng.random(len(x0)) * q[x0] < p[x0]
    u = rng.random(len(x0))
    if rule == "always_accept":
        return x0
    if rule == "target_not_residual":
        drawn = np.searchsorted(np.cumsum(p), u * p.sum(), side="right")
    elif rule == "unnormalised_residual":
        drawn = np.searchsorted(np.cumsum(np.maximum(p - q, 0.0)), u, side="right")
    else:
        raise AssertionError(rule)
    return np.where(accept, x0, np.minimum(drawn, V - 1))


def test_draft_model_first_token_follows_target():
    x0, q0, tokens, accepted = draft_model_run()
    p = target_probs()
    np.testing.assert_allclose(q0, np_processed(DRAFT[0], TEMPERATURE, TOP_K), atol=1e-6)
    assert chi2_stat(x0, q0) < chi2_bound(q0)  # the draft draws follow q
    assert 0.4 < np.mean(accepted >= 1) < 0.6  # both branches are exercised
    assert chi2_stat(tokens[:, 0], p[0]) < chi2_bound(p[0])
    for rule in ("always_accept", "target_not_residual", "unnormalised_residual"):
        assert chi2_stat(wrong_first_tokens(x0, p[0], q0, rule), p[0]) > 10 * chi2_bound(p[0]), rule


def test_draft_model_later_tokens_follow_target():
    _, _, tokens, accepted = draft_model_run()
    p = target_probs()
    second = tokens[accepted >= 1, 1]  # the token after an accepted first proposal
    bonus = tokens[accepted == 2, 2]  # the token after both proposals
    assert len(second) > 8000 and len(bonus) > 5000
    assert chi2_stat(second, p[1]) < chi2_bound(p[1])
    assert chi2_stat(bonus, p[2]) < chi2_bound(p[2])
    assert (tokens[accepted < 2, 2] == -1).all()


def test_point_mass_proposals_follow_target():
    """n-gram proposals: a likely token (2) for half the rows, a token outside the target's
    top-k (6) for the other half; then 3 as the second proposal."""
    p = target_probs()
    assert p[0, 6] == 0.0 and p[0, 2] > 0.1
    first = np.where(np.arange(N) < N // 2, 2, 6).astype(np.int32)
    proposals = np.stack([first, np.full(N, 3, np.int32)], axis=1)
    out = verify_jit(
        jnp.broadcast_to(jnp.asarray(TARGET), (N, 3, V)),
        jnp.asarray(proposals),
        jnp.full(N, 2, jnp.int32),
        sampling_inputs(),
    )
    tokens, accepted = np.asarray(out.tokens), np.asarray(out.num_accepted)
    likely, unlikely = slice(0, N // 2), slice(N // 2, N)
    assert (accepted[unlikely] == 0).all()  # p(6) = 0: never accepted
    assert np.mean(accepted[likely] >= 1) == pytest.approx(p[0, 2], abs=0.02)
    for rows in (likely, unlikely):
        assert chi2_stat(tokens[rows, 0], p[0]) < chi2_bound(p[0])
    second = tokens[accepted >= 1, 1]
    assert chi2_stat(second, p[1]) < chi2_bound(p[1])
    point = np.eye(V)[2]
    x0 = first[likely]
    for rule in ("always_accept", "target_not_residual"):
        wrong = wrong_first_tokens(x0, p[0], point, rule)
        assert chi2_stat(wrong, p[0]) > 10 * chi2_bound(p[0]), rule


# ---------------------------------------------------------------------------------------------
# Seeds: a row's outputs depend on its own key, token count, logits and proposals only.


def test_seeded_rows_are_batch_independent():
    rng = np.random.default_rng(4)
    k, num = 3, 12
    logits = rng.normal(0.0, 1.0, (num, k + 1, V)).astype(np.float32)
    proposals = rng.integers(0, V, (num, k)).astype(np.int32)
    num_proposed = rng.integers(0, k + 1, num).astype(np.int32)
    draft = jax.nn.softmax(jnp.asarray(rng.normal(0.0, 1.0, (num, k, V)).astype(np.float32)))
    temperature = np.where(np.arange(num) % 4 == 0, 0.0, 0.9).astype(np.float32)
    seeds = [1000 + i for i in range(num)]
    num_generated = rng.integers(0, 50, num)

    top_k = np.where(np.arange(num) % 3 == 0, 4, 0)

    def run(order):
        inputs = make_inputs(
            len(order),
            temperature=temperature[order],
            top_k=top_k[order],
            seeds=[seeds[i] for i in order],
            num_generated=num_generated[order],
        )
        out = verify_jit(
            jnp.asarray(logits[order]),
            jnp.asarray(proposals[order]),
            jnp.asarray(num_proposed[order]),
            inputs,
            draft[np.asarray(order)],
        )
        return np.asarray(out.tokens), np.asarray(out.num_accepted)

    base_tokens, base_accepted = run(list(range(num)))
    order = [7, 3, 3, 11, 0, 5, 9, 1, 10, 2, 8, 6]  # permuted, row 3 twice, row 4 left out
    tokens, accepted = run(order)
    np.testing.assert_array_equal(tokens, base_tokens[order])
    np.testing.assert_array_equal(accepted, base_accepted[order])


def test_draft_sample_stream():
    """Greedy rows propose the argmax; sampled rows follow the processed distribution, on a
    stream independent of the target's draws for the same token index."""
    inputs = sampling_inputs()
    logits = jnp.broadcast_to(jnp.asarray(DRAFT[0]), (N, V))
    tokens, probs = jax.jit(draft_sample)(logits, inputs, 0)
    q = np_processed(DRAFT[0], TEMPERATURE, TOP_K)
    assert chi2_stat(np.asarray(tokens), q) < chi2_bound(q)
    target_tokens = np.asarray(sample_jit(logits, inputs, num_logprobs=0).tokens)
    assert np.mean(np.asarray(tokens) == target_tokens) == pytest.approx((q**2).sum(), abs=0.02)
    greedy = make_inputs(2, seeds=[1, 2])
    tokens, probs = draft_sample(jnp.asarray(DRAFT), greedy, 3)
    assert np.asarray(tokens).tolist() == np.argmax(DRAFT, axis=-1).tolist()
    assert np.asarray(probs).tolist() == np.eye(V)[np.argmax(DRAFT, axis=-1)].tolist()


def test_shape_errors():
    inputs = make_inputs(2)
    with pytest.raises(ValueError, match="proposal_ids"):
        verify(jnp.zeros((2, 3, V)), jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32), inputs)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(
            jnp.zeros((2, 3, V)),
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros(2, jnp.int32),
            inputs,
            jnp.zeros((2, 2, V + 1)),
        )
