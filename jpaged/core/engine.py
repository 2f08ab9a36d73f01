"""LLMEngine: requests in, RequestOutputs out, one step at a time.

    step():  proposals = spec.propose(running)        # speculation (SpecController)
             plan = scheduler.schedule(proposals)     # host: which tokens (pages: KVCacheManager)
             plan = spec.before_dispatch(plan)         # a draft model's tokens
             step = runner.dispatch(plan)              # device: one jitted step, pool donated
             out = runner.fetch(step)                  # its sampled tokens on the host
             seqs = scheduler.commit(plan, out)        # host: append tokens, token-level stops
             spec.after_commit(plan, out)              # acceptance, costs, the draft's K/V
             outputs = self._outputs(seqs)             # host: grammars, text, stop strings

The engine owns the requests (RequestGroup by id) and is the only code that moves results
from one stage to the next: the output processor reports stop strings and the engine
finishes those sequences in the scheduler; nothing later calls back into an earlier stage.
Its other owners, each behind one seam: MemoryPlan (pool and resolved config, fixed before
the engine is built), InputProcessor (prompts and request checks), Scheduler (queues, rows;
its KVCacheManager: pages), SpecController (speculation), Constraints (grammars),
OutputProcessor (text), ModelRunner (the device). docs/architecture.md draws them.

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
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from jpaged.config import EngineConfig
from jpaged.core.beam_search import BeamSequences
from jpaged.core.constraints import Constraints
from jpaged.core.host_page_store import host_stats
from jpaged.core.input_processor import InputProcessor
from jpaged.core.memory_plan import MemoryPlan, host_page_store, kv_page_bytes, plan_memory
from jpaged.core.output_processor import OutputProcessor, record_pooled, record_prompt_logprobs
from jpaged.core.page_allocator import PageAllocator
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import RequestGroup, Sequence
from jpaged.lora import LoRAManager, LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.pooling import PoolingParams, sentence_transformers_pooling
from jpaged.sample.sampler import SamplerOutput
from jpaged.sample.sampling_params import SamplingParams
from jpaged.spec_decode.controller import SpecController
from jpaged.spec_decode.draft_model import DraftModel, load_draft
from jpaged.tokenizer import Tokenizer
from jpaged.worker import compilation_cache, executable_cache
from jpaged.worker.host_memory import release_free_memory
from jpaged.worker.model_loading import load_for_config
from jpaged.worker.runner import InFlightStep, ModelRunner
from jpaged.worker.step_plan import StepPlan
from models import quantization
from models.config import ModelConfig

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step failed; the engine dropped that step's requests (request_ids), made its device
    state anew and kept every other request (computed again from its tokens), so it serves
    on. The original error is __cause__."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(
            f"engine step failed ({type(error).__name__}: {error}); {len(request_ids)} "
            "request(s) dropped, engine state rebuilt"
        )
        self.request_ids = request_ids
        self.outputs: list[RequestOutput] = []  # other replicas' outputs of the same step


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


def _make_runner(memory: MemoryPlan, loaded, dtype, cache_dir) -> ModelRunner:
    """The device side: the model's params, the pool of memory.num_pages pages, the compiled
    programs (and, across processes, the step broadcast)."""
    broadcast = None
    if loaded.mesh is not None and jax.process_count() > 1:
        from jpaged.worker.multihost import StepBroadcast

        broadcast = StepBroadcast(loaded.mesh)
    return ModelRunner(
        memory.config,
        loaded.config,
        loaded.params,
        memory.num_pages,
        dtype,
        mesh=loaded.mesh,
        num_swap_pages=memory.num_swap_pages,
        broadcast=broadcast,
        cache_dir=cache_dir,
        kv_groups=memory.kv_groups if memory.kv_groups.grouped else None,
        **({"lora_config": memory.config.lora} if memory.config.lora.enable_lora else {}),
    )


@contextlib.contextmanager
def _sole(lock: threading.Lock):
    """Holds an engine's step lock for one step; refuses a second thread meanwhile."""
    if not lock.acquire(blocking=False):
        raise RuntimeError(
            "the engine was stepped while another thread is stepping this engine; one "
            "thread owns an engine (a server's engine loop, or LLM.generate's caller)"
        )
    try:
        yield
    finally:
        lock.release()


