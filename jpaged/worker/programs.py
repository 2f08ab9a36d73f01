"""Device programs: the jitted step, the page-table prelude and the swap copies.

Pure functions over explicit pytrees, the state donated:

    step(params, state, inputs, prev_tokens) -> (SamplerOutput, tokens, state)
    prelude(state, updates, copies) -> state                 # overflow of a step's page edits
    gather_pages(state, ids) -> pages                          # swap out
    scatter_pages(state, ids, pages) -> state                  # swap in

prev_tokens (int32[max_num_seqs]) are the previous step's sampled tokens, still on the device:
a decode token the host does not know yet is read from them (inputs.src_rows). `tokens` is
this step's sampled tokens padded to max_num_seqs, the next step's prev_tokens.

`Programs` compiles them ahead of time, one executable per StepKey, and counts every
compilation (with its seconds). Under a mesh (tensor parallelism, models/sharding.py) each
body runs inside one shard_map over the replica's devices: params and pools arrive as shards
(pools split over KV heads), step inputs and the page table are replicated, the logits are
all-gathered and every device samples the same tokens; still one jit, with explicit in/out
shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.sample.logits_processors import apply_logit_bias, apply_token_bitmask
from jpaged.sample.rejection_sampler import draft_sample, verify
from jpaged.sample.sampler import SamplerOutput, prompt_logprobs, sample
from jpaged.worker.executable_cache import ExecutableCache, cache_key
from jpaged.worker.map_count import MapBudget, MapCountError
from jpaged.worker.step_inputs import StepInputs, StepKey
from models import lora, sharding
from models.config import ModelConfig
from models.kv_groups import KVGroups
from models.llama import (
    compute_logits,
    forward,
    stack_layers,
    switch_layers,
    switches_layers,
    unstack_layers,
)
from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedPages

logger = logging.getLogger(__name__)

# JAX's persistent-cache hits in this process (jax.monitoring), for Programs' counts.
_XLA_CACHE_HITS = [0]


def _count_xla_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _XLA_CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_xla_cache_hit)


PRELUDE_UPDATES = 256  # page-table updates per prelude call (overflow of a step's share)
PRELUDE_COPIES = 64
SWAP_PAGES = 32  # pages per swap call: one compiled gather and one scatter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    # K and V of every layer: [num_kv_heads, slots * num_pages, page_size, head_dim], slots
    # the layers one page id holds (num_layers, or a paging group's: models/kv_groups.py);
    # slot j's page p is physical page j * num_pages + p (models/llama.py forward). With a
    # quantized --kv-cache-dtype each is a kv_quant.QuantizedPages (rows and their scales,
    # both indexed by page on axis 1): every copy below moves both with jax.tree.map.
    k_pages: jax.Array | QuantizedPages
    v_pages: jax.Array | QuantizedPages
    # int32[G * (max_num_seqs + 1), max_pages_per_seq]: group g's row r at g * (max_num_seqs
    # + 1) + r (G paging groups; one: the plain table); row max_num_seqs of each is scratch.
    page_table: jax.Array

    @property
    def kv_pages(self) -> tuple[jax.Array, jax.Array]:
        return self.k_pages, self.v_pages


def every_layer(pages, num_layers: int, num_pages: int):
    """int32[len(pages)] page ids -> int32[num_layers * len(pages)]: each page in every
    slot's part of the pool, slot-major (num_layers: the pool's slots per page)."""
    offsets = jnp.arange(num_layers, dtype=pages.dtype)[:, None] * num_pages
    return (pages[None, :] + offsets).reshape(-1)


def _copy_pages(k_pages, v_pages, copies, num_layers: int):
    """Copy-on-write copies int32[C, 2] (src, dst) of every layer's page."""
    num_pages = k_pages.shape[1] // num_layers
    src = every_layer(copies[:, 0], num_layers, num_pages)
    dst = every_layer(copies[:, 1], num_layers, num_pages)
    copy = lambda a: a.at[:, dst].set(a[:, src])
    pools = (k_pages, v_pages)
    copy_all = lambda pools: jax.tree.map(copy, pools)
    if jax.default_backend() != "cpu":
        return copy_all(pools)
    # XLA:CPU gathers and scatters every listed page even when all are padding (the null
    # page onto itself): 4% of SmolLM2's decode step at batch 32 (issue 53); most copy none.
    return jax.lax.cond(jnp.any(copies[:, 0] != copies[:, 1]), copy_all, lambda p: p, pools)


