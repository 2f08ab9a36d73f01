"""On-device sampling, per row, inside the step's jit.

Each row carries its own parameters. A row's random stream is its sequence's key folded with
the number of tokens it has generated, so a seeded request samples the same tokens whatever
else shares the batch (and after preemption). Order of processing, as in vLLM:
a grammar's token mask (structured outputs) -> log-probabilities taken here -> logit bias ->
banned tokens (min_tokens) and penalties -> greedy argmax, or temperature -> top-k -> top-p
-> min-p -> one draw by inverse CDF. Log-probabilities are the model's distribution (masked by
the grammar when the request has one).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.sample.logits_processors import apply_logit_bias, apply_token_bitmask
from pallas_kernels import cpu_kernel

MAX_LOGPROBS = 20
_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Penalties:
    prompt_tokens: jax.Array  # int32[S, Hp], -1 padded: tokens seen in the prompt
    output_tokens: jax.Array  # int32[S, Ho], -1 padded: tokens generated so far
    presence: jax.Array  # float32[S]
    frequency: jax.Array  # float32[S]
    repetition: jax.Array  # float32[S]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # float32[S]; 0 = greedy
    top_k: jax.Array  # int32[S]; 0 = no limit
    top_p: jax.Array  # float32[S]
    min_p: jax.Array  # float32[S]
    key_data: jax.Array  # uint32[S, 2]: the sequence's threefry key
    num_generated: jax.Array  # int32[S]: folded into the key
    banned: jax.Array  # int32[S, K], -1 padded: tokens masked out (EOS before min_tokens)
    penalties: Penalties | None = None
    # Structured outputs: int32[S, ceil(V / 32)], bit j of word w allows token 32w + j
    # (llguidance's layout), applied when use_bitmask (bool[]) is set; rows without a
    # constraint are all ones. Log-probabilities see the masked distribution.
    token_bitmask: jax.Array | None = None
    use_bitmask: jax.Array | None = None
    # OpenAI logit_bias: int32[S, B] ids (-1 padded) and float32[S, B] values, added after
    # the log-probabilities are taken (they stay the model's).
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    # Speculative steps: int32[S], the positions (from the first) banned applies to.
    num_banned_positions: jax.Array | None = None


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # int32[S]
    logprobs: jax.Array  # float32[S]: raw log-probability of each sampled token
    top_ids: jax.Array | None  # int32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array | None  # float32[S, MAX_LOGPROBS]
    # Prompt log-probabilities (steps with prompt_logprobs rows): per step token, the
    # log-probability of the next prompt token and the MAX_LOGPROBS most likely tokens.
    prompt_logprobs: jax.Array | None = None  # float32[T]
    prompt_top_ids: jax.Array | None = None  # int32[T, MAX_LOGPROBS]
    prompt_top_logprobs: jax.Array | None = None  # float32[T, MAX_LOGPROBS]
    # Speculative steps (jpaged.sample.rejection_sampler.verify): row i emits spec_tokens[i, :a + 1]
    # with a = num_accepted[i]; top_ids / top_logprobs are then [S, K+1, MAX_LOGPROBS].
    num_accepted: jax.Array | None = None  # int32[S]
    spec_tokens: jax.Array | None = None  # int32[S, K+1]
    spec_logprobs: jax.Array | None = None  # float32[S, K+1]
    # A draft model's step: the distribution each row's proposal was drawn from.
    draft_probs: jax.Array | None = None  # float32[S, V]
    # Steps with embedding rows (jpaged/pooling.py): per row, the sum of its tokens' final
    # hidden states, the first's and the last's.
    pooled: jax.Array | None = None  # float32[S, 3, D]


def seeds_to_key_data(seeds) -> np.ndarray:
    """uint32[N, 2] threefry key data for N seeds (both halves of each seed's low 64 bits)."""
    s = np.array([x & 0xFFFFFFFFFFFFFFFF for x in seeds], np.uint64).reshape(-1, 1)
    return np.concatenate([s >> np.uint64(32), s & np.uint64(0xFFFFFFFF)], axis=1).astype(np.uint32)


def seed_to_key_data(seed: int) -> np.ndarray:
    """uint32[2] threefry key data for one seed (see seeds_to_key_data)."""
    return seeds_to_key_data([seed])[0]


def _counts(tokens: jax.Array, vocab: int) -> jax.Array:
    """int32[S, H] (-1 padded) -> int32[S, V] occurrence counts."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    idx = jnp.where(tokens >= 0, tokens, vocab)
    return jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, idx].add(1, mode="drop")


def apply_penalties(logits: jax.Array, p: Penalties) -> jax.Array:
    """vLLM semantics: repetition over prompt and output tokens; presence and frequency over
    output tokens."""
    vocab = logits.shape[-1]
    out_counts = _counts(p.output_tokens, vocab)
    seen = (_counts(p.prompt_tokens, vocab) + out_counts) > 0
    rep = p.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - p.frequency[:, None] * out_counts
    return logits - p.presence[:, None] * (out_counts > 0)


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array):
    """Masks each row's logits [S, V] outside its top-k, top-p and min-p sets."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    logits = jnp.where(logits < kth, _NEG_INF, logits)
    sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    exclusive = jnp.cumsum(probs, axis=-1) - probs
    keep = exclusive < top_p[:, None]  # always keeps the first
    num_keep = jnp.sum(keep, axis=-1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    logits = jnp.where(logits < pth, _NEG_INF, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    max_prob = jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < min_p[:, None] * max_prob, _NEG_INF, logits)


def _inverse_cdf(scaled: jax.Array, key_data: jax.Array, num_generated: jax.Array):
    """One draw per row from softmax(scaled) [S, V] by inverting its cumulative sum with one
    uniform number per row (a Gumbel-max draw would need V random numbers per row, which
    costs more than the rest of sampling on a CPU). Masked (-inf) tokens have zero-width
    intervals and are never drawn."""
    vocab = scaled.shape[-1]
    cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)  # [S, V]
    total = cdf[:, -1]

    def uniform(kd, n):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), n)
        return jax.random.uniform(key, (), jnp.float32)

    u = jax.vmap(uniform)(key_data, num_generated) * total
    u = jnp.minimum(u, jnp.nextafter(total, 0.0))  # strictly inside the last live interval
    index = jnp.sum(cdf <= u[:, None], axis=-1)  # the first token whose cdf exceeds u
    return jnp.minimum(index, vocab - 1).astype(jnp.int32)


