"""ModelRunner: the only code that moves data between host and device.

It owns the device state (the K/V page pools and the device page table, jpaged.worker.programs
DeviceState), the previous step's sampled tokens on the device, and the host swap space.
Per step it packs the plan (jpaged.worker.step_inputs.pack), runs the compiled step
(jpaged.worker.programs.Programs) and later fetches the sampled tokens:

    step = runner.dispatch(plan, prev_plan)   # packed, started; nothing waits
    out = runner.fetch(step)                  # numpy SamplerOutput, rows in plan order

Page-table edits that do not fit a step's share go through the prelude program first. Swap
(preemption_mode="swap"): the host swap space is numpy [2 (K, V), num_kv_heads, slots (the
pool's layers per page: num_layers, or a paging group's, models/kv_groups.py),
num_swap_pages + 1, page_size, head_dim] (host page 0 unused, like the null page); a plan's
swap-outs gather their device pages in calls of SWAP_PAGES and device_get them, its swap-ins
scatter host pages back, pool donated; both before the step (`swap`).

Across processes (jax.distributed) a broadcast object (jpaged.worker.multihost.StepBroadcast) is
passed in: process 0 sends each device call's inputs through it before making the call, and
the other processes replay them (`follow`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jpaged.config import EngineConfig, LoRAConfig
from jpaged.sample.sampler import SamplerOutput
from jpaged.worker.map_count import MapCountError
from jpaged.worker.programs import PRELUDE_COPIES, PRELUDE_UPDATES, SWAP_PAGES, Programs
from jpaged.worker.step_inputs import (
    WARM_UP_RUNS,
    Demand,
    StepInputs,
    StepKey,
    bucket_keys,
    holds,
    lora_width,
    needs_key,
    pack,
    pad_rows,
    step_key,
    update_capacity,
    warm_up_inputs,
    warm_up_keys,
    with_lora_widths,
)
from jpaged.worker.step_plan import StepPlan, empty_plan
from models import lora
from models.config import ModelConfig
from models.kv_groups import KVGroups
from pallas_kernels import kv_quant

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class InFlightStep:
    """A dispatched step whose sampled tokens have not been fetched (`ModelRunner.fetch`)."""

    key: StepKey
    plan: StepPlan
    out: SamplerOutput  # device arrays


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
        broadcast=None,
        cache_dir: str | None = None,
        kv_groups: KVGroups | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """mesh: the replica's Mesh (models/sharding.py) params are sharded over, or None.
        num_swap_pages: host pages of swap space (0: no swap). broadcast: a StepBroadcast
        when the model spans processes, else None. cache_dir: the compilation cache's
        directory, which also keeps compiled programs to load without tracing
        (executable_cache.py); None: none. kv_groups: the layers' paging groups, one page
        table each (models/kv_groups.py); None: one group. lora_config: LoRA slots in the
        params (models/lora.py), written by the plans' lora_loads; None: no LoRA."""
        if num_swap_pages and broadcast is not None:
            raise ValueError('preemption_mode="swap" is not supported across processes')
        self.config = config
        self.model_config = model_config
        self.num_pages = num_pages
        self.page_size = config.cache.page_size
        self.scratch_row = config.scheduler.max_num_seqs
        self.mesh = mesh
        self.broadcast = broadcast
        scan = config.scans_layers(jax.default_backend(), model_config)
        self.num_groups = 1 if kv_groups is None else kv_groups.num_groups
        self.programs = Programs(
            model_config,
            config.attention_backend,
            mesh,
            scan_layers=scan,
            cache_dir=cache_dir,
            kv_groups=kv_groups,
            lora=lora_config is not None,
        )
        self.lora_config = lora_config
        self._max_loras = 0 if lora_config is None else lora_config.max_loras  # 0: LoRA off
        if lora_config is not None:
            if model_config.kv_lora_rank:  # no q/k/v projections to adapt
                raise ValueError("LoRA adapters with latent attention (MLA) are not supported")
            if broadcast is not None:  # followers would replay neither widths nor slot writes
                raise ValueError("LoRA adapters across processes (multi-host) are not supported")
            params = lora.with_slots(
                params, model_config, lora_config.max_loras, lora_config.max_lora_rank,
                lora.storage_dtype(lora_config.lora_dtype, dtype),
            )  # fmt: skip
        self.params = self.programs.layout_params(params)
        if lora_config is not None:  # compiled now: no adapter load compiles anything
            self._write_loras(())
        self._warmed: set[StepKey] = set()  # step programs precompile has run (warm_up_inputs)
        # Keys run on a bigger program at the mapping cap, and that program (chosen once: the
        # cap does not recede, and /proc/self/maps is not read again for them).
        self._padded_up: dict[StepKey, StepKey] = {}
        self.mask_words = -(-model_config.vocab_size // 32)
        self._device_all_allowed: dict[int, object] = {}  # rows -> all-ones bitmask on device
        self.dtype = dtype
        # The pages' dtype (--kv-cache-dtype; "auto": the activations'): int8/fp8 pools hold
        # kv_quant.QuantizedPages, and so does the swap space (rows and scales, numpy).
        self.kv_dtype = kv_quant.storage_dtype(config.cache.kv_cache_dtype, dtype)
        self.reset_state()
        self.swap_space = None
        self.swap_seconds, self.num_swap_steps = 0.0, 0  # swap's time, its calls with copies
        # Without a disk tier nothing reads host pages between two swap calls.
        self.defer_host_writes = config.cache.kv_offload_dir is None
        if num_swap_pages:  # zeros: the OS maps host pages on first write
            h, d = model_config.num_kv_heads, model_config.head_dim
            shape = (2, h, self.programs.num_slots, num_swap_pages + 1, self.page_size, d)
            self.swap_space = kv_quant.zeros(shape, self.kv_dtype, xp=np)

    def reset_state(self) -> None:
        """A zero pool and page table, and zero previous tokens (at start, and after a failed
        step, whose donated buffers may be gone)."""
        sched = self.config.scheduler
        rows = self.num_groups * (sched.max_num_seqs + 1)
        table_shape = (rows, self.config.max_pages_per_seq)
        self.state = self.programs.init_state(
            self.num_pages, self.page_size, table_shape, self.kv_dtype
        )
        # Gathered swap-outs not yet in the host array: (pages on device, host page ids); a
        # failed step's are dropped with the host store's state (KVCacheManager.restart).
        self._host_writes: list[tuple[object, np.ndarray]] = []
        # The latest step's sampled tokens, padded to max_num_seqs: the next step's prev_tokens.
        self.last_tokens = self.programs.zeros(sched.max_num_seqs)

    # -- compilation -----------------------------------------------------------------------
    def num_buckets(self) -> int:
        """Programs the engine can need: every step key, the prelude (and swap copies)."""
        keys = self._lora_keys(bucket_keys(self.config))
        return len(keys) + 1 + (2 if self.swap_space is not None else 0)

    def warm_up_keys(self, context_len: int) -> list[StepKey]:
        """The step keys short requests (up to context_len tokens) meet first."""
        return self._lora_keys(warm_up_keys(self.config, context_len))

    def _lora_keys(self, keys: list[StepKey]) -> list[StepKey]:
        """keys at every LoRA width with LoRA on (models/lora.py widths), else as they are."""
        return keys if self.lora_config is None else with_lora_widths(keys, self._max_loras)

    def precompile(
        self, keys: list[StepKey] | None = None, context_len: int | None = None
    ) -> float:
        """Compiles the step programs of keys (default: every bucket of sequences up to
        config.precompile_max_len tokens), the prelude and the swap copies, and runs each
        step program on its warm-up inputs (jpaged.worker.step_inputs.warm_up_inputs); returns the
        seconds it took.

        The runs matter on XLA:CPU: a program's first run leaves about 1 MiB on XLA's
        intra-op threads, so a server whose programs first ran under load grew by that at
        each shape the load met first (docs/serving.md, issue 16.12). They change nothing
        a request reads. Not across processes, whose followers replay process 0's device
        calls only once they follow. context_len: the longest context the runs attend over
        (None: every key's full page columns); one page is enough to run every loop body
        once, which is what the runs are for, and on CPU, whose keys have every page column,
        full contexts took 4.7 of the 10.9 s a server's warm-up ran its 6 programs.
        """
        t0 = time.perf_counter()
        if keys is None:
            keys = self._lora_keys(bucket_keys(self.config, self.config.precompile_max_len))
        for key in keys:
            self.programs.step(
                key, self.params, self.state, self.dummy_inputs(key), self.last_tokens
            )
        if self.broadcast is None:
            runs = [k for k in dict.fromkeys(keys) if k not in self._warmed]
            self._warm_up_runs(runs, context_len)
        self.programs.prelude(self.state)
        if self.swap_space is not None:
            self._swappers()
        return time.perf_counter() - t0

    def dummy_inputs(self, key: StepKey) -> StepInputs:
        """Inputs of key's shapes that change nothing (every row padding)."""
        inputs = self._pack(empty_plan(), key)
        if key.spec_draft:
            shape = (key.num_seqs, key.spec_k, self.model_config.vocab_size)
            inputs.draft_probs = np.zeros(shape, np.float32)
        if key.draft:
            inputs.draft_offset = np.int32(0)
        return inputs

    def _warm_up_runs(self, keys: list[StepKey], context_len: int | None = None) -> None:
        if not keys:
            return
        for key in keys:
            for run in range(WARM_UP_RUNS):
                self.run_step(key, self._warm_up_inputs(key, run, context_len))
        self._warmed.update(keys)
        jax.block_until_ready(self.state)
        # The runs' samples are no request's: the next step's prev_tokens are zeros again.
        self.last_tokens = self.programs.zeros(self.config.scheduler.max_num_seqs)

    def _warm_up_inputs(self, key: StepKey, run: int, context_len: int | None = None) -> StepInputs:
        inputs = warm_up_inputs(
            self.dummy_inputs(key), key, self.page_size, run, max_context=context_len
        )
        if key.spec_draft:  # a uniform draft distribution (zeros would divide by zero)
            inputs.draft_probs[:] = 1.0 / self.model_config.vocab_size
        return inputs

    def _pack(self, plan: StepPlan, key: StepKey, **kwargs) -> StepInputs:
        return pack(
            plan,
            key,
            scratch_row=self.scratch_row,
            page_size=self.page_size,
            mask_words=self.mask_words,
            num_groups=self.num_groups,
            lora=self._max_loras,
            **kwargs,
        )

    def _swappers(self):
        h, _, _, page_size, d = self.swap_space.shape[1:]
        return self.programs.swappers(self.state, (h, page_size, d), self.kv_dtype)

    # -- execution -------------------------------------------------------------------------
    def swap(self, plan: StepPlan) -> None:
        """Runs a plan's swap-outs (device -> host), then its swap-ins (host -> device).

        Swap-outs are gathered on the device at once (a snapshot of the pages before the
        step), and their bytes reach the host array when a later reader needs them: this
        plan's swap-ins, the next plan's swap call (before it makes any copy), or, with
        defer_host_writes off (a disk tier reads host pages while the plan is made), now.
        A deferred fetch waits for the step in flight only when the next plan is made."""
        t0 = time.perf_counter()
        self.flush_host_writes()
        if not (len(plan.swap_out) or len(plan.swap_in)):
            self.swap_seconds += time.perf_counter() - t0
            return
        gather, scatter = self._swappers()
        # [2, H, L, host pages, page_size, D] (a QuantizedPages of that and its scales
        # [2, H, L, host pages, page_size]: every leaf is moved alike).
        space = self.swap_space
        for i in range(0, len(plan.swap_out), SWAP_PAGES):
            chunk = plan.swap_out[i : i + SWAP_PAGES]
            ids = np.zeros(SWAP_PAGES, np.int32)  # padding gathers the null page
            ids[: len(chunk)] = chunk[:, 0]
            self._host_writes.append((gather(self.state, ids), chunk[:, 1]))
        if len(plan.swap_in) or not self.defer_host_writes:
            self.flush_host_writes()
        for i in range(0, len(plan.swap_in), SWAP_PAGES):
            chunk = plan.swap_in[i : i + SWAP_PAGES]
            host = np.zeros(SWAP_PAGES, np.int32)  # padding writes host page 0 to the null page
            dev = np.zeros(SWAP_PAGES, np.int32)
            host[: len(chunk)], dev[: len(chunk)] = chunk[:, 0], chunk[:, 1]
            pages = jax.tree.map(
                lambda a, h=host: a[:, :, :, h].reshape(*a.shape[:2], -1, *a.shape[4:]), space
            )
            self.state = scatter(self.state, dev, pages)
        self.swap_seconds += time.perf_counter() - t0
        self.num_swap_steps += 1

    def flush_host_writes(self) -> None:
        """Writes the gathered swap-outs into the host array (waiting for them)."""
        for got, host_ids in self._host_writes:
            write_host_pages(self.swap_space, got, host_ids)
        self._host_writes = []

    def execute(self, plan: StepPlan) -> SamplerOutput:
        """Runs one step; returns numpy arrays of the sampled tokens (row order of the plan)."""
        return self.fetch(self.dispatch(plan))

    def dispatch(
        self,
        plan: StepPlan,
        prev_plan: StepPlan | None = None,
        token_bitmask: np.ndarray | None = None,
        *,
        draft_probs=None,
        draft_offset: int | None = None,
    ) -> InFlightStep:
        """Packs a plan and starts its step on the device without waiting for it.

        prev_plan: the step dispatched before, whose samples this plan's PLACEHOLDER tokens
        are (async scheduling). token_bitmask: int32[len(plan), ceil(vocab / 32)], the
        structured-output masks of the rows (None: no row is constrained). draft_probs: the
        draft model's proposal distributions, float32[seq bucket, K, V] on the device (a
        verification of draft proposals); draft_offset: the proposal index a draft model's
        own step samples (jpaged/spec_decode/draft_model.py).
        """
        key = step_key(plan, self.config)
        if self._max_loras:
            key = dataclasses.replace(key, lora_width=lora_width(plan, self._max_loras))
        if draft_offset is not None:
            key = dataclasses.replace(key, draft=True)
        key = self._runnable(key)
        cap = update_capacity(key, self.page_size, self.num_groups)
        updates, copies = plan.page_updates, plan.page_copies
        # What does not fit the step's share goes through the prelude first.
        while len(updates) > cap or len(copies) > key.num_seqs:
            upd = updates[:PRELUDE_UPDATES] if len(updates) > cap else updates[:0]
            cps = copies[:PRELUDE_COPIES] if len(copies) > key.num_seqs else copies[:0]
            updates, copies = updates[len(upd) :], copies[len(cps) :]
            self.run_prelude(
                pad_rows(upd, PRELUDE_UPDATES, (self.scratch_row, 0, 0)),
                pad_rows(cps, PRELUDE_COPIES, (0, 0)),
            )
        if plan.lora_loads and self.lora_config is not None:
            self._write_loras(plan.lora_loads)
        if len(updates) != len(plan.page_updates) or len(copies) != len(plan.page_copies):
            plan = dataclasses.replace(plan, page_updates=updates, page_copies=copies)
        inputs = self._pack(plan, key, prev_plan=prev_plan, token_bitmask=token_bitmask)
        if key.spec_draft:
            inputs.draft_probs = draft_probs
        if key.draft:
            inputs.draft_offset = np.int32(draft_offset)
        return InFlightStep(key, plan, self.run_step(key, inputs))

    def _write_loras(self, loads) -> None:
        """Writes each (slot, HostAdapter) of loads into its device slot (none: compiles
        the writer)."""
        cfg, rank = self.model_config, self.lora_config.max_lora_rank
        params, slots = lora.split_slots(self.params)
        if not loads:
            shapes = lora.adapter_shapes(cfg, rank)
            self.programs.lora_writer(slots, {k: np.zeros(s, np.float32) for k, s in shapes.items()})
            return
        for slot, adapter in loads:
            weights = adapter.slot_weights(cfg, rank)
            slots = self.programs.lora_writer(slots, weights)(slots, np.int32(slot), weights)
        self.params = lora.join_slots(params, slots)

    def cap_refusal(self, needs: StepKey) -> MapCountError | None:
        """None when a compiled step program holds a step of `needs` (step_inputs.holds) or
        Linux's mapping cap allows a compile (jpaged/worker/map_count.py); else the error
        that compiling its program would meet. Reads the process's mappings only when no
        compiled program holds it. With LoRA on, at the widest LoRA width (any adapters)."""
        needs = dataclasses.replace(needs, lora_width=max(needs.lora_width, self._max_loras))
        if any(holds(k, needs) for k in self.programs.step_keys()):
            return None
        return self.programs.compile_refusal("its step program")

    def admits(self, demands: list[Demand]) -> bool:
        """Whether these sequences can step together: a compiled program holds their steps,
        or compiling one is allowed (the Scheduler's admission check)."""
        return self.cap_refusal(needs_key(demands, self.config)) is None

    def refusal_at_cap(
        self, params, num_prompt_tokens: int = 0, *, pooling: bool = False
    ) -> str | None:
        """Why a request of these SamplingParams and prompt length cannot run now, or None:
        Linux's mapping cap allows no compile and no compiled step program holds its steps
        alone (its prompt at once, its n rows, its context of prompt + max_tokens at most
        max_model_len, its features: logprobs, penalties, logit_bias, prompt_logprobs). The
        engine refuses such a request alone, before it is queued; the scheduler admits the
        others only into batches a compiled program holds (ModelRunner.admits)."""
        s = self.config.scheduler
        end = min(num_prompt_tokens + (params.max_tokens or s.max_model_len), s.max_model_len)
        demand = Demand(params=params, num_prompt_tokens=num_prompt_tokens,
                        num_new_tokens=num_prompt_tokens, context_len=end, num_rows=params.n,
                        pooling=pooling)  # fmt: skip
        needs = needs_key([demand], self.config)
        refusal = self.cap_refusal(needs)
        if refusal is None:
            return None
        keys = self.programs.step_keys()
        wants = {
            "num_logprobs": "logprobs",
            "penalty_shape": "penalties",
            "bias_width": "logit_bias",
            "prompt_logprobs": "prompt_logprobs",
            "pooling": "an embedding",
        }
        asked = [name for field, name in wants.items() if getattr(needs, field)]
        plain = dataclasses.replace(needs, num_logprobs=0, penalty_shape=None, bias_width=0,
                                    prompt_logprobs=False, pooling=False)  # fmt: skip
        sized = {"num_tokens": 1, "num_seqs": 1, "num_page_cols": 1}
        featured = dataclasses.replace(needs, **sized)
        if asked and not any(holds(dataclasses.replace(k, **sized), featured) for k in keys):
            return (
                f"the request asks for {', '.join(asked)}, which no compiled step program "
                f"has: {refusal}"
            )
        if keys and not any(k.num_page_cols >= needs.num_page_cols for k in keys):
            widest = max(k.num_page_cols for k in keys) * self.page_size
            return (
                f"the request needs {end} tokens of context, more than any compiled step "
                f"program holds ({widest}): {refusal}"
            )
        with_features = f" with {', '.join(asked)}" if asked and any(
            holds(k, plain) for k in keys) else ""  # fmt: skip
        rows = f"{needs.num_seqs} row" + ("s" if needs.num_seqs > 1 else "")
        return (
            f"the request needs a step of {needs.num_tokens} tokens and {rows}{with_features}, "
            f"which no compiled step program holds: {refusal}"
        )

    def _runnable(self, key: StepKey) -> StepKey:
        """key, or, when it is not compiled and Linux's mapping cap allows no compile
        (jpaged/worker/map_count.py), the smallest compiled key that holds it (as many tokens,
        rows and page columns or more, and its features: step_inputs.holds; the step runs
        padded further). Without one the key is kept and its compile raises MapCountError.
        Speculative verification and draft keys are kept (their token counts are exact)."""
        programs = self.programs
        if programs.executable(key) is not None or key.spec_k or key.draft:
            return key
        if key in self._padded_up:
            return self._padded_up[key]
        if programs.compile_refusal("a step program") is None:
            return key
        holding = [k for k in programs.step_keys() if holds(k, key)]
        if not holding:
            return key
        sizes = ("num_tokens", "num_seqs", "num_page_cols")
        extras = ("num_logprobs", "bias_width", "prompt_logprobs", "pooling")
        chosen = min(holding, key=lambda k: tuple(getattr(k, f) for f in sizes + extras)
                     + (k.penalty_shape or (0, 0),))  # fmt: skip
        self._padded_up[key] = chosen
        logger.warning(
            "at the memory-mapping cap: a step of %d tokens, %d rows and %d page columns "
            "runs on the compiled program of %d, %d and %d",
            *(getattr(key, f) for f in sizes),
            *(getattr(chosen, f) for f in sizes),
        )
        return chosen

    def fetch(self, step: InFlightStep) -> SamplerOutput:
        """Waits for a dispatched step; returns numpy arrays of its sampled tokens."""
        out = step.out
        if self.broadcast is not None:  # replicated: this process's shard is the whole value
            out = [None if x is None else x.addressable_data(0) for x in out]
        return SamplerOutput(*jax.device_get(tuple(out)))

    def run_prelude(self, updates: np.ndarray, copies: np.ndarray) -> None:
        if self.broadcast is not None:
            updates, copies = self.broadcast.prelude(updates, copies)
        self.state = self.programs.prelude(self.state)(self.state, updates, copies)

    def run_step(self, key: StepKey, inputs: StepInputs) -> SamplerOutput:
        if self.broadcast is not None:
            inputs = self.broadcast.step(key, inputs)
        elif not inputs.sampling.use_bitmask:  # no constrained row: the mask is not read
            inputs.sampling.token_bitmask = self._all_allowed(key.num_seqs)
        exe = self.programs.step(key, self.params, self.state, inputs, self.last_tokens)
        out, self.last_tokens, self.state = exe(self.params, self.state, inputs, self.last_tokens)
        return out

    def _all_allowed(self, num_rows: int):
        """A device-resident all-ones bitmask (no transfer per step)."""
        mask = self._device_all_allowed.get(num_rows)
        if mask is None:
            mask = jax.device_put(np.full((num_rows, self.mask_words), -1, np.int32))
            self._device_all_allowed[num_rows] = mask
        return mask

    def follow(self) -> None:
        """Processes other than 0: replay process 0's device calls until it stops."""
        self.broadcast.follow(self)

    def stop_followers(self) -> None:
        """Process 0: release the processes waiting in `follow` (no-op in one process)."""
        if self.broadcast is not None:
            self.broadcast.stop()


def write_host_pages(space, got, host_ids: np.ndarray) -> None:
    """Writes one swap call's gathered pages (every leaf [2, H, L * SWAP_PAGES, ...], on the
    device, its heads sharded under tensor parallelism) into host pages host_ids of the
    host array space (leaves [2, H, L, host pages + 1, ...]). Each device's shard (its KV
    heads) is written into its heads of the host array as it is, no gather of whole pages
    first (on 8 simulated CPU devices that concatenation cost ~90 ms of a 64 MiB call);
    a replicated copy of a shard is skipped."""
    for host, pages in zip(jax.tree.leaves(space), jax.tree.leaves(got), strict=True):
        for shard in pages.addressable_shards:
            if shard.replica_id:
                continue
            data = np.asarray(shard.data)  # [2, h, L * SWAP_PAGES, ...]: this shard's h heads
            by_layer = (*data.shape[:2], host.shape[2], SWAP_PAGES, *data.shape[3:])
            host[:, shard.index[1], :, host_ids] = data.reshape(by_layer)[:, :, :, : len(host_ids)]