def _apply_updates(page_table, updates):
    return page_table.at[updates[:, 0], updates[:, 1]].set(updates[:, 2])


def prelude(state: DeviceState, updates, copies, *, num_layers: int) -> DeviceState:
    """updates int32[U, 3] (row, column, page), copies int32[C, 2] (src, dst)."""
    k, v = _copy_pages(state.k_pages, state.v_pages, copies, num_layers)
    return DeviceState(k, v, _apply_updates(state.page_table, updates))


def gather_pages(state: DeviceState, ids, *, num_layers: int):
    """ids int32[n] -> [2, num_kv_heads, num_layers * n, page_size, head_dim]: K and V of
    each page in every layer, layer-major (the host swap space's layout); a quantized pool's
    as QuantizedPages of [2, ...] rows and scales (the scales travel with their pages)."""
    every = every_layer(ids, num_layers, state.k_pages.shape[1] // num_layers)
    return jax.tree.map(lambda k, v: jnp.stack([k[:, every], v[:, every]]),
                        state.k_pages, state.v_pages)


def scatter_pages(state: DeviceState, ids, pages, *, num_layers: int) -> DeviceState:
    """Writes pages (gather_pages' layout) into the pool at ids, in every layer."""
    every = every_layer(ids, num_layers, state.k_pages.shape[1] // num_layers)
    k = jax.tree.map(lambda a, p: a.at[:, every].set(p[0]), state.k_pages, pages)
    v = jax.tree.map(lambda a, p: a.at[:, every].set(p[1]), state.v_pages, pages)
    return DeviceState(k, v, state.page_table)


def step(
    params,
    state: DeviceState,
    inputs: StepInputs,
    prev_tokens,
    *,
    model_config: ModelConfig,
    key: StepKey,
    backend: str | None,
    kv_groups: KVGroups | None = None,
    tp_axis=None,
):
    src = inputs.src_rows
    token_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], inputs.token_ids)
    page_table = _apply_updates(state.page_table, inputs.page_updates)
    k_pages, v_pages = state.k_pages, state.v_pages
    as_bits = _gathers_on_cpu(backend)
    if as_bits:  # float8 / bfloat16 pages moved as their bits (kv_quant.PoolBits)
        k_pages, v_pages = kv_quant.to_bits(k_pages), kv_quant.to_bits(v_pages)
    kv_pages = _copy_pages(k_pages, v_pages, inputs.page_copies, _slots(model_config, kv_groups))
    num_groups = kv_groups.num_groups if kv_groups is not None else 1
    if num_groups == 1:
        table = page_table[inputs.table_rows, : key.num_page_cols]  # [S, P]
    else:  # [G, S, P]: each group's block of rows
        stride = page_table.shape[0] // num_groups
        blocks = stride * jnp.arange(num_groups, dtype=jnp.int32)
        rows = inputs.table_rows[None, :] + blocks[:, None]
        table = page_table[rows, : key.num_page_cols]
    lora_step = None  # each token's adapter slot (from its row's) and the step's slots
    if key.lora_width:  # models/lora.py; width 0: no LoRA work
        slots = lora.token_slots(inputs.lora_slots, inputs.query_start, key.num_tokens)
        lora_step = lora.make_step(slots, inputs.lora_ids, lora.num_slots_of(params))
    hidden, kv_pages = forward(
        params,
        model_config,
        kv_pages,
        token_ids,
        inputs.positions,
        inputs.slot_mapping,
        inputs.context_lens,
        table,
        inputs.query_start,
        kv_groups=kv_groups,
        decode_only=key.decode_only,
        max_query_len=key.spec_k + 1 if key.spec_k else None,
        attention_backend=backend,
        tp_axis=tp_axis,
        lora_slots=lora_step,
    )
    if key.draft:
        logits = compute_logits(params, model_config, hidden[inputs.logits_indices], tp_axis)
        tokens, probs = draft_sample(logits, inputs.sampling, inputs.draft_offset)
        out = SamplerOutput(tokens, jnp.zeros(tokens.shape, jnp.float32), None, None)
        out = out._replace(draft_probs=probs)
    elif key.spec_k:
        out = _verify(params, model_config, hidden, inputs, key, tp_axis)
    else:
        # The real rows come first, each with a context; the bucket's padding rows have none.
        rows = jnp.sum(inputs.context_lens > 0, dtype=jnp.int32)
        logits = compute_logits(
            params, model_config, hidden[inputs.logits_indices], tp_axis, valid=rows
        )
        out = sample(logits, inputs.sampling, num_logprobs=key.num_logprobs)
    if key.prompt_logprobs:  # the LM head over every token of the step
        all_logits = compute_logits(params, model_config, hidden, tp_axis)
        lp, top_ids, top_lp = prompt_logprobs(all_logits, inputs.prompt_targets)
        out = out._replace(prompt_logprobs=lp, prompt_top_ids=top_ids, prompt_top_logprobs=top_lp)
    if key.pooling:
        out = out._replace(pooled=_pooled(hidden, inputs.query_start))
    # jnp.pad, not .at[:num_seqs].set(): when num_seqs is the whole length, that scatter's
    # index array is a zero-size constant, and jax 0.11's CPU compiler crashes on a zero-size
    # constant inside shard_map (tests/parallel/test_zero_size_constant.py).
    tokens = jnp.pad(out.tokens, (0, prev_tokens.shape[0] - key.num_seqs))
    if as_bits:
        kv_pages = tuple(map(kv_quant.from_bits, kv_pages))
    return out, tokens, DeviceState(*kv_pages, page_table)


