"""jpaged: a JAX inference runtime for decoder LLMs built on PagedAttention."""

from jpaged.beam_search import BeamSearchOutput, BeamSearchSequence
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
