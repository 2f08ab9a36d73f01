"""Verification of speculative proposals on device: pure jnp, fixed shapes, jit-friendly.

A row with n proposals x_0..x_{n-1} brings the target's logits at n + 1 positions (position i
is the distribution after the committed tokens and x_0..x_{i-1}). Greedy rows (temperature 0)
accept the longest prefix equal to the target's argmax and add the argmax after it, so they
give exactly the tokens of plain greedy decoding. Sampling rows use the standard rule (Leviathan
et al. 2023; Chen et al. 2023): accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection draw from the normalised residual max(0, p_i - q_i); with all accepted draw a
bonus token from p_n. The output then follows the target's distribution p exactly, for any
draft distribution q (a point mass at x_i for n-gram proposals).

p is the target's processed distribution, built from the sampler's own pieces (banned tokens,
penalties, temperature, top-k, top-p, min-p), with the proposals before each position counted
as output tokens by the penalties. Randomness is the sequence's key folded with the index of
the token being decided (num_generated + i), as in jpaged.sample.sampler: the draw at position i uses
exactly the sampler's uniform for that token (so a row without proposals samples the sampler's
token), and the acceptance test and a draft model's draws use keys folded first with their own
stream constant. A seeded request's tokens thus depend on its own proposals only, never on the
rest of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jpaged.sample.sampler import (
    Penalties,
    SamplingInputs,
    _filter,
    _inverse_cdf,
    apply_penalties,
    greedy_rows,
)

# Streams folded into a sequence's key before the token index; above any token count, so never
# equal to one (the sampler's stream is the key folded with the count alone).
ACCEPT_STREAM = 0x8000_0001
DRAFT_STREAM = 0x8000_0002
_NEG_INF = -jnp.inf


class VerifyOutput(NamedTuple):
    tokens: jax.Array  # int32[S, K+1]: accepted proposals, then the target's token; -1 after
    num_accepted: jax.Array  # int32[S]: proposals accepted; the row emits num_accepted + 1 tokens
    logprobs: jax.Array  # float32[S, K+1]: raw target log-probability of each token; 0 after
    top_ids: jax.Array | None  # int32[S, K+1, num_logprobs]
    top_logprobs: jax.Array | None  # float32[S, K+1, num_logprobs]


def _repeat_rows(x: jax.Array, times: int) -> jax.Array:
    """[S, ...] -> [S * times, ...], each row repeated in place."""
    return jnp.repeat(x, times, axis=0)


def _masked_logits(
    logits: jax.Array,
    inputs: SamplingInputs,
    proposal_ids: jax.Array | None,
    num_banned_positions: jax.Array | None,
) -> jax.Array:
    """Banned tokens and penalties, as jpaged.sample.sampler.sample applies them, at every position.

    logits float32[S, T, V]; proposal_ids int32[S, T-1] (counted as output tokens by the
    penalties from the position after each); num_banned_positions int32[S]: positions
    [0, n) get inputs.banned (None: all). Returns float32[S, T, V].
    """
    num_seqs, num_pos, vocab = logits.shape
    rows = jnp.arange(num_seqs)[:, None]
    banned_idx = jnp.where(inputs.banned >= 0, inputs.banned, vocab)
    ban = jnp.zeros((num_seqs, vocab), bool).at[rows, banned_idx].set(True, mode="drop")
    positions = jnp.arange(num_pos)[None, :]  # [1, T]
    if num_banned_positions is None:
        ban_at = jnp.ones((num_seqs, num_pos), bool)
    else:
        ban_at = positions < num_banned_positions[:, None]  # [S, T]
    logits = jnp.where(ban[:, None, :] & ban_at[:, :, None], _NEG_INF, logits)
    p = inputs.penalties
    if p is None:
        return logits
    if proposal_ids is None:
        proposal_ids = jnp.full((num_seqs, num_pos - 1), -1, jnp.int32)
    # Position t's output tokens: the committed ones, then proposals 0..t-1.
    seen = jnp.arange(num_pos - 1)[None, :] < positions.T  # [T, T-1]
    extra = jnp.where(seen[None], proposal_ids[:, None, :], -1)  # [S, T, T-1]
    base = jnp.broadcast_to(
        p.output_tokens[:, None, :], (num_seqs, num_pos, p.output_tokens.shape[1])
    )
    per_position = Penalties(
        prompt_tokens=_repeat_rows(p.prompt_tokens, num_pos),
        output_tokens=jnp.concatenate([base, extra], axis=-1).reshape(num_seqs * num_pos, -1),
        presence=_repeat_rows(p.presence, num_pos),
        frequency=_repeat_rows(p.frequency, num_pos),
        repetition=_repeat_rows(p.repetition, num_pos),
    )
    flat = apply_penalties(logits.reshape(num_seqs * num_pos, vocab), per_position)
    return flat.reshape(num_seqs, num_pos, vocab)


def _scaled_logits(masked: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """float32[S, T, V] -> temperature, top-k, top-p and min-p applied as the sampler does
    (filtered-out tokens -inf; greedy rows are left at temperature 1)."""
    num_seqs, num_pos, vocab = masked.shape
    greedy = greedy_rows(inputs.temperature)
    scaled = masked / jnp.where(greedy, 1.0, inputs.temperature)[:, None, None]
    needs_filter = jnp.any((inputs.top_k > 0) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0))

    def filtered(x):
        out = _filter(
            x.reshape(num_seqs * num_pos, vocab),
            _repeat_rows(inputs.top_k, num_pos),
            _repeat_rows(inputs.top_p, num_pos),
            _repeat_rows(inputs.min_p, num_pos),
        )
        return out.reshape(num_seqs, num_pos, vocab)

    return jax.lax.cond(needs_filter, filtered, lambda x: x, scaled)


def processed_probs(
    logits: jax.Array, inputs: SamplingInputs, *, num_banned_positions: jax.Array | None = None
) -> jax.Array:
    """The distribution jpaged.sample.sampler.sample draws from, per row.

    logits float32[S, V] or float32[S, T, V] (T positions sharing a row's parameters; no
    proposals are counted by the penalties) -> probabilities of the same shape. Greedy rows
    give a point mass at the argmax.
    """
    squeeze = logits.ndim == 2
    logits3 = logits[:, None, :] if squeeze else logits
    masked = _masked_logits(logits3, inputs, None, num_banned_positions)
    probs = jax.nn.softmax(_scaled_logits(masked, inputs), axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(masked, axis=-1), logits3.shape[-1], dtype=probs.dtype)
    probs = jnp.where(greedy_rows(inputs.temperature)[:, None, None], onehot, probs)
    return probs[:, 0] if squeeze else probs


def _stream_key_data(key_data: jax.Array, stream: int) -> jax.Array:
    """uint32[S, 2]: each sequence's key folded with a stream constant."""

    def one(kd):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), stream)
        return jax.random.key_data(key)

    return jax.vmap(one)(key_data)


