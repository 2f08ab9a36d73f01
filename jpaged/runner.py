"""Model runner: the only code that moves data between host and device.

It owns the device state (the per-layer K/V page pools and the device page table), turns a
StepPlan into padded StepInputs (numpy, bucketed shapes), and runs the jitted step:

    step(params, state, inputs, prev_tokens) -> (SamplerOutput, tokens, state)   # state donated

prev_tokens (int32[max_num_seqs]) are the previous step's sampled tokens, still on the device:
with async scheduling a decode token that the host does not know yet is read from them
(inputs.src_rows), so step N+1 is dispatched before step N's tokens reach the host
(`dispatch`, then `fetch`). `tokens` is this step's sampled tokens padded to max_num_seqs, the
next step's prev_tokens.

Inside the step: page-table updates (.at[].set), copy-on-write page copies, the model over
the ragged batch (writing each token's K/V into its slot), logits for one row per sequence,
and sampling. Programs are compiled ahead of time per bucket key and counted.

Under a mesh (tensor parallelism, models/sharding.py) the same step body runs inside one
shard_map over the replica's devices: params and pools arrive as shards (pools split over KV
heads), step inputs and the page table are replicated, the logits are all-gathered and every
device samples the same tokens. The step is still one jit, with explicit in/out shardings and
the state donated. Across processes (jax.distributed), process 0 broadcasts each device call's
inputs (StepBroadcast) and the other processes replay them in `follow`.

Swap (preemption_mode="swap"): the runner holds the host swap space, numpy
[num_layers, 2 (K, V), num_kv_heads, num_swap_pages + 1, page_size, head_dim] (host page 0 is
unused, like the null page). A plan's swap-outs gather their device pages in one jitted call
per _SWAP_PAGES (padded with the null page) and device_get them; its swap-ins write host pages
back with a jitted scatter, pool donated. Both run before the step (`swap`). Under a mesh the
gathered pages are sharded over KV heads and device_get assembles the full heads.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.config import EngineConfig
from jpaged.sampler import (
    MAX_LOGPROBS,
    Penalties,
    SamplerOutput,
    SamplingInputs,
    sample,
    seeds_to_key_data,
)
from jpaged.scheduler import StepPlan
from models import sharding
from models.config import ModelConfig
from models.llama import compute_logits, forward

logger = logging.getLogger(__name__)

_PRELUDE_UPDATES = 256  # page-table updates per prelude call (overflow of a step's share)
_PRELUDE_COPIES = 64
_MAX_BANNED = 8
_SWAP_PAGES = 32  # pages per swap call: one compiled gather and one scatter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    kv_caches: list  # per layer (k_pages, v_pages): [num_kv_heads, num_pages, page_size, head_dim]
    page_table: jax.Array  # int32[max_num_seqs + 1, max_pages_per_seq]; last row is scratch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # int32[T]
    src_rows: jax.Array  # int32[T]: row of prev_tokens holding the token; -1: token_ids'
    positions: jax.Array  # int32[T]
    slot_mapping: jax.Array  # int32[T]: page * page_size + offset; padding -> null page
    slot_ids: jax.Array  # int32[S]: page-table row of each sequence; padding -> scratch row
    context_lens: jax.Array  # int32[S]: cached tokens after the step; padding -> 0
    query_start: jax.Array  # int32[S + 1]
    logits_indices: jax.Array  # int32[S]: token whose hidden state each row samples from
    page_updates: jax.Array  # int32[U, 3]: (row, column, page)
    page_copies: jax.Array  # int32[C, 2]: (src, dst)
    sampling: SamplingInputs


@dataclasses.dataclass(eq=False)
class InFlightStep:
    """A dispatched step whose sampled tokens have not been fetched (`ModelRunner.fetch`)."""

    key: StepKey
    out: SamplerOutput  # device arrays
    num_rows: int
    num_context_tokens: int
    dispatch_time: float
    # Timing for step_log: the last time the host saw the step still running, and the time
    # its results were on the host (an estimate of when the device finished it).
    busy_time: float = 0.0
    done_time: float | None = None


@dataclasses.dataclass(frozen=True)
class StepKey:
    num_tokens: int
    num_seqs: int
    num_page_cols: int
    decode_only: bool
    num_logprobs: int = 0
    penalty_shape: tuple[int, int] | None = None  # (Hp, Ho)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _copy_pages(kv_caches, copies):
    src, dst = copies[:, 0], copies[:, 1]
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv_caches]


def _apply_updates(page_table, updates):
    return page_table.at[updates[:, 0], updates[:, 1]].set(updates[:, 2])


def _prelude(state: DeviceState, updates, copies) -> DeviceState:
    return DeviceState(
        _copy_pages(state.kv_caches, copies), _apply_updates(state.page_table, updates)
    )


def _gather_pages(state: DeviceState, ids):
    """-> [num_layers, 2, num_kv_heads, len(ids), page_size, head_dim]"""
    return jnp.stack([jnp.stack([k[:, ids], v[:, ids]]) for k, v in state.kv_caches])


def _scatter_pages(state: DeviceState, ids, pages) -> DeviceState:
    """Writes pages ([num_layers, 2, H, len(ids), page_size, head_dim]) into the pool at ids."""
    kv = [
        (k.at[:, ids].set(pages[i, 0]), v.at[:, ids].set(pages[i, 1]))
        for i, (k, v) in enumerate(state.kv_caches)
    ]
    return DeviceState(kv, state.page_table)


def _step(
    params,
    state: DeviceState,
    inputs: StepInputs,
    prev_tokens,
    *,
    cfg,
    key: StepKey,
    backend,
    tp_axis=None,
):
    src = inputs.src_rows
    token_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], inputs.token_ids)
    page_table = _apply_updates(state.page_table, inputs.page_updates)
    kv_caches = _copy_pages(state.kv_caches, inputs.page_copies)
    table = page_table[inputs.slot_ids, : key.num_page_cols]  # [S, P]
    hidden, kv_caches = forward(
        params,
        cfg,
        kv_caches,
        token_ids,
        inputs.positions,
        inputs.slot_mapping,
        inputs.context_lens,
        table,
        inputs.query_start,
        decode_only=key.decode_only,
        attention_backend=backend,
        tp_axis=tp_axis,
    )
    logits = compute_logits(params, cfg, hidden[inputs.logits_indices], tp_axis)
    out = sample(logits, inputs.sampling, num_logprobs=key.num_logprobs)
    tokens = jnp.zeros(prev_tokens.shape, jnp.int32).at[: key.num_seqs].set(out.tokens)
    return out, tokens, DeviceState(kv_caches, page_table)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params,
        num_pages: int,
        dtype,
        *,
        mesh=None,
        num_swap_pages: int = 0,
    ) -> None:
        """mesh: the replica's Mesh (models/sharding.py) params are sharded over, or None.
        num_swap_pages: host pages of swap space (0: no swap)."""
        self.config = config
        self.cfg = model_config
        self.params = params
        self.num_pages = num_pages
        self.page_size = config.cache.page_size
        self.scratch_row = config.scheduler.max_num_seqs
        self.mesh = mesh
        self.broadcast = None
        if mesh is not None and jax.process_count() > 1:
            from jpaged.multihost import StepBroadcast

            self.broadcast = StepBroadcast(self)
        if num_swap_pages and self.broadcast is not None:
            raise ValueError('preemption_mode="swap" is not supported across processes')
        shape = (model_config.num_kv_heads, num_pages, self.page_size, model_config.head_dim)
        table_shape = (config.scheduler.max_num_seqs + 1, config.max_pages_per_seq)

        def zeros():
            return DeviceState(
                kv_caches=[
                    (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                    for _ in range(model_config.num_layers)
                ],
                page_table=jnp.zeros(table_shape, jnp.int32),
            )

        if mesh is None:
            self.state = zeros()
        else:  # made in place on every device: each holds only its KV heads
            self._state_specs = DeviceState(
                kv_caches=[(sharding.POOL_SPEC,) * 2] * model_config.num_layers,
                page_table=P(),
            )
            self._param_specs = sharding.param_specs(model_config, sharding.tp_size(mesh))
            self.state = jax.jit(zeros, out_shardings=self._named(self._state_specs))()
        self._compiled: dict[StepKey, object] = {}
        # The latest step's sampled tokens, padded to max_num_seqs: the next step's prev_tokens.
        num = config.scheduler.max_num_seqs
        if mesh is None:
            self.last_tokens = jnp.zeros(num, jnp.int32)
        else:
            self.last_tokens = jax.jit(
                lambda: jnp.zeros(num, jnp.int32), out_shardings=NamedSharding(mesh, P())
            )()
        self._latest: InFlightStep | None = None  # the step dispatched last (step_log timing)
        self._last_done_time = 0.0  # when the step fetched last finished (step_log timing)
        self._prelude_fn = None
        self.swap_space = None
        if num_swap_pages:  # zeros: the OS maps host pages on first write
            self.swap_space = np.zeros(
                (model_config.num_layers, 2, shape[0], num_swap_pages + 1, *shape[2:]),
                np.dtype(dtype),
            )
        self._swap_fns = None
        self.compile_seconds = 0.0
        self.warmed_up = False
        self.num_recompiles = 0  # step programs compiled after warm-up (each also logs a warning)
        # Per-step timings, collected only when a caller (a benchmark) sets this to a list:
        # (key, num_rows, num_context_tokens, device seconds). Device seconds run from when the
        # step could start (dispatched, and the step before it finished) to when it finished,
        # as the host sees them: synchronous steps, dispatch to sampled ids on the host; steps
        # overlapped with host work, from the previous step's finish when the host had to wait
        # for it, else from the last time the host saw it running (a lower bound, so the time
        # left for the host is an upper bound on the host time not hidden by the device).
        self.step_log: list[tuple[StepKey, int, int, float]] | None = None

    # -- compilation -----------------------------------------------------------------------
    @property
    def num_compiled(self) -> int:
        swap = 2 if self._swap_fns is not None else 0
        return len(self._compiled) + (self._prelude_fn is not None) + swap

    def bucket_keys(self) -> list[StepKey]:
        """Every step shape the scheduler can produce (without logprobs or penalties)."""
        c = self.config
        keys = [StepKey(s, s, p, True) for s in c.seq_buckets for p in c.page_buckets]
        keys += [
            StepKey(t, s, p, False)
            for t in c.token_buckets
            for s in c.seq_buckets
            for p in c.page_buckets
        ]
        return keys

    def num_buckets(self) -> int:
        # + the prelude (+ the swap gather and scatter)
        return len(self.bucket_keys()) + 1 + (2 if self.swap_space is not None else 0)

    def precompile(self) -> float:
        t0 = time.perf_counter()
        for key in self.bucket_keys():
            self._executable(key, self.dummy_inputs(key))
        self._prelude()
        if self.swap_space is not None:
            self._swappers()
        return time.perf_counter() - t0

    def _executable(self, key: StepKey, inputs: StepInputs):
        exe = self._compiled.get(key)
        if exe is None:
            if self.warmed_up:
                logger.warning("compiling a new step shape after warm-up: %s", key)
                self.num_recompiles += 1
            t0 = time.perf_counter()
            body = functools.partial(
                _step, cfg=self.cfg, key=key, backend=self.config.attention_backend
            )
            if self.mesh is None:
                fn = jax.jit(body, donate_argnums=(1,))
            else:
                fn = self._sharded_jit(
                    functools.partial(body, tp_axis=sharding.TP),
                    in_specs=(self._param_specs, self._state_specs, P(), P()),
                    out_specs=(P(), P(), self._state_specs),
                    donate=1,
                )
            exe = fn.lower(self.params, self.state, inputs, self.last_tokens).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe

    def _prelude(self):
        if self._prelude_fn is None:
            updates = np.zeros((_PRELUDE_UPDATES, 3), np.int32)
            copies = np.zeros((_PRELUDE_COPIES, 2), np.int32)
            if self.mesh is None:
                fn = jax.jit(_prelude, donate_argnums=(0,))
            else:
                specs = self._state_specs
                fn = self._sharded_jit(
                    _prelude, in_specs=(specs, P(), P()), out_specs=specs, donate=0
                )
            self._prelude_fn = fn.lower(self.state, updates, copies).compile()
        return self._prelude_fn

    def _swappers(self):
        """(gather, scatter), compiled once each on first use."""
        if self._swap_fns is None:
            ids = np.zeros(_SWAP_PAGES, np.int32)
            pages = np.zeros(
                (*self.swap_space.shape[:3], _SWAP_PAGES, *self.swap_space.shape[4:]),
                self.swap_space.dtype,
            )
            if self.mesh is None:
                gather = jax.jit(_gather_pages)
                scatter = jax.jit(_scatter_pages, donate_argnums=(0,))
            else:
                specs, pages_spec = self._state_specs, P(None, None, sharding.POOL_SPEC[0])
                gather = self._sharded_jit(
                    _gather_pages, in_specs=(specs, P()), out_specs=pages_spec, donate=None
                )
                scatter = self._sharded_jit(
                    _scatter_pages, in_specs=(specs, P(), pages_spec), out_specs=specs, donate=0
                )
            self._swap_fns = (
                gather.lower(self.state, ids).compile(),
                scatter.lower(self.state, ids, pages).compile(),
            )
        return self._swap_fns

    def swap(self, plan: StepPlan) -> None:
        """Runs a plan's swap-outs (device -> host), then its swap-ins (host -> device)."""
        if not (plan.swap_out or plan.swap_in):
            return
        gather, scatter = self._swappers()
        for i in range(0, len(plan.swap_out), _SWAP_PAGES):
            chunk = np.asarray(plan.swap_out[i : i + _SWAP_PAGES], np.int32)
            ids = np.zeros(_SWAP_PAGES, np.int32)  # padding gathers the null page
            ids[: len(chunk)] = chunk[:, 0]
            pages = jax.device_get(gather(self.state, ids))
            self.swap_space[:, :, :, chunk[:, 1]] = pages[:, :, :, : len(chunk)]
        for i in range(0, len(plan.swap_in), _SWAP_PAGES):
            chunk = np.asarray(plan.swap_in[i : i + _SWAP_PAGES], np.int32)
            host = np.zeros(_SWAP_PAGES, np.int32)  # padding writes host page 0 to the null page
            dev = np.zeros(_SWAP_PAGES, np.int32)
            host[: len(chunk)], dev[: len(chunk)] = chunk[:, 0], chunk[:, 1]
            self.state = scatter(self.state, dev, self.swap_space[:, :, :, host])

    def _named(self, specs):
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs)

    def _sharded_jit(self, body, *, in_specs, out_specs, donate: int | None):
        """One jit over the mesh: the body runs per device inside shard_map; argument
        `donate` (None: none) is donated."""
        mapped = jax.shard_map(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return jax.jit(
            mapped,
            in_shardings=self._named(in_specs),
            out_shardings=self._named(out_specs),
            donate_argnums=() if donate is None else (donate,),
        )

    def dummy_inputs(self, key: StepKey) -> StepInputs:
        plan = StepPlan(rows=(), page_updates=(), page_copies=(), num_tokens=0)
        return self._pack(plan, key, self._update_capacity(key), key.num_seqs)

    # -- execution -------------------------------------------------------------------------
    def execute(self, plan: StepPlan, eos_token_ids: tuple[int, ...]) -> SamplerOutput:
        """Runs one step; returns numpy arrays of the sampled tokens (row order of the plan)."""
        return self.fetch(self.dispatch(plan, eos_token_ids))

    def dispatch(
        self,
        plan: StepPlan,
        eos_token_ids: tuple[int, ...],
        prev_rows: dict[int, int] | None = None,
    ) -> InFlightStep:
        """Packs a plan and starts its step on the device without waiting for it.

        prev_rows: seq_id -> row of the previous dispatched step, for the sequences whose
        input token is that step's sample, not yet on the host (Sequence.num_placeholders).
        """
        self._poll()
        key = self._key(plan)
        cap = self._update_capacity(key)
        updates, copies = list(plan.page_updates), list(plan.page_copies)
        # What does not fit the step's share goes through the prelude first.
        while len(updates) > cap or len(copies) > key.num_seqs:
            upd = updates[:_PRELUDE_UPDATES] if len(updates) > cap else []
            cps = copies[:_PRELUDE_COPIES] if len(copies) > key.num_seqs else []
            updates, copies = updates[len(upd) :], copies[len(cps) :]
            self.run_prelude(
                self._pad_rows(upd, _PRELUDE_UPDATES, (self.scratch_row, 0, 0)),
                self._pad_rows(cps, _PRELUDE_COPIES, (0, 0)),
            )
        plan = dataclasses.replace(plan, page_updates=tuple(updates), page_copies=tuple(copies))
        inputs = self._pack(plan, key, cap, key.num_seqs, eos_token_ids, prev_rows)
        self._poll()
        t0 = time.perf_counter()
        out = self.run_step(key, inputs)
        context = sum(r.start + r.num_new_tokens for r in plan.rows)
        step = InFlightStep(key, out, len(plan.rows), context, t0, busy_time=t0)
        self._latest = step
        return step

    def fetch(self, step: InFlightStep) -> SamplerOutput:
        """Waits for a dispatched step; returns numpy arrays of its sampled tokens."""
        out = step.out
        if self.broadcast is not None:  # replicated: this process's shard is the whole value
            out = [None if x is None else x.addressable_data(0) for x in out]
        running = self.step_log is not None and not out[0].is_ready()
        result = SamplerOutput(*jax.device_get(tuple(out)))
        if self.step_log is not None:
            now = time.perf_counter()
            # A step the host waited for finished now; one already done, at some time after
            # the host last saw it running.
            step.done_time = now if running else step.busy_time
            start = max(step.dispatch_time, self._last_done_time)
            self._last_done_time = step.done_time
            seconds = max(step.done_time - start, 0.0)
            self.step_log.append((step.key, step.num_rows, step.num_context_tokens, seconds))
            self._poll()
        return result

    def _poll(self) -> None:
        """step_log timing: notes whether the latest dispatched step is still running. A step
        starts on the device when it is dispatched and the one before it has finished."""
        step = self._latest
        if self.step_log is None or step is None or step.done_time is not None:
            return
        now = time.perf_counter()
        if not step.out[0].is_ready():
            step.busy_time = now

    def run_prelude(self, updates: np.ndarray, copies: np.ndarray) -> None:
        if self.broadcast is not None:
            updates, copies = self.broadcast.prelude(updates, copies)
        self.state = self._prelude()(self.state, updates, copies)

    def run_step(self, key: StepKey, inputs: StepInputs) -> SamplerOutput:
        if self.broadcast is not None:
            inputs = self.broadcast.step(key, inputs)
        exe = self._executable(key, inputs)
        out, self.last_tokens, self.state = exe(self.params, self.state, inputs, self.last_tokens)
        return out

    def follow(self) -> None:
        """Processes other than 0: replay process 0's device calls until it stops."""
        self.broadcast.follow()

    def stop_followers(self) -> None:
        """Process 0: release the processes waiting in `follow` (no-op in one process)."""
        if self.broadcast is not None:
            self.broadcast.stop()

    def _key(self, plan: StepPlan) -> StepKey:
        c = self.config
        num_seqs = _bucket(c.seq_buckets, len(plan))
        max_pages = max(math.ceil((r.start + r.num_new_tokens) / self.page_size) for r in plan.rows)
        cols = _bucket(c.page_buckets, max(max_pages, 1))
        num_logprobs = (
            MAX_LOGPROBS if any(r.seq.params.logprobs is not None for r in plan.rows) else 0
        )
        penalty_shape = None
        pen_rows = [r.seq for r in plan.rows if r.seq.params.uses_penalties]
        if pen_rows:
            penalty_shape = (
                _pow2(max(s.num_prompt_tokens for s in pen_rows)),
                _pow2(max(s.num_output_tokens for s in pen_rows)),
            )
        if plan.decode_only:
            return StepKey(num_seqs, num_seqs, cols, True, num_logprobs, penalty_shape)
        num_tokens = _bucket(c.token_buckets, max(plan.num_tokens, 1))
        return StepKey(num_tokens, num_seqs, cols, False, num_logprobs, penalty_shape)

    def _update_capacity(self, key: StepKey) -> int:
        return _pow2(2 * key.num_seqs + key.num_tokens // self.page_size)

    @staticmethod
    def _pad_rows(rows, n: int, fill) -> np.ndarray:
        out = np.empty((n, len(fill)), np.int32)
        out[:] = fill
        if rows:
            out[: len(rows)] = rows
        return out

    def _pack(
        self, plan: StepPlan, key: StepKey, cap: int, s_pad: int, eos=(), prev_rows=None
    ) -> StepInputs:
        t_pad, ps = key.num_tokens, self.page_size
        token_ids = np.zeros(t_pad, np.int32)
        src_rows = np.full(t_pad, -1, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.zeros(t_pad, np.int32)
        slot_ids = np.full(s_pad, self.scratch_row, np.int32)
        context_lens = np.zeros(s_pad, np.int32)
        query_start = np.zeros(s_pad + 1, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        temperature = np.zeros(s_pad, np.float32)
        top_k = np.zeros(s_pad, np.int32)
        top_p = np.ones(s_pad, np.float32)
        min_p = np.zeros(s_pad, np.float32)
        key_data = np.zeros((s_pad, 2), np.uint32)
        num_generated = np.zeros(s_pad, np.int32)
        banned = np.full((s_pad, _MAX_BANNED), -1, np.int32)
        # One pass over the rows into Python lists, then one numpy write per array: per-row
        # numpy writes cost more than the lists at hundreds of rows per step.
        tok: list[int] = []
        pos: list[int] = []
        slot: list[int] = []
        seq_rows: list[tuple] = []
        pending: list[tuple[int, int]] = []  # (token index, row of the previous step)
        for i, row in enumerate(plan.rows):
            seq, n, start = row.seq, row.num_new_tokens, row.start
            pages = seq.pages
            if n == 1:  # a decode token
                if start == len(seq.token_ids):  # the previous step's sample, on the device
                    pending.append((len(tok), prev_rows[seq.seq_id]))
                    tok.append(0)
                else:
                    tok.append(seq.token_ids[start])
                pos.append(start)
                slot.append(pages[start // ps] * ps + start % ps)
            elif n:
                span = np.arange(start, start + n)
                tok.extend(seq.token_ids[start : start + n])
                pos.extend(range(start, start + n))
                slot.extend((np.asarray(pages, np.int64)[span // ps] * ps + span % ps).tolist())
            p = seq.params
            generated = seq.num_output_tokens + seq.num_placeholders
            seq_rows.append(
                (
                    seq.slot,
                    start + n,
                    len(tok),
                    0.0 if p.greedy else p.temperature,
                    max(p.top_k, 0),
                    p.top_p,
                    p.min_p,
                    seq.seed,
                    generated,
                )
            )
            if generated < p.min_tokens:
                stops = ([] if p.ignore_eos else list(eos)) + p.stop_token_ids
                banned[i, : len(stops[:_MAX_BANNED])] = stops[:_MAX_BANNED]
        t, s = len(tok), len(seq_rows)
        token_ids[:t] = tok
        if pending:
            index, rows = zip(*pending, strict=True)
            src_rows[list(index)] = rows
        positions[:t] = pos
        slot_mapping[:t] = slot
        if s:
            cols = list(zip(*seq_rows, strict=True))
            slot_ids[:s] = cols[0]
            context_lens[:s] = cols[1]
            query_start[1 : s + 1] = cols[2]
            temperature[:s] = cols[3]
            top_k[:s] = cols[4]
            top_p[:s] = cols[5]
            min_p[:s] = cols[6]
            key_data[:s] = seeds_to_key_data(cols[7])
            num_generated[:s] = cols[8]
        query_start[s + 1 :] = t
        sample_rows = np.fromiter((r.sample_row for r in plan.rows), np.int32, count=s)
        logits_indices[:s] = np.maximum(query_start[sample_rows + 1] - 1, 0)
        penalties = None
        if key.penalty_shape is not None:
            penalties = self._penalties(plan, key.penalty_shape, s_pad)
        return StepInputs(
            token_ids=token_ids,
            src_rows=src_rows,
            positions=positions,
            slot_mapping=slot_mapping,
            slot_ids=slot_ids,
            context_lens=context_lens,
            query_start=query_start,
            logits_indices=logits_indices,
            page_updates=self._pad_rows(list(plan.page_updates), cap, (self.scratch_row, 0, 0)),
            page_copies=self._pad_rows(list(plan.page_copies), key.num_seqs, (0, 0)),
            sampling=SamplingInputs(
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                key_data=key_data,
                num_generated=num_generated,
                banned=banned,
                penalties=penalties,
            ),
        )

    @staticmethod
    def _penalties(plan: StepPlan, shape: tuple[int, int], s_pad: int) -> Penalties:
        hp, ho = shape
        prompt = np.full((s_pad, hp), -1, np.int32)
        output = np.full((s_pad, ho), -1, np.int32)
        presence = np.zeros(s_pad, np.float32)
        frequency = np.zeros(s_pad, np.float32)
        repetition = np.ones(s_pad, np.float32)
        for i, row in enumerate(plan.rows):
            seq, p = row.seq, row.seq.params
            if not p.uses_penalties:
                continue
            prompt[i, : seq.num_prompt_tokens] = seq.token_ids[: seq.num_prompt_tokens]
            out = seq.output_token_ids
            output[i, : len(out)] = out
            presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
            repetition[i] = p.repetition_penalty
        return Penalties(prompt, output, presence, frequency, repetition)