class LLMEngine:
    def __init__(self, config: EngineConfig, *, loaded=None) -> None:
        t0 = time.perf_counter()
        self.compilation_cache_dir = compilation_cache.enable(
            config.compilation_cache_dir, jax_cache=not executable_cache.wanted()
        )
        if loaded is None:
            loaded = load_for_config(config)  # sharded when config.parallel asks for it
        self.model_config: ModelConfig = loaded.config
        # Resident bytes of the params (quantized weights: values and scales).
        self.weight_bytes: int = quantization.weight_bytes(loaded.params)
        self.platform: str = jax.default_backend()  # "cpu", "gpu", "tpu"
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.tokenizer = (
            Tokenizer(loaded.tokenizer, self.eos_token_ids)
            if loaded.tokenizer is not None
            else None
        )
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
        pooling = sentence_transformers_pooling(path) if path.is_dir() else None
        self.default_pooling = pooling or PoolingParams()
        dtype = quantization.activation_dtype(loaded.params)
        draft = load_draft(config, dtype)
        memory = plan_memory(
            config, self.model_config, dtype, self.platform,
            draft_config=None if draft is None else draft.config,
        )  # fmt: skip
        self.config = config = memory.config
        self.max_model_len = config.scheduler.max_model_len
        # Prompt and request checks, before anything about a request is stored.
        self.inputs = InputProcessor(
            self.tokenizer, vocab_size=self.model_config.vocab_size,
            hidden_size=self.model_config.hidden_size, max_model_len=self.max_model_len,
            chat_template=self.chat_template, bos_token=self.bos_token, eos_token=self.eos_token,
        )  # fmt: skip
        self.kv_dtype, self.kv_groups = memory.kv_dtype, memory.kv_groups
        self.num_pages, self.num_swap_pages = memory.num_pages, memory.num_swap_pages
        self.runner = _make_runner(memory, loaded, dtype, self.compilation_cache_dir)
        self._new_host_state()  # after the runner: the scheduler asks it what it admits
        self._arrivals = 0
        drafter = None
        if draft is not None:
            if self.runner.broadcast is not None:
                raise ValueError("a draft model is not supported across processes")
            drafter = DraftModel(config, draft, self.num_pages, self.eos_token_ids)
        # Speculative decoding's policy and per-sequence state (jpaged/spec_decode/controller.py).
        self.spec = SpecController(config, vocab_size=self.model_config.vocab_size, drafter=drafter)
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
        # LoRA adapters' host state and device slots (jpaged/lora), None without --enable-lora.
        lora = config.lora
        self.loras = LoRAManager(lora, self.model_config) if lora.enable_lora else None
        self.allocator = PageAllocator(
            self.num_pages, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        # Host pages: the prefix cache's host tier and swap space, one store.
        self.host_store = host_page_store(
            config, self.model_config, self.num_swap_pages, self.kv_dtype, self.runner.swap_space
        )
        self.scheduler = Scheduler(
            config,
            self.allocator,
            self.eos_token_ids,
            swap_allocator=self.host_store,
            group_windows=self.kv_groups.windows,
            admits=self.runner.admits,  # at Linux's mapping cap: batches a program holds
            loras=self.loras,  # adapters wait for a device slot at admission
            host_store=self.host_store,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs: one matcher per constrained sequence (jpaged/core/constraints.py).
        self.constraints = Constraints(
            self.tokenizer, self.model_config.vocab_size,
            disable_any_whitespace=config.structured_outputs.disable_any_whitespace,
        )  # fmt: skip
        # Beam search's hold on the sequences (jpaged/core/beam_search.py).
        self.beams = BeamSequences(self.scheduler)
        self._groups: dict[str, RequestGroup] = {}
        # The step on the device whose results the next step() call collects (async only).
        self._in_flight: InFlightStep | None = None
        self._step_plans: list[StepPlan] = []  # the plans of the step() call running
        self._early_outputs: list[RequestOutput] = []  # collected outside step()

    def _recover(self, error: Exception) -> EngineStepError:
        """After a failed step: the requests with a row in the plans this call built or
        collected fail (all running ones when it failed before any plan was made); every
        other request stays and is computed again from its tokens (the device state, pool,
        page table and the prefix cache with it, is made anew; compiled programs are kept).
        Returns the error to raise, naming the failed requests."""
        sched = self.scheduler
        failed = sched.request_ids(self._step_plans) or sched.request_ids_running()
        request_ids = [rid for rid in self._groups if rid in failed or not failed]
        logger.error(
            "engine step failed (%s: %s); %d requests failed, %d kept",
            type(error).__name__,
            error,
            len(request_ids),
            len(self._groups) - len(request_ids),
        )
        for rid in request_ids:
            group = self._groups.pop(rid)
            sched.abort(group)
            self._release(group)
        sched.restart()
        if self.loras is not None:
            self.loras.restart()
        self._in_flight = None
        self.spec = self.spec.renewed()
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
        lora_request: LoRARequest | None = None,
        session: str | None = None,
    ) -> None:
        """Queues a request (of `session`: jpaged/core/session_pages.py). params.output_kind
        says what step() returns for it. With pooling, an embedding request
        (jpaged/pooling.py): params must ask for one token (max_tokens=1, n=1), and its
        finished output carries the embedding. lora_request:
        the adapter it runs on (LoRAError, a ValueError, if it cannot be read)."""
        adapter = None
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request given but LoRA is not enabled (enable_lora)")
            adapter = self.loras.resolve(lora_request)
        text, token_ids, pooler = self.inputs.validate(
            request_id, prompt, params, cache_salt=cache_salt, pooling=pooling, session=session,
            in_use=isinstance(request_id, str) and request_id in self._groups, unservable=self.scheduler.unservable,
            refusal_at_cap=self.runner.refusal_at_cap,
        )  # fmt: skip
        if params.structured_outputs is not None:  # before anything is stored
            self.constraints.add(request_id, params.structured_outputs)
        group = RequestGroup(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival=self._arrivals,
            cache_salt=LoRAManager.salt(cache_salt, adapter),  # no prefix hit across adapters
            session=session,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            pooler=pooler,
        )
        if adapter is not None:
            self.loras.attach(group, adapter)
        self._arrivals += 1
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        self._groups[request_id] = group
        self.scheduler.add(group, seed)

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validates a prompt (text or token ids) -> (text or None, token ids)
        (InputProcessor.tokenize_prompt)."""
        return self.inputs.tokenize_prompt(prompt)

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
        (prompt text, token ids with BOS once) (InputProcessor.chat_prompt)."""
        return self.inputs.chat_prompt(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra,
        )  # fmt: skip

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
          EngineStepError: the step failed; the requests with a row in its plans are dropped
            (their ids are on the error), the others are kept and computed again, and the
            engine serves on.
          RuntimeError: another thread is in step() or step_unsampled() (nothing is changed).
        """
        with _sole(self._stepping):
            try:
                return self._step()
            except Exception as e:
                raise self._recover(e) from e

    def _step(self) -> list[RequestOutput]:
        self._step_plans = [] if self._in_flight is None else [self._in_flight.plan]
        current = self._in_flight or self._dispatch(None)
        self._in_flight = None
        if current is None:
            self.spec.idle()
            return self._take_early_outputs()
        if self._can_overlap(current.plan):
            # With speculation on, only a step that proposes nothing overlaps (see
            # _proposes_nothing_after): its proposals would need the tokens still on the device.
            self._in_flight = self._dispatch(current.plan, speculate=not self.spec.enabled)
        outputs = self._collect(current)
        self.spec.step_collected(bool(self._groups), self.runner.programs.num_compiles)
        if not self._groups:  # whatever is on the device belongs to finished requests
            self._in_flight = None
        return outputs

    def _dispatch(self, prev: StepPlan | None, *, speculate: bool = True) -> InFlightStep | None:
        """Schedules and dispatches a step; prev: the plan still on the device, if any;
        speculate: whether decoding rows may propose."""
        plan, draft_probs = self._schedule(speculate=speculate)
        if not len(plan):
            return None
        bitmask = None
        if plan.constrained is not None:
            bitmask = self.constraints.bitmask(plan, self.scheduler.sequence)
        step = self.runner.dispatch(plan, prev, bitmask, draft_probs=draft_probs)
        self.scheduler.dispatched(plan)
        if self.host_store is not None:  # the disk tier's files, while the device computes
            self.host_store.write_through()
        return step

    def _schedule(self, *, speculate: bool = True) -> tuple[StepPlan, object]:
        """The next plan and its draft probabilities (a draft model's proposals, else None),
        its pages' peak noted and its swaps done (they precede the step)."""
        running = self.scheduler.running
        plan = self.scheduler.schedule(self.spec.propose(running) if speculate else None)
        self._step_plans.append(plan)  # its requests fail if this call fails (_recover)
        plan, draft_probs = self.spec.before_dispatch(plan, self.scheduler.sequence)
        self.peak_pages_used = max(self.peak_pages_used, self.allocator.num_used())
        self.runner.swap(plan)  # preempted K/V to host and back, before the step
        return plan, draft_probs

    def _can_overlap(self, plan: StepPlan) -> bool:
        """Whether the next plan may be made before plan's tokens are on the host."""
        sync = plan.uses_penalties
        if plan.constrained is not None:  # a grammar's next mask needs the token
            sync = sync | plan.constrained
        return (
            self.config.async_scheduling
            and self.runner.broadcast is None
            and self.spec.may_overlap(plan, self.scheduler.running)
            and not np.any(sync & plan.keep_sample)
        )

    def _collect(self, step: InFlightStep) -> list[RequestOutput]:
        out = self.runner.fetch(step)
        if step.plan.prompt_targets is not None:
            record_prompt_logprobs(step.plan, out, self.scheduler.sequence)
        if step.plan.pools:
            record_pooled(step.plan, out, self.scheduler.sequence)
        seqs = self.scheduler.commit(step.plan, out)
        sched = self.scheduler
        self.spec.after_commit(step.plan, out, sched.running_sequence, sched.sequence)
        return self._take_early_outputs() + self._outputs(seqs)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Grammars, text and stop strings for the sequences that got tokens, then their
        requests' outputs; finished requests are forgotten."""
        touched: dict[str, RequestGroup] = {}
        for seq in seqs:
            self.constraints.advance(seq, self.scheduler.finish)
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

    def _release(self, group: RequestGroup) -> None:
        """Drops a finished or aborted request's text states, grammar matchers and
        speculation state."""
        self.output_processor.release(group)
        self.spec.release([seq.seq_id for seq in group.seqs])
        self.constraints.release(group)
        if self.loras is not None:
            self.loras.release(group)

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

    # -- beam search: steps whose next tokens the caller chooses (self.beams edits them) ---
    def step_unsampled(self) -> list[tuple[str, int, SamplerOutput, int]] | None:
        """One device step whose next tokens the caller chooses (beam search): the scheduled
        tokens are marked computed, nothing is appended and no RequestOutput is made.

        Returns (request_id, seq_id, out, row) for every running sequence whose tokens are
        all computed (out.top_ids[row], out.top_logprobs[row] are its next-token candidates),
        or None when nothing could run.

        Raises:
          RuntimeError: another thread is in step() or step_unsampled() (nothing is changed).
        """
        with _sole(self._stepping):
            try:
                self._step_plans = [] if self._in_flight is None else [self._in_flight.plan]
                if self._in_flight is not None:  # its outputs go out with the next step()
                    self._early_outputs = self._collect(self._in_flight)
                    self._in_flight = None
                plan, _ = self._schedule(speculate=False)
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
            **self.spec.stats(),
            **(self.loras.stats() if self.loras is not None else {}),
            **host_stats(self.host_store, self.runner.swap_seconds, self.runner.num_swap_steps),
        )

    def reset_stats(self) -> None:
        self.peak_pages_used = self.allocator.num_used()
        self.scheduler.reset_stats()
        self.spec.reset_stats()
        self.runner.swap_seconds, self.runner.num_swap_steps = 0.0, 0
        if self.host_store is not None:
            self.host_store.reset_stats()