def _argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) of float32[S, V]: the first maximum, or the first NaN if a row
    has one. XLA's CPU argmax is a variadic (value, index) reduction, several times slower
    than this: a max, then one float min over indices (exact below 2**24) where NaNs count
    from -V so that the first of them wins."""
    vocab = x.shape[-1]
    if vocab >= 1 << 24:
        return jnp.argmax(x, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.float32, x.shape, 1)
    at_max = x == jnp.max(x, axis=-1, keepdims=True)
    key = jnp.where(jnp.isnan(x), iota - vocab, jnp.where(at_max, iota, jnp.inf))
    first = jnp.min(key, axis=-1)
    first = jnp.where(first < 0, first + vocab, first)
    return jnp.minimum(first, vocab - 1).astype(jnp.int32)


def _vocab_passes(logits: jax.Array, model_logits: jax.Array) -> tuple[jax.Array, ...]:
    """The passes over the vocabulary an all-greedy step needs: (_argmax(logits), the max of
    each model_logits row, log(sum(exp(model_logits - max)))), each [S]. On the CPU one kernel
    makes them (pallas_kernels/cpu_kernel.py greedy: two passes a row, rows over every core,
    where XLA:CPU runs each reduction on one thread)."""

    def passes():
        x_max = jnp.max(model_logits, axis=-1, initial=-np.inf)
        lse = jnp.log(jnp.sum(jnp.exp(model_logits - x_max[:, None]), axis=-1))
        return _argmax(logits), x_max, lse

    if (jax.default_backend() == "cpu" and logits.dtype == jnp.float32
            and model_logits.dtype == jnp.float32 and cpu_kernel.available()):
        return jax.lax.platform_dependent(
            cpu=lambda: cpu_kernel.greedy(logits, model_logits), default=passes
        )
    return passes()


def _log_softmax_at(logits: jax.Array, tokens: jax.Array, x_max: jax.Array,
                    lse: jax.Array) -> jax.Array:
    """jax.nn.log_softmax(logits)[row, tokens[row]] without the [S, V] result, given each
    row's max and log-sum-exp (_vocab_passes): the same operations (x - max, then minus
    log(sum(exp(x - max)))) on the one entry per row."""
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return (picked - x_max) - lse


def greedy_rows(temperature: jax.Array) -> jax.Array:
    """bool[S]: the greedy rows, which the host gave temperature 0.0 (SamplingParams.greedy,
    sampling_params.is_greedy: the one rule)."""
    return temperature <= 0.0


def sample(logits: jax.Array, inputs: SamplingInputs, *, num_logprobs: int) -> SamplerOutput:
    """logits float32[S, V] -> one token per row (and log-probabilities).

    Cost on a CPU (the vocabulary pass is what matters): an all-greedy step makes no
    temperature, filter or draw pass (they sit in the non-greedy branch of a cond), and the
    full [S, V] log-probabilities are made only when top log-probabilities are asked for.
    """
    vocab = logits.shape[-1]
    if inputs.token_bitmask is not None:
        logits = jax.lax.cond(
            inputs.use_bitmask,
            lambda x: apply_token_bitmask(x, inputs.token_bitmask),
            lambda x: x,
            logits,
        )
    model_logits = logits  # log-probabilities are taken here (masked by the grammar only)
    if inputs.bias_ids is not None:
        logits = apply_logit_bias(logits, inputs.bias_ids, inputs.bias_values)
    rows = jnp.arange(logits.shape[0])
    banned_idx = jnp.where(inputs.banned >= 0, inputs.banned, vocab)
    logits = logits.at[rows[:, None], banned_idx].set(_NEG_INF, mode="drop")
    if inputs.penalties is not None:
        logits = apply_penalties(logits, inputs.penalties)

    greedy = greedy_rows(inputs.temperature)

    def draw(logits):
        scaled = logits / jnp.where(greedy, 1.0, inputs.temperature)[:, None]
        needs_filter = jnp.any((inputs.top_k > 0) | (inputs.top_p < 1.0) | (inputs.min_p > 0.0))
        scaled = jax.lax.cond(
            needs_filter,
            lambda x: _filter(x, inputs.top_k, inputs.top_p, inputs.min_p),
            lambda x: x,
            scaled,
        )
        return _inverse_cdf(scaled, inputs.key_data, inputs.num_generated)

    sampled = jax.lax.cond(
        jnp.all(greedy), lambda x: jnp.zeros(x.shape[0], jnp.int32), draw, logits
    )
    top_ids = top_lp = None
    if num_logprobs > 0:
        tokens = jnp.where(greedy, _argmax(logits), sampled).astype(jnp.int32)
        raw_logprobs = jax.nn.log_softmax(model_logits, axis=-1)
        chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    else:
        argmax, x_max, lse = _vocab_passes(logits, model_logits)
        tokens = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
        chosen = _log_softmax_at(model_logits, tokens, x_max, lse)
    return SamplerOutput(tokens, chosen, top_ids, top_lp)


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
    """logits float32[T, V] of every step token, targets int32[T] (-1: none) -> the target's
    log-probability float32[T] (0 where none) and the top MAX_LOGPROBS ids and values."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return jnp.where(targets >= 0, chosen, 0.0), top_ids.astype(jnp.int32), top_lp
