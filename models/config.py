"""ModelConfig: the shape of a Llama-family decoder, read from a Hugging Face config.json.

One frozen config serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM; the architectures differ only in flags (q/k/v bias, q/k RMSNorm,
explicit head_dim, tied embeddings, rope scaling, sliding window).

Params layout (a pytree of arrays; every loader and initializer produces exactly this):
  embed:      [vocab, hidden]
  layers:     list (num_layers) of dicts (or, stacked for lax.scan by models/llama.py
              stack_layers, one dict of the same names with a leading [num_layers] dim):
    input_norm [hidden], post_attn_norm [hidden]
    wq [hidden, num_heads, head_dim], wk/wv [hidden, num_kv_heads, head_dim]
    wo [num_heads, head_dim, hidden]
    bq [num_heads, head_dim], bk/bv [num_kv_heads, head_dim]     (attention_bias only)
    q_norm [head_dim], k_norm [head_dim]                         (qk_norm only)
    w_gate, w_up [hidden, intermediate], w_down [intermediate, hidden]
  final_norm: [hidden]
  lm_head:    [hidden, vocab]                                    (absent when tied)
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """rope_scaling of type "llama3" (other types are rejected when the config is read)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers (projections; norms are negligible): what a step
        reads per token besides the embedding and head."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q + 2 * kv)  # q, k, v, o
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    def kv_bytes_per_page(self, page_size: int, itemsize: int) -> int:
        """Bytes of one page of the KV pool: K and V of every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * page_size * self.head_dim * itemsize

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Builds a ModelConfig from a parsed config.json; errors name the file and field."""

        def need(key: str):
            if key not in hf:
                raise ValueError(f"{source}: missing required field {key!r}")
            return hf[key]

        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{source}: missing required field 'architectures'")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = hf.get("head_dim") or hidden // num_heads
        # transformers >= 5 writes "rope_parameters" (rope_theta inside it); older versions
        # write "rope_scaling" and a top-level "rope_theta".
        rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rs = hf.get(rope_key) or {}
        if not isinstance(rs, dict):
            raise ValueError(f"{source}: field {rope_key!r} must be an object, got {rs!r}")  # noqa: TRY004
        rope_theta = hf.get("rope_theta", rs.get("rope_theta", 10000.0))
        rope_scaling = None
        rtype = rs.get("rope_type", rs.get("type", "default"))
        if rtype == "llama3":
            try:
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            except KeyError as e:
                raise ValueError(f"{source}: {rope_key} is missing field {e.args[0]!r}") from None
        elif rtype != "default":
            raise ValueError(f"{source}: {rope_key} type {rtype!r} is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