def _uniforms(key_data: jax.Array, counts: jax.Array) -> jax.Array:
    """float32[S, T] uniforms in [0, 1): key_data[s] folded with counts[s, t]."""

    def one(kd, n):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), n)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(key_data, counts)


def _num_leading(ok: jax.Array) -> jax.Array:
    """bool[S, K] -> int32[S]: the number of leading True per row."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[s, index[s]] for x [S, T, ...] and index int32[S]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def verify(
    target_logits: jax.Array,
    proposal_ids: jax.Array,
    num_proposed: jax.Array,
    inputs: SamplingInputs,
    draft_probs: jax.Array | None = None,
    *,
    num_banned_positions: jax.Array | None = None,
    num_logprobs: int = 0,
) -> VerifyOutput:
    """Accepts or rejects each row's proposals and samples the token after them.

    Args:
      target_logits: float32[S, K+1, V], the target's raw logits after the row's last committed
        token (position 0) and after each proposal; positions past num_proposed are ignored
        (any finite values, e.g. a copy of the last real one).
      proposal_ids: int32[S, K]; entries past num_proposed are ignored.
      num_proposed: int32[S] in [0, K] (0 for padding rows and rows without proposals).
      inputs: the rows' sampling parameters, as for jpaged.sample.sampler.sample; num_generated is the
        number of tokens the sequence generated before this step (the index of the first token
        this step decides), key_data the sequence's key.
      draft_probs: float32[S, K, V], the distribution each proposal was drawn from (a draft
        model's processed probabilities), or None for point-mass proposals (n-gram).
      num_banned_positions: int32[S], apply inputs.banned at positions [0, n) only (the engine
        passes max(0, min_tokens - num_generated)); None: at every position.
      num_logprobs: how many top raw log-probabilities to return per position (static).

    Returns:
      VerifyOutput: tokens int32[S, K+1] (tokens[s, :num_accepted[s] + 1] are the row's new
      tokens), num_accepted int32[S], logprobs float32[S, K+1] and optionally the top ones.
    """
    num_seqs, num_pos, vocab = target_logits.shape
    k = num_pos - 1
    if proposal_ids.shape != (num_seqs, k):
        raise ValueError(f"proposal_ids must be [{num_seqs}, {k}], got {proposal_ids.shape}")
    if draft_probs is not None and draft_probs.shape != (num_seqs, k, vocab):
        raise ValueError(f"draft_probs must be [{num_seqs}, {k}, {vocab}], got {draft_probs.shape}")
    num_proposed = jnp.clip(num_proposed, 0, k).astype(jnp.int32)
    x = jnp.clip(proposal_ids, 0, vocab - 1).astype(jnp.int32)  # [S, K]
    live = jnp.arange(k)[None, :] < num_proposed[:, None]  # [S, K]
    masked = _masked_logits(target_logits, inputs, x, num_banned_positions)  # [S, K+1, V]
    greedy = greedy_rows(inputs.temperature)
    argmax = jnp.argmax(masked, axis=-1).astype(jnp.int32)  # [S, K+1]
    accepted_greedy = _num_leading(live & (x == argmax[:, :k]))

    def sampling_rows():
        scaled = _scaled_logits(masked, inputs)  # [S, K+1, V]
        lse = jax.scipy.special.logsumexp(scaled[:, :k], axis=-1)  # [S, K]
        p_x = jnp.exp(jnp.take_along_axis(scaled[:, :k], x[..., None], axis=-1)[..., 0] - lse)
        if draft_probs is None:
            q_x = jnp.ones_like(p_x)
        else:
            q_x = jnp.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
        counts = inputs.num_generated[:, None] + jnp.arange(k)[None, :]  # [S, K]
        u = _uniforms(_stream_key_data(inputs.key_data, ACCEPT_STREAM), counts)
        accepted = _num_leading(live & (u * q_x < p_x))  # u < p/q without dividing by q
        scaled_j = _at(scaled, accepted)  # [S, V]: the position decided by a draw
        if k == 0:
            return accepted, _inverse_cdf(scaled_j, inputs.key_data, inputs.num_generated)
        at_proposal = jnp.minimum(accepted, k - 1)
        if draft_probs is None:
            q_j = jax.nn.one_hot(_at(x, at_proposal), vocab, dtype=scaled_j.dtype)
        else:
            q_j = _at(draft_probs, at_proposal)
        residual = jnp.maximum(jax.nn.softmax(scaled_j, axis=-1) - q_j, 0.0)  # [S, V]
        # After a rejection the residual has mass; if rounding leaves none, fall back to p.
        use_residual = (accepted < num_proposed) & (jnp.sum(residual, axis=-1) > 0.0)
        draw_from = jnp.where(use_residual[:, None], jnp.log(residual), scaled_j)
        drawn = _inverse_cdf(draw_from, inputs.key_data, inputs.num_generated + accepted)
        return accepted, drawn

    accepted_sampled, drawn = jax.lax.cond(
        jnp.all(greedy),
        lambda: (jnp.zeros(num_seqs, jnp.int32), jnp.zeros(num_seqs, jnp.int32)),
        sampling_rows,
    )
    num_accepted = jnp.where(greedy, accepted_greedy, accepted_sampled)
    last = jnp.where(greedy, _at(argmax, accepted_greedy), drawn)
    positions = jnp.arange(num_pos)[None, :]
    padded_x = jnp.concatenate([x, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(positions < num_accepted[:, None], padded_x, -1)
    tokens = jnp.where(positions == num_accepted[:, None], last[:, None], tokens)

    lse_raw = jax.scipy.special.logsumexp(target_logits, axis=-1)  # [S, K+1]
    chosen = jnp.take_along_axis(target_logits, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    logprobs = jnp.where(tokens >= 0, chosen - lse_raw, 0.0)
    top_ids = top_lp = None
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(target_logits, axis=-1), num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    return VerifyOutput(tokens, num_accepted, logprobs, top_ids, top_lp)


def draft_sample(
    draft_logits: jax.Array, inputs: SamplingInputs, offset: jax.Array | int
) -> tuple[jax.Array, jax.Array]:
    """A draft model's proposal for the token at index num_generated + offset.

    draft_logits float32[S, V] -> (tokens int32[S], probs float32[S, V]): the draft's processed
    distribution under the row's parameters (a point mass for greedy rows) and one draw from
    it, keyed by the sequence's key on the draft's own stream; pass the probs of every
    proposal to verify as draft_probs.
    """
    probs = processed_probs(draft_logits, inputs)
    scaled = jnp.where(probs > 0.0, jnp.log(probs), _NEG_INF)
    counts = inputs.num_generated + jnp.asarray(offset, jnp.int32)
    tokens = _inverse_cdf(scaled, _stream_key_data(inputs.key_data, DRAFT_STREAM), counts)
    return tokens, probs
