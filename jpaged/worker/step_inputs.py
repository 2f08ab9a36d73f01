"""Host packing: a StepPlan padded into one of the engine's bucket shapes.

Every step runs a program compiled for a StepKey (token, sequence and page-column buckets,
decode-only or not, logprobs, penalty widths), so the number of programs is bounded and known
(`bucket_keys`). `pack` is a pure function of the plan: numpy in, numpy out, one transfer.

Padding: tokens past the plan's write the null page's slots (slot 0 of page 0); sequence rows
past the plan use the scratch page-table row (max_num_seqs) and context length 0; page-table
updates pad with writes of the null page into the scratch row, copies with page 0 onto itself.
"""

from __future__ import annotations

import bisect
import dataclasses

import jax
import numpy as np

from jpaged.config import EngineConfig
from jpaged.sample.sampler import MAX_LOGPROBS, Penalties, SamplingInputs
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.step_plan import PLACEHOLDER, StepPlan, pow2_width
from models import lora as lora_mod


@dataclasses.dataclass(frozen=True)
class StepKey:
    num_tokens: int
    num_seqs: int
    num_page_cols: int
    decode_only: bool
    num_logprobs: int = 0
    penalty_shape: tuple[int, int] | None = None  # (Hp, Ho)
    bias_width: int = 0  # logit_bias entries per row (0: no row has one)
    prompt_logprobs: bool = False  # log-probabilities of prompt tokens (every token's logits)
    spec_k: int = 0  # speculative decoding: proposals verified per row (0: a plain step)
    spec_draft: bool = False  # the proposals come from a draft model (its probabilities given)
    draft: bool = False  # a draft model's step: sample a proposal and return its distribution
    pooling: bool = False  # embedding rows: their hidden states pooled (jpaged/pooling.py)
    # LoRA on: the distinct adapters the program applies (models/lora.py widths; 0: none,
    # the program does no LoRA work)
    lora_width: int = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # int32[T]
    src_rows: jax.Array  # int32[T]: row of prev_tokens holding the token; -1: token_ids'
    positions: jax.Array  # int32[T]
    # int32[G, T]: page * page_size + offset in each paging group's pages; padding -> null page
    slot_mapping: jax.Array
    table_rows: jax.Array  # int32[S]: page-table row of each sequence; padding -> scratch row
    context_lens: jax.Array  # int32[S]: cached tokens after the step; padding -> 0
    query_start: jax.Array  # int32[S + 1]
    # int32[S]: the token whose hidden state each row samples from; int32[S, K+1] in a
    # speculative step: after the row's last token and after each proposal (repeated past
    # the row's proposals).
    logits_indices: jax.Array
    page_updates: jax.Array  # int32[U, 3]: (row of the whole table, column, page)
    page_copies: jax.Array  # int32[C, 2]: (src, dst)
    sampling: SamplingInputs
    prompt_targets: jax.Array | None = None  # int32[T]: next prompt token, -1 (key.prompt_logprobs)
    proposals: jax.Array | None = None  # int32[S, K] (key.spec_k): the rows' proposals
    num_proposed: jax.Array | None = None  # int32[S] (key.spec_k)
    # float32[S, K, V] (key.spec_draft): the draft's distribution of each proposal; on the
    # device already (jpaged/spec_decode/draft_model.py), set after packing.
    draft_probs: jax.Array | None = None
    draft_offset: jax.Array | None = None  # int32[] (key.draft): the proposal's index
    lora_slots: jax.Array | None = None  # int32[S]: each row's adapter slot, -1: none (LoRA on)
    lora_ids: jax.Array | None = None  # int32[key.lora_width]: the step's slots (lora.step_ids)