def _gathers_on_cpu(backend: str | None) -> bool:
    """Whether the step's attention reads pages by XLA:CPU gathers (the reference on the
    CPU): XLA:CPU gathers and scatters float8 and bfloat16 through float16 copies of the
    whole pool, so such a step moves the pool's bytes as integers (kv_quant.PoolBits)."""
    return jax.default_backend() == "cpu" and backend != "pallas_interpret"


def _slots(model_config: ModelConfig, kv_groups: KVGroups | None) -> int:
    """The pool's layers per page id."""
    return model_config.num_layers if kv_groups is None else kv_groups.slots_per_page


def _pooled(hidden: jax.Array, query_start: jax.Array) -> jax.Array:
    """float32[S, 3, D] of hidden [T, D] and the rows' query_start [S + 1]: each row's sum
    of its tokens' hidden states, its first token's and its last's (jpaged/pooling.py adds
    them up over a prompt's chunks). Rows without tokens get zeros and arbitrary first/last
    rows; nothing reads them."""
    h = hidden.astype(jnp.float32)
    num_tokens, num_rows = h.shape[0], query_start.shape[0] - 1
    row_of = jnp.searchsorted(query_start[1:], jnp.arange(num_tokens), side="right")  # [T]
    sums = jax.ops.segment_sum(h, row_of, num_segments=num_rows + 1)[:num_rows]  # padding: row S
    first = h[jnp.clip(query_start[:-1], 0, num_tokens - 1)]
    last = h[jnp.clip(query_start[1:] - 1, 0, num_tokens - 1)]
    return jnp.stack([sums, first, last], axis=1)


def _verify(params, model_config, hidden, inputs: StepInputs, key: StepKey, tp_axis):
    """A speculative step's sampling: the target's logits after each row's last token and
    after each proposal, then rejection sampling (jpaged/sample/rejection_sampler.py). A row's
    grammar mask and logit bias apply at every position (rows with either never propose)."""
    num_seqs, width = inputs.logits_indices.shape
    flat = hidden[inputs.logits_indices.reshape(-1)]
    logits = compute_logits(params, model_config, flat, tp_axis)  # [S * (K+1), V]
    sampling = inputs.sampling
    rows = jnp.repeat(jnp.arange(num_seqs), width)
    if sampling.token_bitmask is not None:
        logits = jax.lax.cond(
            sampling.use_bitmask,
            lambda x: apply_token_bitmask(x, sampling.token_bitmask[rows]),
            lambda x: x,
            logits,
        )
    if sampling.bias_ids is not None:
        logits = apply_logit_bias(logits, sampling.bias_ids[rows], sampling.bias_values[rows])
    v = verify(
        logits.reshape(num_seqs, width, -1),
        inputs.proposals,
        inputs.num_proposed,
        sampling,
        inputs.draft_probs if key.spec_draft else None,
        num_banned_positions=sampling.num_banned_positions,
        num_logprobs=key.num_logprobs,
    )
    return SamplerOutput(
        tokens=v.tokens[:, 0],
        logprobs=v.logprobs[:, 0],
        top_ids=v.top_ids,
        top_logprobs=v.top_logprobs,
        num_accepted=v.num_accepted,
        spec_tokens=v.tokens,
        spec_logprobs=v.logprobs,
    )


