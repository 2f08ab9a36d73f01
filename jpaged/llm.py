"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jpaged.beam_search import BeamSearchOutput, beam_search
from jpaged.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from jpaged.engine import LLMEngine
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams

_DEFAULT_MAX_MODEL_LEN = 2048


def engine_config_from_args(
    model: str | None = None,
    *,
    dtype: str | None = None,
    seed: int = 0,
    page_size: int = 16,
    num_pages: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    kv_memory_fraction: float = 0.8,
    enable_prefix_caching: bool = True,
    kv_allocation: str = "paged",
    preemption_mode: str = "recompute",
    num_swap_pages: int | None = None,
    swap_space_bytes: int | None = None,
    max_num_seqs: int = 32,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    attention_backend: str | None = None,
    precompile: bool = False,
    async_scheduling: bool = True,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    compilation_cache_dir: str | None = "auto",
) -> EngineConfig:
    """One flat set of keyword arguments (the LLM's, the CLI's and the server's) -> config.

    max_model_len defaults to the model's max_position_embeddings, capped at 2048.
    """
    if max_model_len is None:
        max_model_len = min(_model_max_len(model), _DEFAULT_MAX_MODEL_LEN)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(512, max_num_seqs)
    return EngineConfig(
        model=model,
        dtype=dtype,
        seed=seed,
        attention_backend=attention_backend,
        precompile=precompile,
        async_scheduling=async_scheduling,
        compilation_cache_dir=compilation_cache_dir,
        cache=CacheConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_memory_fraction=kv_memory_fraction,
            enable_prefix_caching=enable_prefix_caching,
            kv_allocation=kv_allocation,
            num_swap_pages=num_swap_pages,
            swap_space_bytes=swap_space_bytes,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size
        ),
    )


def _model_max_len(model: str | None) -> int:
    """max_position_embeddings from the model's config.json (the demo model's when None)."""
    import json
    import pathlib

    if model is None:
        from models.demo import ensure_demo_model

        model = str(ensure_demo_model())
    path = pathlib.Path(model) / "config.json"
    try:
        return int(json.loads(path.read_text()).get("max_position_embeddings", 2048))
    except (OSError, ValueError):
        return _DEFAULT_MAX_MODEL_LEN  # the loader reports the real problem with the file


class LLM:
    """Offline batched generation. Keyword arguments are those of engine_config_from_args."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        from jpaged.parallel import make_engine

        # An LLMEngine, or data-parallel replicas behind the same interface.
        self.llm_engine: LLMEngine = make_engine(engine_config_from_args(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def reset_stats(self) -> None:
        self.llm_engine.reset_stats()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in prompt order.

        All prompts are validated before any is queued: a bad one raises ValueError (naming
        its index) and nothing is submitted.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts"
                )
        engine = self.llm_engine
        for i, p in enumerate(prompts):
            try:
                engine._prompt_tokens(p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = []
        for p, sp in zip(prompts, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            engine.add_request(rid, p, sp, stream=False)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (transformers' semantics, see jpaged.beam_search);
        returns one BeamSearchOutput per prompt, in prompt order, beams best first."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        return beam_search(self.llm_engine, prompts, params, ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
