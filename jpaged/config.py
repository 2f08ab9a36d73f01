"""Engine configuration: frozen, validated on construction, hashable.

CacheConfig sizes the page pool; SchedulerConfig bounds each step; ParallelConfig says how
many devices a replica spans (tensor parallel) and how many replicas serve (data parallel);
EngineConfig holds them with the model path and numeric settings; SpeculativeConfig is
what `speculative_config` holds (parsed from its canonical JSON), StructuredOutputsConfig
what `structured_outputs_config` holds. The shape buckets every
step is padded into are derived here, so the number of compiled programs is known before anything runs.

These dataclasses are the one declaration of the engine's settings: every field carries its
help text (`setting(default, help)`), and the LLM's keyword arguments and the CLI's engine flags
are derived from them (jpaged/entrypoints/engine_args.py). Settings that depend on the model
(SchedulerConfig.max_model_len, max_num_batched_tokens) are None until `EngineConfig.resolve`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

KV_ALLOCATIONS = ("paged", "reserve")
# --kv-cache-dtype (vLLM's): "auto" stores the activations' dtype; fp8 is fp8_e4m3; int8 and
# fp8 pages carry a scale per token and KV head (pallas_kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = (None, "reference", "pallas", "pallas_interpret")
GENERATION_CONFIGS = ("auto", "vllm")
DEFAULT_SWAP_SPACE_BYTES = 4 * 2**30  # vLLM's default swap space
DEFAULT_KV_OFFLOAD_DIR_BYTES = 16 * 2**30  # the disk tier's files, at most
DEFAULT_MAX_MODEL_LEN = 2048  # the cap on the model's own context length by default
# SchedulerConfig.min_token_bucket when it is None: on accelerators, and on CPU.
MIN_TOKEN_BUCKET, MIN_TOKEN_BUCKET_CPU = 16, 4
# EngineConfig.scan_layers when it is None, by platform (docs/benchmarks.md, "Scanned layers").
SCAN_LAYERS_DEFAULT = {"cpu": True, "gpu": True, "tpu": True}
# On CPU, layers of more bytes than this run unrolled by default: XLA:CPU copies each
# scanned layer's weights out of the stacked arrays every step, which cost SmolLM2 (425 MB
# of float32 layers) 7% of its decode step and Llama-3.2-1B's shape (3.9 GB) 48%, against
# compiles 3.5x and 2x faster. The line lies between, near their geometric mean.
SCAN_LAYERS_CPU_MAX_BYTES = 2**30


def setting(default, help: str, **kwargs):
    """A config field with its help text (shown by the CLI with the default)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... up to and including hi (hi itself is always the last bucket)."""
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    page_size: int = setting(16, "tokens per KV page")
    num_pages: int | None = setting(None, "KV pages in the pool (default: from the memory budget)")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV-cache budget in bytes, K and V pages of all layers (instead of --num-pages)"
    )
    kv_memory_fraction: float = setting(
        0.8, "share of free accelerator memory for KV pages, when neither of the above is given"
    )
    enable_prefix_caching: bool = setting(True, "prefix caching: identical prompt pages shared")
    free_window_pages: bool = setting(
        True,
        "free the KV pages that fall out of a sliding window: with mixed full and windowed "
        "layers, a page table per kind of layer (off: keep every page, for comparison)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV page dtype: auto (the model's), bfloat16, float32, or int8/fp8 (fp8_e4m3, fp8_e5m2) "
        "with a scale per token and KV head",
        choices=KV_CACHE_DTYPES,
    )
    kv_allocation: str = setting(
        "paged",
        "paged, or reserve (prompt + max_tokens at admission, for comparison)",
        choices=KV_ALLOCATIONS,
    )
    # Host memory for preemption_mode="swap": pages of all layers' K and V, given as a page
    # count or a byte budget (default 4 GiB when neither is given). Unused under "recompute".
    num_swap_pages: int | None = setting(
        None, "host pages for swap preemption (instead of --swap-space-bytes)"
    )
    swap_space_bytes: int | None = setting(None, "host memory for swap preemption (default: 4 GiB)")
    # The host tier of the prefix cache (jpaged/core/host_page_store.py): pages the device
    # cache evicts are copied to host memory and loaded back on a hit. It shares its host
    # pages with swap preemption (one store, sized by this when given).
    kv_offload_bytes: int | None = setting(
        None,
        "host memory for KV pages evicted from the device prefix cache, loaded back on a hit "
        "(0: off; default: off on CPU, a quarter of available host memory on an accelerator)",
    )
    kv_offload_dir: str | None = setting(
        None, "directory for KV pages the host tier evicts, read back on a hit (the disk tier)"
    )
    kv_offload_dir_bytes: int = setting(
        DEFAULT_KV_OFFLOAD_DIR_BYTES, "most bytes of page files kept in --kv-offload-dir"
    )
    session_idle_seconds: float = setting(
        60.0,
        "seconds a session stays active after its last request finished: an active "
        "session's cached pages are evicted after every other free page (device and host)",
    )

    def __post_init__(self) -> None:
        _positive("page_size", self.page_size)
        _positive("num_pages", self.num_pages, allow_none=True)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _positive("num_swap_pages", self.num_swap_pages, allow_none=True)
        _positive("swap_space_bytes", self.swap_space_bytes, allow_none=True)
        if self.kv_offload_bytes is not None and (
            isinstance(self.kv_offload_bytes, bool)
            or not isinstance(self.kv_offload_bytes, int)
            or self.kv_offload_bytes < 0
        ):
            raise ValueError(
                f"kv_offload_bytes must be a non-negative integer, got {self.kv_offload_bytes!r}"
            )
        _positive("kv_offload_dir_bytes", self.kv_offload_dir_bytes)
        if (
            isinstance(self.session_idle_seconds, bool)
            or not isinstance(self.session_idle_seconds, (int, float))
            or not 0 <= self.session_idle_seconds < float("inf")
        ):
            raise ValueError(
                "session_idle_seconds must be a finite number >= 0, got "
                f"{self.session_idle_seconds!r}"
            )
        if self.kv_offload_bytes and (
            self.num_swap_pages is not None or self.swap_space_bytes is not None
        ):
            raise ValueError(
                f"kv_offload_bytes ({self.kv_offload_bytes}) sizes the host pages that swap "
                "preemption uses too: give it without num_swap_pages or swap_space_bytes"
            )
        if self.kv_offload_dir is not None and self.kv_offload_bytes == 0:
            raise ValueError(
                f"kv_offload_dir ({self.kv_offload_dir!r}) needs the host tier, which "
                "kv_offload_bytes=0 turns off"
            )
        if self.num_swap_pages is not None and self.swap_space_bytes is not None:
            raise ValueError(
                f"give num_swap_pages ({self.num_swap_pages}) or swap_space_bytes "
                f"({self.swap_space_bytes}), not both"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}"
            )
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = setting(32, "sequences per step")
    max_num_batched_tokens: int | None = setting(
        None, "tokens per step, the chunked-prefill budget (default: max(512, max_num_seqs))"
    )
    max_model_len: int | None = setting(
        None, f"longest prompt + output (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})"
    )
    preemption_mode: str = setting(
        "recompute",
        "recompute, or swap: preempted K/V copied to host memory and back",
        choices=PREEMPTION_MODES,
    )
    enable_chunked_prefill: bool = setting(True, "chunked prefill")
    # None: by platform (EngineConfig.resolve): 16 on accelerators; on CPU 4, where a step's
    # cost follows its padded tokens (a one-row decode step at 4 tokens takes 0.7x its time
    # at 16: docs/benchmarks.md, "The smallest CPU bucket").
    min_token_bucket: int | None = setting(None, "smallest token bucket", cli=False)
    min_seq_bucket: int = setting(4, "smallest sequence bucket", cli=False)
    # A step of one row and one token (a lone decode) runs a program of its own, (1 token, 1
    # row), below the buckets. None: by platform (EngineConfig.resolve): on CPU when
    # min_token_bucket is left to it, where XLA:CPU multiplies a single row as a
    # matrix-vector product: SmolLM2's one-row decode step takes 26 ms against 39 ms padded
    # to (4, 4), while two rows cost what four do (docs/benchmarks.md, "One row, one
    # token"). Accelerators pad to their buckets as before, and so does the CPU when XLA_FLAGS
    # turns its fusion emitters off (_fusion_emitters, below).
    one_row_bucket: bool | None = setting(None, "a (1 token, 1 row) step program", cli=False)
    # Page-table columns a step reads come in buckets from this up to max_pages_per_seq. None:
    # by platform (EngineConfig.resolve): 4 on accelerators, whose kernels' grids follow the
    # width; on CPU one bucket, the full width (the reference attention loops only over the
    # key blocks a row's context needs, so a wide table costs nothing, and a chat whose
    # context grows meets no new program).
    min_page_bucket: int | None = setting(None, "smallest page-column bucket", cli=False)
    # Decode-only steps (one token per sequence) get programs of their own, which run the
    # decode kernel. None: by platform (EngineConfig.resolve): on accelerators; on CPU a
    # decode step runs the ragged program of its token and sequence buckets (the same
    # reference attention), so decoding meets no program a prefill has not compiled.
    decode_programs: bool | None = setting(None, "decode-only step programs", cli=False)

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("min_token_bucket", self.min_token_bucket, allow_none=True)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.max_num_batched_tokens is None or self.max_model_len is None:
            return  # the rest is checked once resolved
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = setting(
        1, "devices each replica's weights and KV heads are split over"
    )
    data_parallel_size: int = setting(1, "engine replicas, each on its own tensor-parallel devices")
    enable_expert_parallel: bool = setting(
        False,
        "expert parallelism (mixture-of-experts models: num_experts / T whole experts on "
        "each tensor-parallel device, instead of a slice of every expert)",
    )

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


LORA_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Multi-LoRA serving (jpaged/lora/): adapters live in max_loras fixed-shape device slots
    of rank max_lora_rank (so loading one never recompiles), up to max_cpu_loras in host
    memory; a request names its adapter, and one step mixes adapters and the base model."""

    enable_lora: bool = setting(False, "LoRA adapters (PEFT) served on the base model")
    max_loras: int = setting(4, "adapters resident on the device at once (its slots)")
    max_lora_rank: int = setting(16, "the largest adapter rank a slot holds")
    max_cpu_loras: int | None = setting(
        None, "adapters kept loaded in host memory (LRU; default: max_loras * 4)"
    )
    lora_dtype: str = setting(
        "auto",
        "the adapter slots' dtype: auto (the model's, as vLLM), float32, or bfloat16 (half "
        "the slot bytes; the update is computed in the activations' dtype)",
        choices=LORA_DTYPES,
    )

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras * 4 if self.max_cpu_loras is None else self.max_cpu_loras


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = setting(
        None,
        "a Hugging Face directory, a .gguf file, a Hub id or demo-random (default: SmolLM2)",
        cli=False,
    )
    revision: str | None = setting(None, "branch, tag or commit of a Hub model id (default: main)")
    dtype: str | None = setting(
        None, "bfloat16 or float32 (default: bfloat16 on accelerators, float32 on CPU)"
    )
    quantization: str | None = setting(
        None,
        "int8 or fp8: the attention and MLP weights stored quantized (a float checkpoint per "
        "output channel; a GGUF's Q8_0 blocks kept, its 2- to 6-bit blocks re-quantized to "
        "int8); embeddings and LM head stay in dtype (default: float weights; a "
        "compressed-tensors fp8 checkpoint loads fp8)",
        choices=("int8", "fp8"),
    )
    seed: int = setting(
        0, "engine seed: seeds the requests that have none of their own", flag="engine-seed"
    )
    attention_backend: str | None = setting(
        None,
        "reference, pallas or pallas_interpret (default: the best for the platform)",
        choices=ATTENTION_BACKENDS[1:],
    )
    precompile: bool = setting(
        False, "compiling (and running once) every shape bucket at start-up"
    )
    # Decoder layers under lax.scan over stacked weights: one traced and compiled layer per
    # step program (start-up seconds instead of minutes) against an unrolled loop of every
    # layer. None: the measured better trade of the platform (SCAN_LAYERS_DEFAULT; on CPU
    # unrolled for layers over SCAN_LAYERS_CPU_MAX_BYTES).
    scan_layers: bool | None = setting(
        None,
        "the decoder layers as one scanned layer (fast compiles)",
        default_label="on; on CPU off for layers over 1 GiB",
    )
    precompile_max_len: int | None = setting(
        None,
        "with --precompile: compile the shapes of sequences of up to this many tokens "
        "(default: max_model_len); longer ones compile when first met",
    )
    generation_config: str = setting(
        "auto",
        "auto: the model's generation config supplies sampling defaults (temperature, top_p, "
        "top_k, min_p, repetition_penalty) for requests that leave them unset; vllm: ignore it",
        choices=GENERATION_CONFIGS,
    )
    # Schedule and pack step N+1 while the device runs step N (its sampled tokens stay on the
    # device and feed N+1); steps with penalties, and multi-host runs, stay synchronous.
    async_scheduling: bool = setting(
        True, "scheduling the next step while the device runs this one"
    )
    # JAX's persistent compilation cache: "auto" = $JPAGED_CACHE_DIR/xla or ~/.cache/jpaged/xla,
    # a path, or None to turn it off (see jpaged/worker/compilation_cache.py).
    compilation_cache_dir: str | None = setting(
        "auto", "JAX persistent compilation cache: auto (~/.cache/jpaged/xla), a directory, or off"
    )
    # vLLM's speculative_config: JSON text or a dict (kept as canonical JSON, so the config
    # stays hashable), e.g. {"method": "ngram", "num_speculative_tokens": 4}.
    speculative_config: str | dict | None = setting(  # noqa: RUF009 - setting() wraps dataclasses.field
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (default: off)',
    )
    # vLLM's structured_outputs_config: JSON text or a dict (kept as canonical JSON), e.g.
    # {"disable_any_whitespace": false} for vLLM's whitespace in JSON outputs.
    structured_outputs_config: str | dict | None = setting(  # noqa: RUF009 - setting() wraps dataclasses.field
        None,
        'structured outputs, as JSON: {"disable_any_whitespace": true} makes JSON outputs '
        "compact, false lets them put any whitespace between tokens (default: one space after "
        "',' and ':' only, unless a request says)",
    )
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            raw = self.speculative_config
            try:
                spec = (
                    SpeculativeConfig.from_dict(raw)
                    if isinstance(raw, dict)
                    else SpeculativeConfig.from_json(raw)
                )
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
            canonical = json.dumps(dataclasses.asdict(spec), sort_keys=True)
            object.__setattr__(self, "speculative_config", canonical)
        if self.structured_outputs_config is not None:
            canonical = StructuredOutputsConfig.parse(self.structured_outputs_config).to_json()
            object.__setattr__(self, "structured_outputs_config", canonical)
        _positive("precompile_max_len", self.precompile_max_len, allow_none=True)
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {GENERATION_CONFIGS}, "
                f"got {self.generation_config!r}"
            )
        if self.quantization not in (None, "int8", "fp8"):
            raise ValueError(
                f"quantization must be one of int8, fp8 (or unset), got {self.quantization!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    @property
    def speculative(self):
        """The SpeculativeConfig (below), or None."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_json(self.speculative_config)

    def scans_layers(self, platform: str, model_config=None) -> bool:
        """Whether the layers run under lax.scan on platform ("cpu", "gpu", "tpu", ...):
        scan_layers when set, else the platform's default; on CPU, with the model's config
        (models.config.ModelConfig), not for layers over SCAN_LAYERS_CPU_MAX_BYTES."""
        if self.scan_layers is not None:
            return self.scan_layers
        if platform == "cpu" and model_config is not None:
            itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
            if model_config.layer_params * itemsize > SCAN_LAYERS_CPU_MAX_BYTES:
                return False
        return SCAN_LAYERS_DEFAULT.get("gpu" if platform in ("cuda", "rocm") else platform, True)

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        """The StructuredOutputsConfig (below; its defaults when the setting is unset)."""
        return StructuredOutputsConfig.parse(self.structured_outputs_config or {})

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative
        return 0 if spec is None else spec.num_speculative_tokens

    def resolve(self, model_max_len: int, platform: str | None = None) -> EngineConfig:
        """This config with the model-dependent defaults filled in: max_model_len (the
        model's context length, at most DEFAULT_MAX_MODEL_LEN) and max_num_batched_tokens
        (max(512, max_num_seqs)); with platform ("cpu", "gpu", ...), the step shapes' defaults
        (SchedulerConfig.min_token_bucket, min_page_bucket, decode_programs). Validates the result."""
        s = self.scheduler
        cpu = platform == "cpu"
        max_len = s.max_model_len or min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        changes = {
            "max_model_len": max_len,
            "max_num_batched_tokens": s.max_num_batched_tokens or max(512, s.max_num_seqs),
        }
        if platform is not None and s.min_page_bucket is None:
            changes["min_page_bucket"] = math.ceil(max_len / self.cache.page_size) if cpu else 4
        if platform is not None and s.decode_programs is None:
            changes["decode_programs"] = not cpu
        if platform is not None and s.one_row_bucket is None:
            changes["one_row_bucket"] = cpu and s.min_token_bucket is None and _fusion_emitters()
        if platform is not None and s.min_token_bucket is None:
            changes["min_token_bucket"] = MIN_TOKEN_BUCKET_CPU if cpu else MIN_TOKEN_BUCKET
        if all(getattr(s, k) == v for k, v in changes.items()):
            return self
        return dataclasses.replace(self, scheduler=dataclasses.replace(s, **changes))

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.scheduler.max_model_len / self.cache.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        s = self.scheduler
        return powers_of_two(
            min(s.min_token_bucket or MIN_TOKEN_BUCKET, s.max_num_batched_tokens),
            s.max_num_batched_tokens,
        )

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        s = self.scheduler
        return powers_of_two(min(s.min_seq_bucket, s.max_num_seqs), s.max_num_seqs)

    @property
    def page_buckets(self) -> tuple[int, ...]:
        m = self.max_pages_per_seq
        lo = self.scheduler.min_page_bucket
        return powers_of_two(min(4 if lo is None else lo, m), m)

    @property
    def decode_programs(self) -> bool:
        """Whether decode-only steps run programs of their own (SchedulerConfig)."""
        return self.scheduler.decode_programs is not False


SPECULATIVE_METHODS = ("ngram", "draft_model")
_DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given


def check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to speculate. vLLM's names and semantics:

    method: "ngram" (prompt lookup: propose the tokens that followed the longest earlier match
        of the sequence's last n tokens) or "draft_model" (a smaller model with the same
        tokenizer); None picks "draft_model" when model is given.
    num_speculative_tokens: the most tokens proposed per sequence and step (k).
    prompt_lookup_max / prompt_lookup_min: the n-gram sizes tried, longest first (ngram only;
        both default to 5, and one given alone sets the other).
    model: the draft model's checkpoint directory (draft_model only).
    disable_by_batch_size: when more sequences than this decode in a step, greedy and
        unseeded rows propose nothing that step (verifying extra query tokens costs more than
        it wins in a big batch on compute-bound hardware); seeded sampled rows keep
        speculating, so their tokens do not depend on the batch. None: never (vLLM's
        default).
    cost_aware: greedy and unseeded rows stop proposing in a batch size where measured
        verifying steps give fewer tokens per second than plain ones (CostGovernor; each
        mode is re-measured every 16 steps). False: propose whenever the per-sequence
        acceptance tracker says so (vLLM's behaviour).
    """

    method: str | None = None
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    cost_aware: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cost_aware, bool):
            raise ValueError(f"cost_aware must be true or false, got {self.cost_aware!r}")  # noqa: TRY004 - ValueError for every bad field (the API)
        if self.disable_by_batch_size is not None:
            check_int("disable_by_batch_size", self.disable_by_batch_size, minimum=1)
        method = self.method
        if method is None and self.model is not None:
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        object.__setattr__(self, "method", method)
        check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if method == "ngram":
            self._normalise_prompt_lookup()
            if self.model is not None:
                raise ValueError(f"model must not be given with method 'ngram', got {self.model!r}")
            return
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} applies only to method 'ngram', got {getattr(self, name)!r}"
                )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"model must be a checkpoint path for method 'draft_model', got {self.model!r}"
            )

    def _normalise_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                check_int(name, value, minimum=1)
        if lo is None and hi is None:
            lo = hi = _DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, value: Mapping) -> SpeculativeConfig:
        """The config from a mapping with vLLM's keys (unknown keys are an error)."""
        if not isinstance(value, Mapping) or "num_speculative_tokens" not in value:
            raise ValueError(
                f"speculative_config must be a mapping with num_speculative_tokens, got {value!r}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config from `--speculative-config JSON` (a JSON object)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--speculative-config is not valid JSON ({e.msg}): {text!r}"
            ) from None
        return cls.from_dict(value)

    def check_draft_vocab(self, target_vocab_size: int, draft_vocab_size: int) -> None:
        """Raises unless a draft model's vocabulary is the target's (the verifier indexes
        both distributions by the same token ids)."""
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab_size} tokens) must equal the "
                f"target's ({target_vocab_size})"
            )


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")  # llguidance is the one backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings, vLLM's names (unknown keys are an error).

    backend: "auto" or "guidance" (llguidance, the only one here).
    disable_any_whitespace: the whitespace JSON outputs of requests that set none of their
        own get: True none (compact JSON), False any run between tokens (vLLM's default);
        None: jpaged's default, one space after "," and ":" and none elsewhere.
    """

    backend: str = "auto"
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of "
                f"{STRUCTURED_OUTPUTS_BACKENDS} (llguidance), got {self.backend!r}"
            )
        if self.disable_any_whitespace is not None and not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise ValueError(
                "structured_outputs_config.disable_any_whitespace must be true or false, "
                f"got {self.disable_any_whitespace!r}"
            )

    @classmethod
    def parse(cls, value: str | Mapping) -> StructuredOutputsConfig:
        """From `--structured-outputs-config JSON` or a mapping."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"structured_outputs_config is not valid JSON ({e.msg}): {value!r}"
                ) from None
        if not isinstance(value, Mapping):
            raise ValueError(  # noqa: TRY004 - a bad setting is a ValueError, as the others
                f"structured_outputs_config must be a JSON object, got {value!r}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"unknown structured_outputs_config keys {unknown}; known: {sorted(names)}"
            )
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _fusion_emitters() -> bool:
    """False when XLA_FLAGS turns XLA:CPU's fusion emitters off (the test suite does on jax
    0.10, to compile faster): a (1, 1) step program then fuses its matrix-vector products
    into emitted loops, SmolLM2's lone decode step about 155 ms against 40 padded to (4, 4)
    (2.6 s at --xla_backend_optimization_level=0), so SchedulerConfig.one_row_bucket stays off."""
    return "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "").split()