class Programs:
    """Compiles and keeps one replica's device programs; counts compilations.

    Args:
      model_config: the model the step runs.
      attention_backend: EngineConfig.attention_backend.
      mesh: the replica's Mesh params are sharded over, or None for one device.
      scan_layers: whether the layers run under lax.scan (params["layers"] stacked, or on
        the CPU a tuple of per-layer dicts: models/llama.py switch_layers) or unrolled (a
        list); it sets the params' layout and sharding specs, forward follows the params.
      kv_groups: the layers' paging groups (models/kv_groups.py); None: one group.
      lora: the params carry LoRA slots (models/lora.py; under a mesh, sharding.lora_specs).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        attention_backend: str | None,
        mesh=None,
        *,
        scan_layers: bool = True,
        cache_dir: str | None = None,
        kv_groups: KVGroups | None = None,
        lora: bool = False,
    ):
        self.model_config = model_config
        self.kv_groups = kv_groups
        self.num_slots = _slots(model_config, kv_groups)
        self.scan_layers = scan_layers
        self.switch_layers = scan_layers and switches_layers(
            model_config, jax.default_backend(), sharded=mesh is not None
        )
        self.attention_backend = attention_backend
        self.mesh = mesh
        self._steps: dict[StepKey, object] = {}
        self._prelude = None
        self._swappers = None
        self._lora_writer = None
        # Every program made ready (traced and compiled, or loaded from the executable cache),
        # the prelude and swap copies included, and the seconds it took; the split below.
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_traced = 0  # traced and lowered from Python, then compiled by XLA
        self.trace_seconds = 0.0
        self.xla_seconds = 0.0  # XLA's compiles (or reads of JAX's persistent cache)
        self.num_xla_cache_hits = 0  # of those compiles, served by JAX's persistent cache
        self.num_loaded = 0  # loaded from the executable cache: no tracing, no compile
        self.load_seconds = 0.0
        self.executables = ExecutableCache(
            None if cache_dir is None else Path(cache_dir) / "jpaged-executables"
        )
        self.warmed_up = False  # set after warm-up: a new step program then is a recompile
        self.num_recompiles = 0
        self.map_budget = MapBudget()  # Linux's cap on mappings: an error, not an abort
        if mesh is not None:
            self.state_specs = DeviceState(sharding.POOL_SPEC, sharding.POOL_SPEC, P())
            self.param_specs = sharding.param_specs(
                model_config, sharding.tp_size(mesh), stacked=scan_layers, lora=lora
            )

    def layout_params(self, params):
        """params (either layers layout, models/config.py) in the layout the programs run:
        stacked under scan_layers (moved layer by layer, each on its sharding; on the CPU a
        tuple, switch_layers), else a list.
        Under a mesh, param_specs then matches them (quantized params: sharding.specs_for)."""
        if self.switch_layers:
            return switch_layers(params)
        if self.mesh is None:
            return stack_layers(params) if self.scan_layers else unstack_layers(params)
        if self.scan_layers:
            specs = self.param_specs["layers"]

            def place(name, a):
                spec = sharding.specs_for(specs[name], a, self.mesh)
                return jax.device_put(a, self._named(spec))

            params = stack_layers(params, place=place)
        else:
            params = unstack_layers(params)
        self.param_specs = sharding.specs_for(self.param_specs, params, self.mesh)
        return params

    @property
    def num_step_programs(self) -> int:
        return len(self._steps)

    @property
    def num_compiled(self) -> int:
        swap = 2 if self._swappers is not None else 0
        writer = self._lora_writer is not None
        return len(self._steps) + (self._prelude is not None) + swap + writer

    def step_keys(self) -> list[StepKey]:
        return list(self._steps)

    def compile_refusal(self, what: str) -> MapCountError | None:
        """The error compiling `what` now would meet at Linux's mapping cap (MapBudget), or
        None when there is room for one more compile."""
        try:
            self.map_budget.check(what)
        except MapCountError as e:
            return e
        return None

    def executable(self, key: StepKey):
        return self._steps.get(key)

    # -- state -----------------------------------------------------------------------------
    def init_state(self, num_pages: int, page_size: int, table_shape, dtype) -> DeviceState:
        """A zero pool (num_pages per slot) and page table (made in place on every device
        under a mesh)."""
        cfg = self.model_config
        shape = (cfg.num_kv_heads, self.num_slots * num_pages, page_size, cfg.head_dim)

        def zeros():  # kv_quant.zeros: QuantizedPages for an int8/fp8 dtype
            return DeviceState(
                kv_quant.zeros(shape, dtype), kv_quant.zeros(shape, dtype),
                jnp.zeros(table_shape, jnp.int32),
            )

        if self.mesh is None:
            return zeros()
        return jax.jit(zeros, out_shardings=self._named(self._state_specs(dtype)))()

    def zeros(self, n: int):
        """int32[n] zeros (replicated under a mesh): the first step's prev_tokens."""
        if self.mesh is None:
            return jnp.zeros(n, jnp.int32)
        return jax.jit(
            lambda: jnp.zeros(n, jnp.int32), out_shardings=NamedSharding(self.mesh, P())
        )()

    # -- compilation -----------------------------------------------------------------------
    def _identity(self) -> str:
        """What makes two programs of one name and argument shapes differ."""
        mesh = None
        if self.mesh is not None:
            mesh = (tuple(self.mesh.shape.items()), [d.id for d in self.mesh.devices.flat])
        identity = (self.model_config, self.attention_backend, self.scan_layers, mesh)
        if self.switch_layers:  # the programs of the stacked layout's identity stay valid
            identity = (*identity, "switched")
        return repr(identity if self.kv_groups is None else (*identity, self.kv_groups))

    def _compiled(self, fn, *args, name: str):
        """fn's executable for args: loaded from the executable cache when it holds one,
        else traced, lowered and compiled (and stored)."""
        before = self.map_budget.check(name)
        t0 = time.perf_counter()
        key = cache_key(name, self._identity(), args) if self.executables.enabled else None
        exe = None if key is None else self.executables.load(key, name)
        if exe is not None:
            seconds = time.perf_counter() - t0
            self.num_loaded += 1
            self.load_seconds += seconds
            logger.debug("loaded %s from the executable cache in %.2fs", name, seconds)
        else:
            hits = _XLA_CACHE_HITS[0]
            lowered = fn.lower(*args)
            t1 = time.perf_counter()
            exe = lowered.compile()
            t2 = time.perf_counter()
            seconds = t2 - t0
            from_jax_cache = _XLA_CACHE_HITS[0] - hits
            self.num_traced += 1
            self.trace_seconds += t1 - t0
            self.xla_seconds += t2 - t1
            self.num_xla_cache_hits += from_jax_cache
            logger.debug("compiled %s in %.2fs (tracing %.2fs)", name, seconds, t1 - t0)
            if key is not None and not from_jax_cache:  # see executable_cache's docstring
                self.executables.store(key, exe)
        self.map_budget.record(before)
        self.num_compiles += 1
        self.compile_seconds += seconds
        return exe

    def summary(self) -> str:
        """One line of where the programs came from and the seconds each way took."""
        return (
            f"{self.num_compiles} programs: {self.num_traced} traced and compiled "
            f"(tracing {self.trace_seconds:.1f}s, XLA {self.xla_seconds:.1f}s, "
            f"{self.num_xla_cache_hits} from JAX's compilation cache), {self.num_loaded} "
            f"loaded from the executable cache ({self.load_seconds:.1f}s)"
        )

    def step(self, key: StepKey, params, state, inputs, prev_tokens):
        """The step executable of key, compiled on first use."""
        exe = self._steps.get(key)
        if exe is None:
            if self.warmed_up:
                logger.warning("compiling a new step shape after warm-up: %s", key)
                self.num_recompiles += 1
            body = functools.partial(
                step,
                model_config=self.model_config,
                key=key,
                backend=self.attention_backend,
                kv_groups=self.kv_groups,
            )
            if self.mesh is None:
                fn = jax.jit(body, donate_argnums=(1,))
            else:
                fn = self._sharded_jit(
                    functools.partial(body, tp_axis=sharding.TP),
                    in_specs=(self.param_specs, self.state_specs, P(), P()),
                    out_specs=(P(), P(), self.state_specs),
                    donate=1,
                )
            exe = self._compiled(fn, params, state, inputs, prev_tokens, name=str(key))
            self._steps[key] = exe
        return exe

    def prelude(self, state):
        if self._prelude is None:
            updates = np.zeros((PRELUDE_UPDATES, 3), np.int32)
            copies = np.zeros((PRELUDE_COPIES, 2), np.int32)
            body = functools.partial(prelude, num_layers=self.num_slots)
            if self.mesh is None:
                fn = jax.jit(body, donate_argnums=(0,))
            else:
                specs = self.state_specs
                fn = self._sharded_jit(body, in_specs=(specs, P(), P()), out_specs=specs, donate=0)
            self._prelude = self._compiled(fn, state, updates, copies, name="prelude")
        return self._prelude

    def swappers(self, state, page_shape: tuple[int, ...], dtype):
        """(gather, scatter) of SWAP_PAGES pages at a time, compiled once each; page_shape:
        (num_kv_heads, page_size, head_dim) of one page of one layer."""
        if self._swappers is None:
            num_layers = self.num_slots
            ids = np.zeros(SWAP_PAGES, np.int32)
            h, *rest = page_shape
            pages = kv_quant.zeros((2, h, num_layers * SWAP_PAGES, *rest), dtype)
            gather_body = functools.partial(gather_pages, num_layers=num_layers)
            scatter_body = functools.partial(scatter_pages, num_layers=num_layers)
            if self.mesh is None:
                gather = jax.jit(gather_body)
                scatter = jax.jit(scatter_body, donate_argnums=(0,))
            else:
                specs, pages_spec = self.state_specs, P(None, sharding.POOL_SPEC[0])
                if kv_quant.is_quantized(dtype):
                    pages_spec = QuantizedPages(pages_spec, pages_spec)
                gather = self._sharded_jit(
                    gather_body, in_specs=(specs, P()), out_specs=pages_spec, donate=None
                )
                scatter = self._sharded_jit(
                    scatter_body, in_specs=(specs, P(), pages_spec), out_specs=specs, donate=0
                )
            self._swappers = (
                self._compiled(gather, state, ids, name="swap gather"),
                self._compiled(scatter, state, ids, pages, name="swap scatter"),
            )
        return self._swappers

    def lora_writer(self, slots, weights):
        """The LoRA slot write (models/lora.py write_slots: slots donated, the slot index
        traced), compiled once: loading an adapter at run time compiles nothing."""
        if self._lora_writer is None:
            if self.mesh is None:
                fn = jax.jit(lora.write_slots, donate_argnums=(0,))
            else:  # each device writes its shard (sharding.lora_specs) of the slot
                specs = self.param_specs["layers"]
                pick = lambda layer: {k: layer[k] for k in lora.a_b_names(self.model_config)}
                specs = pick(specs) if isinstance(specs, dict) else [pick(x) for x in specs]
                fn = self._sharded_jit(
                    lora.write_slots, in_specs=(specs, P(), lora.weight_specs(specs)),
                    out_specs=specs, donate=0,
                )  # fmt: skip
            self._lora_writer = self._compiled(
                fn, slots, np.int32(0), weights, name="lora slot write"
            )
        return self._lora_writer

    def _state_specs(self, dtype) -> DeviceState:
        """The state's shardings for a pool of dtype: a quantized pool's scales split over KV
        heads as its rows are (set as the pool is made; the programs compiled after read it)."""
        if kv_quant.is_quantized(dtype):
            pool = QuantizedPages(sharding.POOL_SPEC, P(*sharding.POOL_SPEC[:3]))
            self.state_specs = DeviceState(pool, pool, P())
        return self.state_specs

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
