"""LLMEngine: requests in, RequestOutputs out, one step at a time.

    step():  plan = scheduler.schedule()          # host: which tokens, which pages
             step = runner.dispatch(plan)          # device: one jitted step, pool donated
             out = runner.fetch(step)              # its sampled tokens on the host
             seqs = scheduler.commit(plan, out)    # host: append tokens, token-level stops
             outputs = self._outputs(seqs)         # host: text, stop strings -> finish

The engine owns the requests (RequestGroup by id) and is the only code that moves results
from one stage to the next: the output processor reports stop strings and the engine
finishes those sequences in the scheduler; nothing later calls back into an earlier stage.

With async scheduling (EngineConfig.async_scheduling) the next plan is made and dispatched
before this one's tokens are fetched, so the host's work for step N+1 (and the commit and
outputs of step N) overlaps the device's step N; each step() call still returns the outputs
of one device step, in order. Steps whose rows use penalties (they need the tokens on the
host), multi-host runs and beam search (step_unsampled) stay synchronous.

The engine is not thread-safe: one thread drives it (the offline LLM, or the server's step
loop). Bad requests are rejected in add_request with a ValueError naming the field, before
anything about them is stored, so the engine stays usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from jpaged.config import DEFAULT_SWAP_SPACE_BYTES, CacheConfig, EngineConfig
from jpaged.core.kv_cache_manager import sequence_pages
from jpaged.core.output_processor import OutputProcessor
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup, SeqStatus, Sequence
from jpaged.outputs import RequestOutput
from jpaged.pooling import Pooler, PoolingParams, sentence_transformers_pooling
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams
from jpaged.spec_decode.draft_model import DraftModel
from jpaged.spec_decode.governor import AcceptanceTracker, CostGovernor
from jpaged.spec_decode.ngram_proposer import NgramProposer, matched_prefix
from jpaged.structured_output.manager import StructuredOutputManager
from jpaged.tokenizer import Tokenizer
from jpaged.worker import compilation_cache, executable_cache
from jpaged.worker.host_memory import release_free_memory
from jpaged.worker.model_loading import load_for_config
from jpaged.worker.runner import InFlightStep, ModelRunner
from jpaged.worker.step_inputs import bucket, needs_key
from jpaged.worker.step_plan import StepPlan
from models import quantization
from models.config import LongRopeScaling, ModelConfig
from models.kv_groups import KVGroups, kv_groups
from pallas_kernels import kv_quant

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step failed; the engine dropped the requests it held (request_ids) and rebuilt its
    state, so it serves new requests. The original error is __cause__."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(
            f"engine step failed ({type(error).__name__}: {error}); {len(request_ids)} "
            "request(s) dropped, engine state rebuilt"
        )
        self.request_ids = request_ids
        self.outputs: list[RequestOutput] = []  # other replicas' outputs of the same step


# The share of the host's available memory (after the weights are loaded) a CPU pool may
# take when no flag sizes it: the host also holds the weights, the compiled programs, the
# Python process and whatever else the machine runs.
HOST_KV_MEMORY_SHARE = 0.25


def available_host_memory() -> int | None:
    """Bytes the OS can give this process without swapping (MemAvailable in /proc/meminfo,
    else free physical pages), None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_num_pages(
    cache: CacheConfig,
    config: EngineConfig,
    model_config: ModelConfig,
    itemsize: int,
    *,
    extra_bytes_per_page: int = 0,
    kv_dtype=None,
) -> int:
    """Pool size, logged once with why: num_pages if given, else from the memory budget
    (kv_cache_memory_bytes: the whole pool's bytes); on CPU with neither, what the
    configuration can use, max_num_seqs sequences of max_model_len tokens plus the null page
    (speculative proposals need no page past max_model_len: LLMEngine._proposals caps them),
    capped at HOST_KV_MEMORY_SHARE of the host's available memory; on an accelerator,
    kv_memory_fraction of one device's free memory, where with tensor parallelism a device
    holds 1 / min(T, num_kv_heads) of every page. extra_bytes_per_page: a draft model's K/V
    per page, in the same budget. A pool too small for one max_model_len sequence is then
    refused or fitted by fit_max_model_len. kv_dtype: the pages' dtype (None: itemsize
    bytes per element); an int8/fp8 page counts its rows and scales."""
    per_page = kv_page_bytes(model_config, cache.page_size, itemsize, kv_dtype)
    per_page += extra_bytes_per_page
    if cache.num_pages is not None:
        num_pages, why = cache.num_pages, "--num-pages"
    elif cache.kv_cache_memory_bytes is not None:
        num_pages = max(2, cache.kv_cache_memory_bytes // per_page + 1)
        why = f"--kv-cache-memory-bytes {cache.kv_cache_memory_bytes}"
    else:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            num_pages, why = _host_pool(config, per_page)
        else:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            shards = min(config.parallel.tensor_parallel_size, model_config.num_kv_heads)
            per_device_page = -(-per_page // shards)
            num_pages = max(2, int(free * cache.kv_memory_fraction) // per_device_page + 1)
            why = f"kv_memory_fraction {cache.kv_memory_fraction} of {free >> 20} MiB free"
    logger.info(
        "KV pool: %d pages of %d tokens (%d tokens, %d MiB): %s",
        num_pages, cache.page_size, (num_pages - 1) * cache.page_size,
        num_pages * per_page >> 20, why,
    )  # fmt: skip
    return num_pages


def kv_page_bytes(model_config: ModelConfig, page_size: int, itemsize: int, kv_dtype=None) -> int:
    """Bytes of one page of the pool in kv_dtype (None: itemsize bytes per element)."""
    if kv_dtype is None:
        return model_config.kv_bytes_per_page(page_size, itemsize)
    m = model_config
    return kv_quant.bytes_per_page(
        kv_dtype, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, page_size=page_size,
        head_dim=m.head_dim,
    )  # fmt: skip


def _host_pool(config: EngineConfig, per_page: int) -> tuple[int, str]:
    """A CPU pool's default pages and why: every slot at max_model_len, capped by memory."""
    s = config.scheduler
    want = s.max_num_seqs * config.max_pages_per_seq + 1
    why = f"max_num_seqs {s.max_num_seqs} x max_model_len {s.max_model_len} tokens"
    available = available_host_memory()
    if available is None:
        return want, why
    cap = max(2, int(available * HOST_KV_MEMORY_SHARE) // per_page + 1)
    if cap >= want:
        return want, why
    return cap, (
        f"{why} would take {want * per_page >> 20} MiB, capped at {HOST_KV_MEMORY_SHARE:.0%} "
        f"of {available >> 20} MiB available host memory; --num-pages, "
        "--kv-cache-memory-bytes or a lower --max-num-seqs set it"
    )


def fit_max_model_len(
    config: EngineConfig, num_pages: int, *, given: bool,
    group_windows: tuple[int | None, ...] = (None,),
) -> EngineConfig:  # fmt: skip
    """config with a max_model_len one sequence of which fits a pool of num_pages pages.

    A sequence of max_model_len tokens needs ceil(max_model_len / page_size) pages of the
    pool's num_pages - 1 (page 0 is the null page; a draft model's K/V uses the same page ids,
    inside the same memory budget): a pool with fewer could never hold it, whatever is
    preempted. Speculative proposals need no page past it: LLMEngine._proposals caps them so
    that a verifying step writes positions below max_model_len only. group_windows: the
    windows of a model's paging groups when it has several (models/kv_groups.py): it needs
    that many in each full group and at most its window's in each windowed one
    (kv_cache_manager.sequence_pages).

    Raises ValueError (both figures and the fixes) when max_model_len was given and does not
    fit; when it was not given, lowers it to the largest that fits and logs that once.
    """
    ps = config.cache.page_size
    max_len = config.scheduler.max_model_len
    usable = num_pages - 1
    if len(group_windows) == 1:
        fits = usable * ps
        need = -(-max_len // ps)
    else:  # the longest sequence that fits (sequence_pages grows with its length)
        lo, hi = 0, max_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sequence_pages(config, group_windows, mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        fits = lo
        need = sequence_pages(config, group_windows, max_len)
    if max_len <= fits:
        return config
    fixes = "raise --kv-cache-memory-bytes or --num-pages"
    if given or fits < 2:
        lower = f"lower --max-model-len to {fits} or less, or " if fits >= 2 else ""
        raise ValueError(
            f"max_model_len {max_len} needs {need} KV pages of {ps} tokens for one sequence, "
            f"but the pool has {usable} usable pages ({fits} tokens); {lower}{fixes}"
        )
    logger.warning(
        "max_model_len lowered from %d to %d tokens: the KV pool has %d usable pages of %d "
        "tokens and one sequence must fit; %s for longer sequences",
        max_len, fits, usable, ps, fixes,
    )  # fmt: skip
    scheduler = dataclasses.replace(config.scheduler, max_model_len=fits)
    return dataclasses.replace(config, scheduler=scheduler)


def group_pages(num_pages: int, groups: KVGroups, num_layers: int) -> int:
    """The page ids of a pool of num_pages pages of every layer (--num-pages, or what the
    memory budget holds) when a page id holds a paging group's slots_per_page layers
    (models/kv_groups.py): as many bytes, num_layers / slots_per_page times the pages (page 0
    stays the one null page)."""
    if not groups.grouped:
        return num_pages
    return (num_pages - 1) * num_layers // groups.slots_per_page + 1


def resolve_num_swap_pages(
    config: EngineConfig, model_config: ModelConfig, itemsize: int, kv_dtype=None
) -> int:
    """Host swap pages: 0 unless preemption_mode is "swap"; then num_swap_pages, or as many
    pages as swap_space_bytes (default 4 GiB) holds."""
    cache = config.cache
    if config.scheduler.preemption_mode != "swap":
        return 0
    if cache.num_swap_pages is not None:
        return cache.num_swap_pages
    budget = cache.swap_space_bytes or DEFAULT_SWAP_SPACE_BYTES
    num = budget // kv_page_bytes(model_config, cache.page_size, itemsize, kv_dtype)
    if num < 1:
        raise ValueError(f"swap_space_bytes ({budget}) is smaller than one page of K/V")
    return num


def model_display_name(model: str | None) -> str:
    """The name a model is served under: a Hub id as is, a path's last component (without
    .gguf), the built-in model's name for None."""
    from models.demo import SMOLLM2_NAME

    if model is None:
        return SMOLLM2_NAME
    path = Path(model)
    if path.exists():
        return path.name.removesuffix(".gguf")
    return model


# Weight of a row's previous estimate of what verifying gives it, per observation.
_ROW_DECAY = 0.5


def _may_speculate(seq: Sequence) -> bool:
    """Whether a decoding sequence may propose: not with a grammar, a logit bias, or
    prompt log-probabilities still to come."""
    p = seq.params
    return not (
        p.structured_outputs is not None
        or p.logit_bias
        or seq.group.prompt_logprobs is not None
        and seq.num_output_tokens == 0
    )


def _keeps_proposals(seq: Sequence) -> bool:
    """A seeded sampled row speculates whatever the batch or the step costs: its tokens must
    not depend on them (a greedy row's tokens are the same either way)."""
    return seq.params.seed is not None and seq.params.temperature > 0


class LLMEngine:
    def __init__(self, config: EngineConfig, *, loaded=None) -> None:
        t0 = time.perf_counter()
        max_len_given = config.scheduler.max_model_len is not None
        self.compilation_cache_dir = compilation_cache.enable(
            config.compilation_cache_dir, jax_cache=not executable_cache.wanted()
        )
        if loaded is None:
            loaded = load_for_config(config)  # sharded when config.parallel asks for it
        self.model_config: ModelConfig = loaded.config
        # Resident bytes of the params (quantized weights: values and scales).
        self.weight_bytes: int = quantization.weight_bytes(loaded.params)
        self.platform: str = jax.default_backend()  # "cpu", "gpu", "tpu"
        self.config = config = config.resolve(
            self.model_config.max_position_embeddings, self.platform
        )
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.tokenizer = (
            Tokenizer(loaded.tokenizer, self.eos_token_ids)
            if loaded.tokenizer is not None
            else None
        )
        self.max_model_len = config.scheduler.max_model_len
        self.model_name = model_display_name(config.model)
        self.chat_template = loaded.chat_template
        self.bos_token, self.eos_token = loaded.bos_token, loaded.eos_token
        # The model's own sampling defaults (generation_config.json, GGUF), for requests
        # that leave a field unset; none with generation_config="vllm".
        self.sampling_defaults = (
            dict(loaded.generation_defaults) if config.generation_config == "auto" else {}
        )
        # Embeddings: the pooling a sentence-transformers directory names, else the last
        # token's hidden state, normalised (decoder embedding models).
        path = Path(loaded.path)
        self.default_pooling = (
            sentence_transformers_pooling(path) if path.is_dir() else None
        ) or PoolingParams()
        dtype = quantization.activation_dtype(loaded.params)
        itemsize = np.dtype(dtype).itemsize
        draft = self._load_draft(config, dtype)
        self.kv_dtype = kv_quant.storage_dtype(config.cache.kv_cache_dtype, dtype)
        # A draft model's pool has the target's page ids and kv dtype (its runner reads the
        # same CacheConfig): each page costs its bytes too.
        extra = (
            0
            if draft is None
            else kv_page_bytes(draft.config, config.cache.page_size, itemsize, self.kv_dtype)
        )
        # Paging groups: a page table per attention kind when windowed pages are freed
        # (docs/memory.md, "Hybrid paging"); not with a draft model, which reads the same
        # page ids with full attention.
        self.kv_groups: KVGroups = kv_groups(
            self.model_config.windows,
            free_window_pages=config.cache.free_window_pages and draft is None,
            max_model_len=config.scheduler.max_model_len,
        )
        grouped = self.kv_groups.grouped
        num_layers = self.model_config.num_layers
        self.num_pages = group_pages(
            resolve_num_pages(
                config.cache, config, self.model_config, itemsize, extra_bytes_per_page=extra,
                kv_dtype=self.kv_dtype,
            ),
            self.kv_groups,
            num_layers,
        )  # fmt: skip
        if grouped:
            logger.info(
                "paging groups (windows %s): %d pages of %d of the %d layers each",
                self.kv_groups.windows, self.num_pages, self.kv_groups.slots_per_page,
                num_layers,
            )  # fmt: skip
        self.config = config = fit_max_model_len(
            config, self.num_pages, given=max_len_given,
            group_windows=self.kv_groups.windows if grouped else (None,),
        )  # fmt: skip
        if isinstance(self.model_config.rope_scaling, LongRopeScaling) and (
            config.cache.enable_prefix_caching
        ):
            # A LongRoPE key depends on its sequence's length (short or long factors): a page
            # cached by a short prompt is not the page a long one would compute.
            logger.warning("prefix caching is off: the model's LongRoPE keys depend on length")
            cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
            self.config = config = dataclasses.replace(config, cache=cache)
        self.max_model_len = config.scheduler.max_model_len
        swap_pages = resolve_num_swap_pages(config, self.model_config, itemsize, self.kv_dtype)
        self.num_swap_pages = group_pages(swap_pages + 1, self.kv_groups, num_layers) - 1
        self._new_host_state()
        broadcast = None
        if loaded.mesh is not None and jax.process_count() > 1:
            from jpaged.worker.multihost import StepBroadcast

            broadcast = StepBroadcast(loaded.mesh)
        self.runner = ModelRunner(
            config,
            self.model_config,
            loaded.params,
            self.num_pages,
            dtype,
            mesh=loaded.mesh,
            num_swap_pages=self.num_swap_pages,
            broadcast=broadcast,
            cache_dir=self.compilation_cache_dir,
            kv_groups=self.kv_groups if grouped else None,
        )
        self._arrivals = 0
        self._drafter = None
        if draft is not None:
            if broadcast is not None:
                raise ValueError("a draft model is not supported across processes")
            self._drafter = DraftModel(config, draft, self.num_pages, self.eos_token_ids)
        self._init_speculation()
        self.num_recoveries = 0  # failed steps the engine rebuilt its state after
        # One thread steps an engine at a time (a server's engine loop, or the caller of
        # LLM.generate); a second one is refused instead of corrupting the step in flight.
        self._stepping = threading.Lock()
        self._rng = np.random.default_rng(config.seed)
        self.peak_pages_used = 0
        self.load_seconds = time.perf_counter() - t0
        self.warmup_seconds = 0.0
        if config.precompile:
            # Runs over 64-token contexts: one page runs every loop body once, which is what
            # the runs are for (ModelRunner.precompile); full contexts made a 32-slot
            # server's precompile 165 s with every program loaded from the cache.
            self.warmup_seconds = self.runner.precompile(context_len=64)
            self.runner.programs.warmed_up = True
        release_free_memory()  # the loader's and the compiler's freed host memory
        logger.info(
            "engine ready: %s, %d pages of %d tokens, load %.1fs, warm-up %.1fs; %s",
            self.model_config.architecture,
            self.num_pages,
            config.cache.page_size,
            self.load_seconds,
            self.warmup_seconds,
            self.runner.programs.summary(),
        )

    def _new_host_state(self) -> None:
        """Fresh page allocators, scheduler, output processor and request table."""
        config = self.config
        self.allocator = PageAllocator(
            self.num_pages, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        swap_allocator = None
        if self.num_swap_pages:  # host pages; the allocator's page 0 stays unused
            swap_allocator = PageAllocator(self.num_swap_pages + 1, enable_prefix_caching=False)
        self.scheduler = Scheduler(
            config,
            self.allocator,
            self.eos_token_ids,
            swap_allocator=swap_allocator,
            group_windows=self.kv_groups.windows,
        )
        # At Linux's mapping cap, sequences join only batches a compiled program holds.
        self.scheduler.admission_check = lambda demands: (
            self.runner.cap_refusal(needs_key(demands, config)) is None
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs: one matcher per constrained sequence, keyed (request_id,
        # index), made when the first constrained request arrives.
        self._constraints: StructuredOutputManager | None = None
        self._groups: dict[str, RequestGroup] = {}
        # The step on the device whose results the next step() call collects (async only).
        self._in_flight: InFlightStep | None = None
        self._early_outputs: list[RequestOutput] = []  # collected outside step()

    @staticmethod
    def _load_draft(config: EngineConfig, dtype):
        """The draft model of a draft_model speculative config (same vocabulary), or None."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        from models.demo import resolve_builtin
        from models.loader import load_model

        draft = load_model(resolve_builtin(spec.model), dtype=dtype)
        return draft

    def _init_speculation(self) -> None:
        """The proposer (n-gram) or draft model and the per-sequence acceptance tracker
        (speculative decoding on); their state is per sequence, dropped when it finishes."""
        self.speculative = spec = self.config.speculative
        self._proposer = self._tracker = self._governor = None
        self._proposed: dict[int, int] = {}  # seq_id -> proposals of the step in flight
        # n-gram with the governor, plain steps: seq_id -> (its length when proposed, the
        # proposal), checked against the tokens that follow (_shadow_proposals)
        self._shadows: dict[int, tuple[int, list[int]]] = {}
        # n-gram with the governor: seq_id -> moving average of the tokens a verifying step
        # gives the row (from its shadows and its verifications); see _rows_tokens.
        self._row_tokens: dict[int, float] = {}
        # The governor's measurements: when the last step was collected (None after an idle
        # engine) and (sequence bucket, tokens per row or None) of the decode step collected.
        self._step_end: float | None = None
        self._decode_step: tuple[int, float | None] | None = None
        self._compiles_at_end = 0  # the runner's compile count when _step_end was taken
        self._clock = time.perf_counter  # tests script it
        if spec is None:
            return
        if spec.cost_aware:
            self._governor = CostGovernor()
        if spec.method == "draft_model":
            spec.check_draft_vocab(self.model_config.vocab_size, self._drafter.vocab_size)
            self._drafter.reset()
        else:
            sched = self.config.scheduler
            self._proposer = NgramProposer(
                spec, max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len
            )
        self._tracker = AcceptanceTracker(spec.num_speculative_tokens)

    def _proposals(self) -> dict[int, list[int]] | None:
        """Speculative tokens for the running sequences that decode next, capped so a step
        never passes max_tokens or max_model_len. Rows with a grammar, a logit bias or
        prompt log-probabilities do not speculate."""
        if self._tracker is None:
            return None
        seqs, caps = [], []
        max_len = self.max_model_len
        for seq in self.scheduler.running:
            p = seq.params
            if seq.num_computed_tokens != seq.num_tokens - 1 or not _may_speculate(seq):
                continue
            room = max_len - seq.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            seqs.append(seq)
            caps.append(max(room, 0))
        if not seqs:
            return None
        ids = [s.seq_id for s in seqs]
        want = np.minimum(self._tracker.num_proposals(ids), caps)
        if self._speculation_off(len(seqs)):
            # A big batch, or verification loses: only seeded sampled rows speculate (their
            # tokens must not depend on the batch; a greedy row's tokens are the same either way).
            keep = [_keeps_proposals(s) for s in seqs]
            want = np.where(keep, want, 0)
        if self._drafter is not None:  # slots now, the draft's tokens once pages are known
            self._proposed = dict(zip(ids, want.tolist(), strict=True))
            return {i: [0] * int(n) for i, n in zip(ids, want) if n}
        proposals, num = self._proposer.propose(
            [s.table_row for s in seqs], ids, [s.token_ids for s in seqs], want
        )
        self._proposed = dict(zip(ids, num.tolist(), strict=True))  # for the tracker
        return {i: proposals[j, :n].tolist() for j, (i, n) in enumerate(zip(ids, num)) if n}

    def _speculation_off(self, num_decoding: int) -> bool:
        """Whether greedy and unseeded rows of a batch of num_decoding decoding sequences
        propose nothing: over disable_by_batch_size, or where the cost governor measured
        that verifying steps lose to plain ones."""
        limit = self.speculative.disable_by_batch_size
        if limit is not None and num_decoding > limit:
            return True
        governor = self._governor
        if governor is None or num_decoding == 0:
            return False
        return not governor.speculates(bucket(self.config.seq_buckets, num_decoding))

    def _note_decode_step(self, plan: StepPlan, out: SamplerOutput) -> None:
        """For the cost governor: the step's sequence bucket and tokens per row when every
        row decoded (one token, or one plus its proposals), else None."""
        self._decode_step = None
        if self._governor is None or not len(plan):
            return
        proposed = plan.num_proposed
        if proposed is None:
            if plan.decode_only:
                self._decode_step = (bucket(self.config.seq_buckets, len(plan)), None)
            return
        if not np.array_equal(plan.num_new_tokens, proposed + 1):
            return
        given = np.minimum(out.num_accepted[: len(plan)], proposed) + 1  # tokens per row
        if self._proposer is None:
            tokens = float(np.mean(given))
        else:  # n-gram: the rows' estimates, this step's included
            for seq_id, n in zip(plan.seq_ids.tolist(), given.tolist(), strict=True):
                self._note_row_tokens(seq_id, n)
            tokens = self._rows_tokens(plan)
        self._decode_step = (bucket(self.config.seq_buckets, len(plan)), tokens)

    def _note_row_tokens(self, seq_id: int, tokens: float) -> None:
        """One more observation of what verifying gives a row (its accepted count plus one)."""
        old = self._row_tokens.get(seq_id, 1.0)
        self._row_tokens[seq_id] = _ROW_DECAY * old + (1.0 - _ROW_DECAY) * tokens

    def _rows_tokens(self, plan: StepPlan) -> float:
        """What a verifying step would give the rows of plan, each on average: the mean of
        the rows' own estimates (a row not yet observed counts 1 token). Per row, so a new
        batch is judged on its own rows, not on what the batch before it copied."""
        rows = self._row_tokens
        return float(np.mean([rows.get(i, 1.0) for i in plan.seq_ids.tolist()]))

    def _time_step(self) -> None:
        """Gives the governor the seconds since the previous step was collected, for a decode
        step collected just now right after another, unless a program was compiled (or loaded
        from the compilation cache) meanwhile: one such outlier would hold a moving average
        off for many probes."""
        now = self._clock()
        compiles = self.runner.programs.num_compiles
        if (
            self._step_end is not None
            and self._decode_step is not None
            and compiles == self._compiles_at_end
        ):
            seq_bucket, tokens = self._decode_step
            self._governor.record(seq_bucket, now - self._step_end, tokens,
                                  rows_estimate=self._proposer is not None)
        self._step_end = now if self._groups else None
        self._compiles_at_end = compiles

    def _shadow_proposals(self, plan: StepPlan) -> None:
        """After a plain decode step (n-gram, cost governor on): what verifying would have
        given its rows. Each row holds one proposal made on the host from its tokens so far,
        as a verifying step would have proposed it (the tracker's count of tokens), and checks
        it against the tokens the plain steps then make: once it mismatches or is matched
        whole, a verification would have given its accepted count plus one, an observation
        of the row (_note_row_tokens). The governor then gets the rows' estimate
        (_rows_tokens); no device work, no stats."""
        if plan.num_proposed is not None or not plan.decode_only:
            return
        shadows, fresh = self._shadows, []
        for seq_id in plan.seq_ids.tolist():
            seq = self.scheduler.sequence(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                shadows.pop(seq_id, None)
                self._row_tokens.pop(seq_id, None)
                continue
            pending = shadows.get(seq_id)
            if pending is None:
                if _may_speculate(seq):
                    fresh.append(seq)
                else:
                    self._note_row_tokens(seq_id, 1)  # it would not propose: 1 token a step
                continue
            start, proposal = pending
            made = seq.token_ids[start : start + len(proposal)]
            accepted = matched_prefix(proposal, made)
            if accepted < len(made) or accepted == len(proposal):
                self._note_row_tokens(seq_id, accepted + 1)
                del shadows[seq_id]
                fresh.append(seq)
        if fresh:
            ids = [s.seq_id for s in fresh]
            proposals, num = self._proposer.propose(  # as many as a verifying step would
                [s.table_row for s in fresh], ids, [s.token_ids for s in fresh],
                self._tracker.num_proposals(ids),
            )
            for j, (seq, n) in enumerate(zip(fresh, num.tolist(), strict=True)):
                if n:
                    shadows[seq.seq_id] = (seq.num_tokens, proposals[j, :n].tolist())
                else:  # no match: a verifying step gives this row 1 token
                    self._note_row_tokens(seq.seq_id, 1)
        seq_bucket = bucket(self.config.seq_buckets, len(plan))
        self._governor.set_tokens(seq_bucket, self._rows_tokens(plan))

    def _record_acceptance(self, plan: StepPlan, out: SamplerOutput) -> None:
        """Tells the tracker what every decoding sequence proposed and had accepted."""
        proposed = self._proposed
        if not proposed:
            return
        self._proposed = {}
        ids, num, accepted = [], [], []
        verified = out.num_accepted.tolist() if out.num_accepted is not None else None
        row_proposed = plan.num_proposed.tolist() if plan.num_proposed is not None else None
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            if seq_id in proposed:
                ids.append(seq_id)
                n = row_proposed[i] if row_proposed is not None else 0
                num.append(n)
                accepted.append(min(verified[i], n) if verified is not None else 0)
        if ids:
            self._tracker.record(ids, np.asarray(num), np.asarray(accepted))

    def _recover(self, error: Exception) -> EngineStepError:
        """After a failed step: every request in the engine is dropped, the host state is made
        anew and the device state (pool, page table) re-allocated, the prefix cache with it;
        compiled programs are kept. Returns the error to raise."""
        request_ids = list(self._groups)
        logger.error(
            "engine step failed (%s: %s); %d requests failed, engine state rebuilt",
            type(error).__name__,
            error,
            len(request_ids),
        )
        self._new_host_state()
        self._init_speculation()
        self.runner.reset_state()
        self.num_recoveries += 1
        return EngineStepError(request_ids, error)

    def warm_up(self, context_len: int = 64, *, up_to: int | None = None) -> float:
        """Compiles (or loads from the executable cache) the step programs that requests of
        up to `up_to` tokens (default context_len) use first (ModelRunner.warm_up_keys), and
        runs each once on contexts of up to context_len tokens; returns the seconds it took.
        A server calls it before it reports SERVING; `jpaged chat` with up_to=max_model_len,
        so no answer meets a compile."""
        keys = self.runner.warm_up_keys(context_len if up_to is None else up_to)
        seconds = self.runner.precompile(keys, context_len)
        release_free_memory()  # what compiling and the runs freed (worker/host_memory.py)
        self.warmup_seconds += seconds
        programs = self.runner.programs
        logger.info(
            "warm-up: %d step programs in %.1fs; %s",
            programs.num_step_programs,
            seconds,
            programs.summary(),
        )
        return seconds

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queues a request. params.output_kind says what step() returns for it. With
        pooling, an embedding request (jpaged/pooling.py): params must ask for one token
        (max_tokens=1, n=1), and its finished output carries the embedding."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        text, token_ids = self.tokenize_prompt(prompt)
        unservable = self.scheduler.unservable(len(token_ids), params.n)
        if unservable is not None:  # no preemption could ever make room for it
            raise ValueError(unservable)
        pooler = None
        if pooling is not None:
            if params.max_tokens != 1 or params.n != 1:
                raise ValueError(
                    "an embedding request's sampling params must have max_tokens=1 and n=1"
                )
            pooler = Pooler(pooling, len(token_ids), self.model_config.hidden_size)
        at_cap = self.runner.refusal_at_cap(params, len(token_ids), pooling=pooler is not None)
        if at_cap is not None:  # its program cannot be compiled: only this request fails
            raise ValueError(at_cap)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        vocab = self.model_config.vocab_size
        bad = [t for t in (params.logit_bias or ()) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:  # before anything is stored
            self._constraint_manager().add((request_id, 0), params.structured_outputs)
        group = RequestGroup(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival=self._arrivals,
            cache_salt=cache_salt,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            pooler=pooler,
        )
        self._arrivals += 1
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        self._groups[request_id] = group
        self.scheduler.add(group, seed)

    def _constraint_manager(self) -> StructuredOutputManager:
        if self._constraints is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; the model has none")
            self._constraints = StructuredOutputManager(
                self.tokenizer,
                self.model_config.vocab_size,
                disable_any_whitespace=self.config.structured_outputs.disable_any_whitespace,
            )
        return self._constraints

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validates a prompt (text or token ids) -> (text or None, token ids).

        Raises ValueError naming what is wrong: empty, not text nor ids, ids outside the
        vocabulary, or too long for max_model_len.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the model has no tokenizer; pass token ids "
                    "(--prompt-token-ids on the command line)"
                )
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
                raise ValueError("prompt token ids must be integers")
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for one generated token"
            )
        return text, ids

    def chat_prompt(
        self,
        messages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> tuple[str, list[int]]:
        """A conversation rendered with the model's chat template (or chat_template) ->
        (prompt text, token ids with BOS once). Raises ValueError for a bad conversation, a
        template error, or a model without a template."""
        from models.chat_template import prompt_token_ids, render_chat

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "the model has no chat template; pass one (chat_template=..., --chat-template FILE)"
            )
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model has none")
        text = render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        return text, prompt_token_ids(self.tokenizer.backend, text, self.bos_token)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is not None:
                self.scheduler.abort(group)
                self._release(group)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Collects one device step's results. Asynchronous: the step after it is dispatched
        first (and, when none is on the device, the step itself).

        Raises:
          EngineStepError: the step failed; every request the engine held is dropped (their
            ids are on the error) and the engine is ready for new requests.
          RuntimeError: another thread is in step() or step_unsampled() (nothing is changed).
        """
        with self._sole_stepper():
            try:
                return self._step()
            except Exception as e:
                raise self._recover(e) from e

    @contextlib.contextmanager
    def _sole_stepper(self):
        """Holds the engine's step lock for one step; refuses a second thread meanwhile."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError(
                "the engine was stepped while another thread is stepping this engine; one "
                "thread owns an engine (a server's engine loop, or LLM.generate's caller)"
            )
        try:
            yield
        finally:
            self._stepping.release()

    def _step(self) -> list[RequestOutput]:
        current = self._in_flight or self._dispatch(None)
        self._in_flight = None
        if current is None:
            self._step_end = None
            return self._take_early_outputs()
        if self._can_overlap(current.plan):
            # With speculation on, only a step that proposes nothing overlaps (see
            # _proposes_nothing_after): its proposals would need the tokens still on the device.
            self._in_flight = self._dispatch(current.plan, speculate=self._tracker is None)
        outputs = self._collect(current)
        if self._governor is not None:
            self._time_step()
        if not self._groups:  # whatever is on the device belongs to finished requests
            self._in_flight = None
        return outputs

    def _dispatch(self, prev: StepPlan | None, *, speculate: bool = True) -> InFlightStep | None:
        """Schedules and dispatches a step; prev: the plan still on the device, if any;
        speculate: whether decoding rows may propose."""
        plan = self._schedule(speculate=speculate)
        if not len(plan):
            return None
        bitmask = self._bitmask(plan) if plan.sampling.constrained is not None else None
        step = self.runner.dispatch(plan, prev, bitmask, draft_probs=self._draft_probs)
        self.scheduler.dispatched(plan)
        return step

    def _bitmask(self, plan: StepPlan) -> np.ndarray:
        """The rows' structured-output masks (int32[len(plan), ceil(vocab / 32)]). A fork's
        child gets its matcher here, copied from its parent's before the parent advances."""
        manager = self._constraints
        keys = []
        for seq_id, constrained in zip(plan.seq_ids.tolist(), plan.sampling.constrained):
            seq = self.scheduler.sequence(seq_id) if constrained else None
            if seq is None:
                keys.append(None)
                continue
            key = (seq.group.request_id, seq.index)
            if key not in manager:
                manager.fork((seq.group.request_id, 0), key)
            keys.append(key)
        mask = manager.allocate_bitmask(len(plan))
        manager.fill_bitmask(keys, mask)
        return mask

    def _schedule(self, *, speculate: bool = True) -> StepPlan:
        """The next plan, its pages' peak noted and its swaps done (they precede the step);
        with a draft model, its page edits replayed on the draft and the draft's proposals
        filled in."""
        plan = self.scheduler.schedule(self._proposals() if speculate else None)
        self._draft_probs = None
        if self._drafter is not None:
            self._drafter.sync(plan)
            if plan.num_proposed is not None:
                plan, self._draft_probs = self._drafter.propose(plan, self.scheduler.sequence)
        self.peak_pages_used = max(self.peak_pages_used, self.allocator.num_used())
        self.runner.swap(plan)  # preempted K/V to host and back, before the step
        return plan

    def _can_overlap(self, plan: StepPlan) -> bool:
        """Whether the next plan may be made before plan's tokens are on the host."""
        sync = plan.sampling.uses_penalties
        if plan.sampling.constrained is not None:  # a grammar's next mask needs the token
            sync = sync | plan.sampling.constrained
        return (
            self.config.async_scheduling
            and self.runner.broadcast is None
            and (self._tracker is None or self._proposes_nothing_after(plan))
            and not np.any(sync & plan.keep_sample)
        )

    def _proposes_nothing_after(self, plan: StepPlan) -> bool:
        """Speculation on: whether the step after plan may skip proposals, so it can be made
        before plan's tokens are known (proposals and verified lengths need them). So when
        plan verified nothing and the batch is over disable_by_batch_size with no seeded
        sampled row (those always keep their proposals, see _proposals): skipping changes no
        greedy token, and only a batch that shrinks to the limit in this step loses a step's
        proposals. n-gram only (a draft model replays each committed step first)."""
        if self._drafter is not None or plan.proposals is not None:
            return False
        running = self.scheduler.running
        return self._speculation_off(len(running)) and not any(map(_keeps_proposals, running))

    def _collect(self, step: InFlightStep) -> list[RequestOutput]:
        out = self.runner.fetch(step)
        if step.plan.prompt_targets is not None:
            self._record_prompt_logprobs(step.plan, out)
        if step.plan.pools:
            self._record_pooled(step.plan, out)
        if self._tracker is not None:
            self._record_acceptance(step.plan, out)
            self._note_decode_step(step.plan, out)
        seqs = self.scheduler.commit(step.plan, out)
        if self._governor is not None and self._proposer is not None:
            self._shadow_proposals(step.plan)
        if self._drafter is not None:
            self._drafter.committed(step.plan, out, self.scheduler.sequence)
        return self._take_early_outputs() + self._outputs(seqs)

    def _record_prompt_logprobs(self, plan: StepPlan, out: SamplerOutput) -> None:
        """Appends each prompt position's log-probabilities to its request (positions already
        recorded, recomputed after a preemption, are skipped)."""
        targets = plan.prompt_targets
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self.scheduler.sequence(seq_id)
            if seq is None or seq.group.prompt_logprobs is None:
                continue
            recorded, n = seq.group.prompt_logprobs, seq.params.prompt_logprobs
            first, last = int(plan.query_start[i]), int(plan.query_start[i + 1])
            position = int(plan.starts[i]) + 1  # the prompt position the first token predicts
            for t in range(first, last):
                if targets[t] >= 0 and position == len(recorded):
                    top = zip(
                        out.prompt_top_ids[t, :n].tolist(), out.prompt_top_logprobs[t, :n].tolist()
                    )
                    recorded.append({int(targets[t]): float(out.prompt_logprobs[t]), **dict(top)})
                position += 1

    def _record_pooled(self, plan: StepPlan, out: SamplerOutput) -> None:
        """Adds each embedding row's chunk of its prompt to its request's Pooler."""
        for i, seq_id in enumerate(plan.seq_ids.tolist()):
            seq = self.scheduler.sequence(seq_id)
            if seq is not None and seq.group.pooler is not None:
                start = int(plan.starts[i])
                n = min(int(plan.num_new_tokens[i]), seq.num_prompt_tokens - start)
                if n > 0:
                    seq.group.pooler.add(start, n, out.pooled[i])

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Grammars, text and stop strings for the sequences that got tokens, then their
        requests' outputs; finished requests are forgotten."""
        touched: dict[str, RequestGroup] = {}
        for seq in seqs:
            if self._constraints is not None and seq.params.structured_outputs is not None:
                self._advance_constraint(seq)
            stop, surplus = self.output_processor.process(seq)
            if stop is not None:
                if surplus:  # a speculative step's tokens past the stop string
                    seq.drop_last_tokens(surplus)
                self.scheduler.finish(seq, "stop", stop)
            touched[seq.group.request_id] = seq.group
        outputs = []
        for rid, group in touched.items():
            out = self.output_processor.make_output(group)
            if out is not None:
                outputs.append(out)
            if group.finished:
                del self._groups[rid]
                self._release(group)
        return outputs

    def _advance_constraint(self, seq: Sequence) -> None:
        """Commits seq's new token to its grammar; a grammar that is complete (only EOS left)
        stops the sequence, one that failed ends it with finish_reason "error". A grammar
        completed by the token that reached max_tokens or max_model_len is a "stop" too:
        "length" says the output is cut short."""
        key = (seq.group.request_id, seq.index)
        manager = self._constraints
        manager.advance(key, seq.token_ids[-1:])
        error = manager.error(key)
        if seq.is_finished:
            if seq.finish_reason == "length" and manager.is_finished(key):
                self.scheduler.finish(seq, "stop")
            return
        if error is not None:
            seq.group.error = f"structured output: {error}"
            self.scheduler.finish(seq, "error")
        elif manager.is_finished(key):
            self.scheduler.finish(seq, "stop")

    def _release(self, group: RequestGroup) -> None:
        """Drops a finished or aborted request's text states, grammar matchers and
        speculation state."""
        self.output_processor.release(group)
        if self._tracker is not None:
            for seq in group.seqs:
                self._tracker.free(seq.seq_id)
                self._shadows.pop(seq.seq_id, None)
                self._row_tokens.pop(seq.seq_id, None)
                if self._drafter is not None:
                    self._drafter.forget(seq.seq_id)
        if self._constraints is not None and group.params.structured_outputs is not None:
            for index in range(max(len(group.seqs), 1)):
                self._constraints.remove((group.request_id, index))

    def _take_early_outputs(self) -> list[RequestOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- beam search: steps whose next tokens the caller chooses ---------------------------
    def step_unsampled(self) -> list[tuple[str, int, SamplerOutput, int]] | None:
        """One device step whose next tokens the caller chooses (beam search): the scheduled
        tokens are marked computed, nothing is appended and no RequestOutput is made.

        Returns (request_id, seq_id, out, row) for every running sequence whose tokens are
        all computed (out.top_ids[row], out.top_logprobs[row] are its next-token candidates),
        or None when nothing could run.

        Raises:
          RuntimeError: another thread is in step() or step_unsampled() (nothing is changed).
        """
        with self._sole_stepper():
            try:
                if self._in_flight is not None:  # its outputs go out with the next step()
                    self._early_outputs = self._collect(self._in_flight)
                    self._in_flight = None
                plan = self._schedule(speculate=False)
                if not len(plan):
                    return None
                out = self.runner.execute(plan)
            except Exception as e:
                raise self._recover(e) from e
            sampled = self.scheduler.mark_computed(plan)
        return [
            (seq.group.request_id, seq.seq_id, out, row)
            for row, seq in enumerate(sampled)
            if seq is not None
        ]

    def append_token(self, seq_id: int, token: int) -> None:
        """Appends a token the caller chose to a sequence (computed by its next step)."""
        self.scheduler.sequence(seq_id).token_ids.append(int(token))

    def fork_sequence(self, seq_id: int) -> int:
        """A new sequence of the same request with seq_id's tokens, sharing its pages;
        returns its seq_id."""
        return self.scheduler.fork(self.scheduler.sequence(seq_id)).seq_id

    def drop_sequence(self, seq_id: int) -> None:
        """Finishes one sequence of a request (a dropped beam): its pages are freed and its
        request keeps only its other sequences."""
        seq = self.scheduler.sequence(seq_id)
        self.scheduler.finish(seq, "abort")
        seq.group.seqs.remove(seq)

    def running_sequence_ids(self) -> list[int]:
        """Running sequences, oldest admission first."""
        return [s.seq_id for s in self.scheduler.running]

    def preempt_sequence(self, seq_id: int) -> None:
        """Frees a running sequence's pages; it is recomputed after the waiting ones."""
        seq = self.scheduler.sequence(seq_id)
        if seq is not None and seq.status is SeqStatus.RUNNING:
            self.scheduler.preempt(seq)

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        a, swap = self.allocator, self.scheduler.swap_allocator
        programs = self.runner.programs
        return dict(
            pages_total=a.num_usable_pages,
            pages_used=a.num_used(),
            pages_free=a.num_free(),
            pages_cached=a.num_cached(),
            peak_pages_used=self.peak_pages_used,
            prefix_cache_query_tokens=self.scheduler.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_swaps_out=self.scheduler.num_swaps_out,
            num_swaps_in=self.scheduler.num_swaps_in,
            swap_pages_total=self.num_swap_pages,
            swap_pages_used=swap.num_used() if swap is not None else 0,
            num_running=self.num_running(),
            num_waiting=self.num_waiting(),
            num_compiled=programs.num_compiled,
            num_buckets=self.runner.num_buckets(),
            num_compiles=programs.num_compiles,
            compile_seconds=programs.compile_seconds,
            num_traced=programs.num_traced,
            trace_seconds=programs.trace_seconds,
            xla_compile_seconds=programs.xla_seconds,
            num_xla_cache_hits=programs.num_xla_cache_hits,
            num_loaded=programs.num_loaded,
            load_seconds=programs.load_seconds,
            num_recompiles=programs.num_recompiles,
            num_recoveries=self.num_recoveries,
            weight_bytes=self.weight_bytes,
            quantization=self.config.quantization,
            # The pages' dtype ("int8", "float8_e4m3fn", ...; --kv-cache-dtype resolved) and
            # one token's K and V of every layer, scales included.
            kv_cache_dtype=self.kv_dtype.name,
            kv_bytes_per_token=kv_page_bytes(self.model_config, 1, 0, self.kv_dtype),
            **self._speculation_stats(),
        )

    def _speculation_stats(self) -> dict:
        """Proposed and accepted tokens and the mean acceptance length (speculation on)."""
        if self._tracker is None:
            return {}
        t = self._tracker.stats()
        return {
            "spec_num_drafts": t["spec_num_drafts"],
            "spec_num_draft_tokens": t["spec_num_draft_tokens"],
            "spec_num_accepted_tokens": t["spec_num_accepted_tokens"],
            "spec_mean_acceptance_length": t["spec_mean_acceptance_length"],
        }

    def reset_stats(self) -> None:
        self.peak_pages_used = self.allocator.num_used()
        self.scheduler.reset_stats()
        if self._tracker is not None:
            self._tracker.reset_totals()