def holds(program: StepKey, key: StepKey) -> bool:
    """Whether the program compiled for `program` can run a step of `key`, padded further:
    as many tokens, rows and page columns or more, every feature key asks for (logprobs,
    penalties as wide, logit_bias as wide, prompt logprobs; pack fills the extra ones with
    neutral values and nothing reads their results), a ragged program for a decode-only key
    (not the reverse), and the same speculative kind."""
    kinds = ("spec_k", "spec_draft", "draft")
    if any(getattr(program, f) != getattr(key, f) for f in kinds):
        return False
    if program.decode_only and not key.decode_only:
        return False
    sizes = ("num_tokens", "num_seqs", "num_page_cols", "num_logprobs", "bias_width", "lora_width")
    if any(getattr(program, f) < getattr(key, f) for f in sizes):
        return False
    if any(getattr(key, f) and not getattr(program, f) for f in ("prompt_logprobs", "pooling")):
        return False
    if key.penalty_shape is None:
        return True
    return program.penalty_shape is not None and all(
        p >= k for p, k in zip(program.penalty_shape, key.penalty_shape, strict=True)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demand:
    """The most one sequence (or a request not yet queued) can ask of a step, for the check
    at Linux's mapping cap that the steps it joins have a compiled program (needs_key)."""

    params: SamplingParams
    num_prompt_tokens: int
    num_new_tokens: int  # the tokens its next step may compute (what is left of its prompt, or 1)
    context_len: int  # the most tokens it holds: prompt + max_tokens, at most max_model_len
    num_rows: int = 1  # page-table rows: n for a parent still to fork
    in_prompt: bool = True  # prompt tokens left to compute (prompt logprobs are computed then)
    pooling: bool = False  # an embedding request (its prompt's hidden states are pooled)


def needs_key(demands: list[Demand], config: EngineConfig) -> StepKey:
    """A ragged StepKey no smaller than any step the demands' sequences run together (so a
    compiled program that holds it runs each of them): their tokens (at most the step
    budget), rows, widest context, and the features any asks for at their widest."""
    page_size, budget = config.cache.page_size, config.scheduler.max_num_batched_tokens
    rows = sum(d.num_rows for d in demands)
    tokens = max(min(sum(d.num_new_tokens for d in demands), budget), rows)
    cols = -(-max(d.context_len for d in demands) // page_size)
    penalized = [d for d in demands if d.params.uses_penalties]
    penalty_shape = None
    if penalized:
        penalty_shape = (
            pow2_width(max(d.num_prompt_tokens for d in penalized)),
            pow2_width(max(d.context_len - d.num_prompt_tokens for d in penalized)),
        )
    biases = [len(d.params.logit_bias) for d in demands if d.params.logit_bias]
    return StepKey(
        tokens,
        rows,
        cols,
        False,
        num_logprobs=MAX_LOGPROBS if any(d.params.logprobs is not None for d in demands) else 0,
        penalty_shape=penalty_shape,
        bias_width=pow2_width(max(biases)) if biases else 0,
        prompt_logprobs=any(d.in_prompt and d.params.prompt_logprobs is not None for d in demands),
        pooling=any(d.in_prompt and d.pooling for d in demands),
    )


def bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def step_key(plan: StepPlan, config: EngineConfig) -> StepKey:
    """The bucket key a plan runs under."""
    num_seqs = bucket(config.seq_buckets, len(plan))
    cols = bucket(config.page_buckets, max(plan.max_pages, 1))
    sampling = plan.sampling
    num_logprobs = MAX_LOGPROBS if plan.wants_logprobs else 0
    penalty_shape = None
    if sampling.penalties is not None:
        penalty_shape = (
            sampling.penalties.prompt_tokens.shape[1],
            sampling.penalties.output_tokens.shape[1],
        )
    extra = {
        "num_logprobs": num_logprobs,
        "penalty_shape": penalty_shape,
        "bias_width": 0 if sampling.bias_ids is None else sampling.bias_ids.shape[1],
        "prompt_logprobs": plan.prompt_targets is not None,
        "pooling": plan.pools,
        "spec_k": config.num_speculative_tokens if plan.proposals is not None else 0,
        "spec_draft": plan.proposals is not None and config.speculative.method == "draft_model",
    }
    if plan.decode_only and config.decode_programs:
        return StepKey(num_seqs, num_seqs, cols, True, **extra)
    if config.scheduler.one_row_bucket and len(plan) == 1 == plan.num_tokens:
        return StepKey(1, 1, cols, False, **extra)  # a lone decode (SchedulerConfig)
    # At least a token per row (forks of an n > 1 request have none; max_num_seqs <=
    # max_num_batched_tokens), so num_tokens >= num_seqs' lower neighbour and the ragged
    # shapes are the ones bucket_keys lists.
    n = max(plan.num_tokens, len(plan), 1)
    num_tokens = bucket(config.token_buckets, n)
    if extra["spec_k"]:
        num_tokens = _verify_tokens(config, num_seqs, n, num_tokens)
    return StepKey(num_tokens, num_seqs, cols, False, **extra)


def _verify_tokens(config: EngineConfig, num_seqs: int, n: int, bucketed: int) -> int:
    """Tokens of a step that verifies proposals, num_seqs rows (a sequence bucket) and n
    tokens: num_seqs * (k + 1) when that holds n and is below the token bucket (every row
    verifying k proposals fills it exactly: 8 rows and k = 4 run 40 tokens, not 64, and
    the step's matmuls are 40 rows), else the token bucket."""
    exact = num_seqs * (config.num_speculative_tokens + 1)
    return exact if n <= exact < bucketed else bucketed


def _full_verification_tokens(config: EngineConfig, num_seqs: int) -> int:
    """step_key's tokens for num_seqs rows (a sequence bucket) each verifying k proposals
    (as many as the step budget holds)."""
    n = min(num_seqs * (config.num_speculative_tokens + 1), config.scheduler.max_num_batched_tokens)
    return _verify_tokens(config, num_seqs, n, bucket(config.token_buckets, n))


def _page_buckets_up_to(config: EngineConfig, context_len: int) -> tuple[int, ...]:
    """The page-column buckets of sequences of up to context_len tokens."""
    context_len = max(1, min(context_len, config.scheduler.max_model_len))
    cols = bucket(config.page_buckets, -(-context_len // config.cache.page_size))
    return tuple(p for p in config.page_buckets if p <= cols)


def _ragged_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """(tokens, sequences) buckets of the ragged steps step_key produces: a step of s rows
    (more than the sequence bucket below s) has at least as many tokens."""
    shapes = []
    below = 0  # the sequence bucket below s
    for s in config.seq_buckets:
        fewest = bucket(config.token_buckets, below + 1)
        shapes += [(t, s) for t in config.token_buckets if t >= fewest]
        below = s
    return shapes


def _decode_shapes(config: EngineConfig) -> list[tuple[int, int]]:
    """(tokens, sequences) buckets of decode steps without decode programs: r rows (one token
    each) in sequence bucket s, for every r that bucket takes."""
    shapes, below = [], 0
    for s in config.seq_buckets:
        shapes += [(bucket(config.token_buckets, r), s) for r in range(below + 1, s + 1)]
        below = s
    return list(dict.fromkeys(shapes))


def bucket_keys(config: EngineConfig, max_len: int | None = None) -> list[StepKey]:
    """Every step shape the scheduler can produce (without logprobs, penalties, logit bias
    or prompt logprobs): decode steps, ragged steps, and with speculative decoding the
    ragged steps that verify proposals. max_len: only the shapes of sequences of up to
    max_len tokens (page-column buckets up to its own)."""
    c = config
    pages = c.page_buckets if max_len is None else _page_buckets_up_to(c, max_len)
    keys = [StepKey(s, s, p, True) for s in c.seq_buckets for p in pages if c.decode_programs]
    keys += [StepKey(1, 1, p, False) for p in pages if c.scheduler.one_row_bucket]
    spec = c.speculative
    drafted = spec is not None and spec.method == "draft_model"
    for spec_k in sorted({0, c.num_speculative_tokens}):
        keys += [
            StepKey(t, s, p, False, spec_k=spec_k, spec_draft=drafted and spec_k > 0)
            for t, s in _ragged_shapes(c)
            for p in pages
        ]
    k = c.num_speculative_tokens
    if k > 0:  # every row verifying k proposals, when that is not a token bucket
        for s in c.seq_buckets:
            t = _full_verification_tokens(c, s)
            if t not in c.token_buckets:
                keys += [StepKey(t, s, p, False, spec_k=k, spec_draft=drafted) for p in pages]
    return keys


def warm_up_keys(config: EngineConfig, context_len: int) -> list[StepKey]:
    """The step shapes short requests meet first: one request's prompt of up to context_len
    tokens (every token bucket up to its own, the smallest sequence bucket), and decode steps
    of every sequence bucket (their own programs, or without decode programs the ragged
    shapes decode steps pad to), each at every page-column bucket up to context_len's. With
    speculative decoding, the ragged steps that verify proposals too. A subset of
    bucket_keys(config)."""
    c = config
    context_len = max(1, min(context_len, c.scheduler.max_model_len))
    tokens = bucket(c.token_buckets, min(context_len, c.scheduler.max_num_batched_tokens))
    pages = _page_buckets_up_to(c, context_len)
    if c.decode_programs:
        keys = [StepKey(s, s, p, True) for s in c.seq_buckets for p in pages]
    else:  # a decode step of r rows runs the ragged program (bucket(r) tokens, bucket(r) rows)
        keys = [StepKey(t, s, p, False) for t, s in _decode_shapes(c) for p in pages]
    keys += [StepKey(1, 1, p, False) for p in pages if c.scheduler.one_row_bucket]
    spec = c.speculative
    drafted = spec is not None and spec.method == "draft_model"
    keys += [
        StepKey(t, c.seq_buckets[0], p, False)
        for t in c.token_buckets
        if t <= tokens
        for p in pages
    ]
    keys = list(dict.fromkeys(keys))
    k = c.num_speculative_tokens
    if k > 0:  # decoding rows verify k proposals each: s * (k + 1) tokens; one row 1..k + 1
        one_row = {_verify_tokens(c, c.seq_buckets[0], n, bucket(c.token_buckets, n))
                   for n in range(1, k + 2)}  # below s * (k + 1) where buckets are (CPU: 4)
        verify = [(_full_verification_tokens(c, s), s) for s in c.seq_buckets]
        verify += [(t, c.seq_buckets[0]) for t in sorted(one_row)]
        keys += [
            StepKey(t, s, p, False, spec_k=k, spec_draft=drafted)
            for t, s in dict.fromkeys(verify)
            for p in pages
        ]
    return keys


def update_capacity(key: StepKey, page_size: int, num_groups: int = 1) -> int:
    """Page-table updates a step of this key carries (more go through the prelude first)."""
    n = num_groups * (2 * key.num_seqs + key.num_tokens // page_size)
    return max(16, 1 << (n - 1).bit_length())


def pad_rows(rows: np.ndarray, n: int, fill: tuple[int, ...]) -> np.ndarray:
    """int32[k, w] rows (k <= n) padded with `fill` rows to int32[n, w]."""
    out = np.empty((n, len(fill)), np.int32)
    out[:] = fill
    out[: len(rows)] = rows
    return out


def previous_rows(plan: StepPlan | None) -> dict[int, int]:
    """seq_id -> row of plan, for the rows whose sample the sequence appends."""
    if plan is None:
        return {}
    rows = np.flatnonzero(plan.keep_sample)
    return dict(zip(plan.seq_ids[rows].tolist(), rows.tolist(), strict=True))


def pack(
    plan: StepPlan,
    key: StepKey,
    *,
    scratch_row: int,
    page_size: int,
    mask_words: int,
    prev_plan: StepPlan | None = None,
    token_bitmask: np.ndarray | None = None,
    num_groups: int = 1,
    lora: int = 0,
) -> StepInputs:
    """The plan padded to key's shapes.

    Args:
      plan: its page updates and copies must fit the key (update_capacity, num_seqs).
      key: step_key(plan) or a larger key.
      scratch_row: the page-table row padding rows point at (max_num_seqs).
      page_size: tokens per page.
      mask_words: ceil(vocab_size / 32), the width of the structured-output bitmask.
      prev_plan: the plan of the step still on the device, whose samples are this plan's
        PLACEHOLDER tokens.
      token_bitmask: int32[len(plan), mask_words] of the constrained rows (others all ones),
        or None when no row is constrained.
      num_groups: paging groups (models/kv_groups.py): rows of slot_mapping.
      lora: max_loras when the programs take each row's adapter slot (padding rows: -1)
        and the step's slots (key.lora_width of them); 0: LoRA off.
    """
    t_pad, s_pad = key.num_tokens, key.num_seqs
    t, s = plan.num_tokens, len(plan)
    token_ids = np.zeros(t_pad, np.int32)
    src_rows = np.full(t_pad, -1, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.zeros((num_groups, t_pad), np.int32)
    token_ids[:t] = plan.token_ids
    pending = np.flatnonzero(plan.token_ids == PLACEHOLDER)
    if len(pending):
        token_ids[pending] = 0
        rows = np.searchsorted(plan.query_start[1:], pending, side="right")
        prev = previous_rows(prev_plan)
        src_rows[pending] = [prev[int(sid)] for sid in plan.seq_ids[rows]]
    positions[:t] = plan.positions
    if t:
        slot_mapping[:, :t] = plan.slot_mapping
    table_rows = np.full(s_pad, scratch_row, np.int32)
    table_rows[:s] = plan.table_rows
    context_lens = np.zeros(s_pad, np.int32)
    context_lens[:s] = plan.context_lens
    query_start = np.full(s_pad + 1, t, np.int32)
    query_start[: s + 1] = plan.query_start
    last = np.maximum(plan.query_start[plan.sample_rows + 1] - 1, 0)  # [S]
    proposals = num_proposed = None
    if key.spec_k:
        k = key.spec_k
        n = plan.num_proposed if plan.num_proposed is not None else np.zeros(s, np.int32)
        logits_indices = np.zeros((s_pad, k + 1), np.int32)
        logits_indices[:s] = _verify_indices(last, n, k)
        proposals = np.full((s_pad, k), -1, np.int32)
        num_proposed = np.zeros(s_pad, np.int32)
        if plan.proposals is not None:
            proposals[:s, : plan.proposals.shape[1]] = plan.proposals
            num_proposed[:s] = plan.num_proposed
    else:
        logits_indices = np.zeros(s_pad, np.int32)
        logits_indices[:s] = last
    return StepInputs(
        token_ids=token_ids,
        src_rows=src_rows,
        positions=positions,
        slot_mapping=slot_mapping,
        table_rows=table_rows,
        context_lens=context_lens,
        query_start=query_start,
        logits_indices=logits_indices,
        page_updates=pad_rows(
            plan.page_updates, update_capacity(key, page_size, num_groups), (scratch_row, 0, 0)
        ),
        page_copies=pad_rows(plan.page_copies, key.num_seqs, (0, 0)),
        sampling=_pack_sampling(plan, key, mask_words, token_bitmask),
        prompt_targets=_prompt_targets(plan, key),
        proposals=proposals,
        num_proposed=num_proposed,
        lora_slots=_lora_slots(plan, s_pad) if lora else None,
        lora_ids=_lora_ids(plan, key, lora) if lora else None,
    )


def _lora_slots(plan: StepPlan, s_pad: int) -> np.ndarray:
    if plan.lora_slots is None:
        return np.full(s_pad, -1, np.int32)
    return _padded(plan.lora_slots.astype(np.int32), s_pad, -1)


def _lora_ids(plan: StepPlan, key: StepKey, max_loras: int) -> np.ndarray:
    return lora_mod.step_ids(_lora_slots(plan, key.num_seqs), key.lora_width, max_loras)


def lora_width(plan: StepPlan, max_loras: int) -> int:
    """The LoRA width of a plan's step: its distinct adapters, bucketed (models/lora.py)."""
    if plan.lora_slots is None:
        return 0
    used = len(np.unique(plan.lora_slots[plan.lora_slots >= 0]))
    return lora_mod.width_for(used, max_loras)


def with_lora_widths(keys: list[StepKey], max_loras: int) -> list[StepKey]:
    """keys at every LoRA width (models/lora.py widths): the programs LoRA steps can need."""
    widths = lora_mod.widths(max_loras)
    return [dataclasses.replace(k, lora_width=w) for k in keys for w in widths]


def _prompt_targets(plan: StepPlan, key: StepKey) -> np.ndarray | None:
    """int32[T] of a prompt-logprobs key: the plan's targets, -1 past them (all -1 for a
    plan without prompt logprobs run on such a program at the mapping cap)."""
    if not key.prompt_logprobs:
        return None
    if plan.prompt_targets is None:
        return np.full(key.num_tokens, -1, np.int32)
    return _padded(plan.prompt_targets, key.num_tokens, -1)


def _verify_indices(last: np.ndarray, num_proposed: np.ndarray, k: int) -> np.ndarray:
    """int32[S, k + 1]: the tokens whose hidden states a verifying row samples from, after
    its last token and after each of its num_proposed proposals (the last one repeated past
    them); last int32[S] is each row's last token."""
    return (last - num_proposed)[:, None] + np.minimum(
        np.arange(k + 1)[None, :], num_proposed[:, None]
    )


WARM_UP_RUNS = 3  # warm_up_inputs per key


def warm_up_inputs(
    padded: StepInputs, key: StepKey, page_size: int, run: int, *, max_context: int | None = None
) -> StepInputs:
    """Makes padded (pack of an empty plan at key's shapes, fresh arrays) into warm-up run
    `run` (0 to WARM_UP_RUNS - 1) of key, in place: rows that look like requests' and change
    nothing a request reads. Returns padded.

    Every row's context fills the key's page columns (at most max_context tokens, rounded up
    to whole pages, when given), through the scratch page-table row
    (every entry the null page: padding only ever writes page 0 there), and every token
    writes the null page's slot 0, as padding tokens do. So each attention loop runs its
    full length and each branch of the program runs in one of the runs:

        run 0: a ragged key's tokens in one sequence, greedy
        run 1: in two sequences, sampled at temperature 1
        run 2: spread over every row, sampled with top-p 0.9 through the grammar mask (all
               ones); a speculative key's rows each verify as many proposals as they can
        (a decode key: one token per row in every run, with run's sampling)

    What it is for: on XLA:CPU a program's first run leaves about 1 MiB on XLA's intra-op
    threads, and the loop bodies and branches padding skips are most of it (docs/serving.md,
    issue 16.12). The sampled tokens are no request's: the caller resets prev_tokens after.
    """
    if not 0 <= run < WARM_UP_RUNS:
        raise ValueError(f"warm-up run must be in [0, {WARM_UP_RUNS}), got {run}")
    x = padded
    t_pad, s_pad = key.num_tokens, key.num_seqs
    context = key.num_page_cols * page_size
    if max_context is not None:
        context = min(context, max(1, -(-max_context // page_size)) * page_size)
    if key.decode_only:
        rows = s_pad
    else:
        rows = min((1, 2, s_pad)[run], s_pad, t_pad)
    spread = np.linspace(0, t_pad, rows + 1).astype(np.int32)
    counts = np.minimum(np.diff(spread), context)  # [rows]: a row's tokens fit its context
    x.query_start[: rows + 1] = np.concatenate([[0], np.cumsum(counts)])
    x.query_start[rows + 1 :] = x.query_start[rows]
    x.context_lens[:rows] = context
    last = x.query_start[1 : rows + 1] - 1  # [rows]: each row's last token
    for i, n in enumerate(counts):
        x.positions[x.query_start[i] : x.query_start[i + 1]] = np.arange(context - n, context)
    if key.spec_k:
        proposed = np.minimum(counts - 1, key.spec_k) if run == 2 else np.zeros_like(counts)
        x.num_proposed[:rows] = proposed
        x.proposals[:rows] = np.where(np.arange(key.spec_k) < proposed[:, None], 1, -1)
        x.logits_indices[:rows] = _verify_indices(last, proposed, key.spec_k)
    else:
        x.logits_indices[:rows] = last
    sampling = x.sampling
    if run >= 1:
        sampling.temperature[:rows] = 1.0
    if run == 2:
        sampling.top_p[:rows] = 0.9
        sampling.use_bitmask = np.bool_(True)
    return x


def all_allowed(num_rows: int, mask_words: int) -> np.ndarray:
    """A read-only all-ones bitmask int32[num_rows, mask_words] (made once per shape)."""
    out = _ALL_ALLOWED.get((num_rows, mask_words))
    if out is None:
        out = np.full((num_rows, mask_words), -1, np.int32)
        out.flags.writeable = False
        _ALL_ALLOWED[(num_rows, mask_words)] = out
    return out


_ALL_ALLOWED: dict[tuple[int, int], np.ndarray] = {}


def _padded(values: np.ndarray, n: int, fill) -> np.ndarray:
    out = np.full((n, *values.shape[1:]), fill, values.dtype)
    out[: len(values)] = values
    return out


def _pack_sampling(
    plan: StepPlan, key: StepKey, mask_words: int, token_bitmask: np.ndarray | None
) -> SamplingInputs:
    s_pad, r = key.num_seqs, plan.sampling
    if token_bitmask is None:
        bitmask = all_allowed(s_pad, mask_words)
    else:
        bitmask = _padded(token_bitmask.astype(np.int32, copy=False), s_pad, -1)
    bias_ids = bias_values = None
    if key.bias_width:
        bias_ids = np.full((s_pad, key.bias_width), -1, np.int32)
        bias_values = np.zeros((s_pad, key.bias_width), np.float32)
        if r.bias_ids is not None:
            bias_ids[: len(plan), : r.bias_ids.shape[1]] = r.bias_ids
            bias_values[: len(plan), : r.bias_values.shape[1]] = r.bias_values
    penalties = None
    if key.penalty_shape is not None:
        hp, ho = key.penalty_shape
        penalties = Penalties(
            np.full((s_pad, hp), -1, np.int32),
            np.full((s_pad, ho), -1, np.int32),
            np.zeros(s_pad, np.float32),
            np.zeros(s_pad, np.float32),
            np.ones(s_pad, np.float32),
        )
        p = r.penalties
        if p is not None:
            penalties.prompt_tokens[: len(plan), : p.prompt_tokens.shape[1]] = p.prompt_tokens
            penalties.output_tokens[: len(plan), : p.output_tokens.shape[1]] = p.output_tokens
            penalties.presence[: len(plan)] = p.presence
            penalties.frequency[: len(plan)] = p.frequency
            penalties.repetition[: len(plan)] = p.repetition
    padded = {  # each row field padded to the bucket's rows with the value a padding row has
        name: _padded(getattr(r, name), s_pad, fill) for name, fill in _ROW_FILLS.items()
    }
    return dataclasses.replace(
        r,
        **padded,
        penalties=penalties,
        token_bitmask=bitmask,
        use_bitmask=np.bool_(token_bitmask is not None),
        bias_ids=bias_ids,
        bias_values=bias_values,
        num_banned_positions=_padded(r.num_banned_positions, s_pad, 0) if key.spec_k else None,
    )


# SamplingInputs' per-row fields and the value a padding row holds (greedy, no limits).
_ROW_FILLS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "key_data": 0,
              "num_generated": 0, "banned": -1}  # fmt: skip
