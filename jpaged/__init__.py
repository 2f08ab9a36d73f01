"""jpaged: a JAX inference runtime for decoder LLMs built on PagedAttention."""

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.beam_search import BeamSearchOutput, BeamSearchSequence
from jpaged.core.engine import LLMEngine
from jpaged.entrypoints.llm import LLM
from jpaged.lora import LoRARequest
from jpaged.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from jpaged.pooling import PoolingParams
from jpaged.sample.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CacheConfig",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
