"""ModelConfig: the shape of a Llama-family decoder, read from a Hugging Face config.json.

One frozen config serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM; the architectures differ only in flags (q/k/v bias, q/k RMSNorm,
explicit head_dim, tied embeddings, rope scaling, sliding window). Gemma2ForCausalLM,
Gemma3ForCausalLM and Phi3ForCausalLM are flags too: per-layer attention (`layer_windows`:
each layer's sliding window or full attention), the Gemma norms (stored with Gemma's + 1
already added: a plain RMSNorm weight) with post-attention and post-MLP norms, the sqrt(hidden)
embedding scale, soft-capping, GELU, a local rope base, partial rotary, linear and LongRoPE
scaling. Phi-3's fused qkv_proj and gate_up_proj are split into wq/wk/wv, w_gate/w_up when
loaded. Qwen3MoeForCausalLM, MixtralForCausalLM and OlmoeForCausalLM replace every layer's
MLP by experts (models/moe.py); OLMoE adds q/k norms over the whole projection and clip_qkv.
Glm4MoeForCausalLM (GLM-4.5/4.6) keeps a dense MLP in its first num_dense_layers layers and
gives the others DeepSeek-V3's experts: sigmoid scores, a score-correction bias that only
chooses, top-k within the best groups, a routed scaling factor, and shared experts; its
attention has partial rotary (0.5 by default), q/k/v bias and an optional per-head q/k norm.
GptOssForCausalLM (gpt-oss) alternates sliding-window and full layers (layer_types), adds a
learned sink logit per query head to each softmax's denominator, q/k/v/o biases and YaRN rope;
its experts (every layer) route by top-k of biased router logits with a softmax over the k
chosen, and apply a clamped SwiGLU with biases (models/moe.py).

Params layout (a pytree of arrays; every loader and initializer produces exactly this):
  embed:      [vocab, hidden]
  layers:     list (num_layers) of dicts (or, stacked for lax.scan by models/llama.py
              stack_layers, one dict of the same names with a leading [num_layers] dim):
    input_norm [hidden], post_attn_norm [hidden]
    wq [hidden, num_heads, head_dim], wk/wv [hidden, num_kv_heads, head_dim]
    wo [num_heads, head_dim, hidden]
    bq [num_heads, head_dim], bk/bv [num_kv_heads, head_dim]     (attention_bias only)
    bo [hidden]                                                   (o_bias only: gpt-oss)
    sinks [num_heads]                                  (attention_sinks only: gpt-oss)
    q_norm [head_dim], k_norm [head_dim]                         (qk_norm only)
    q_norm [num_heads, head_dim], k_norm [num_kv_heads, head_dim] (qk_norm_full: OLMoE)
    w_gate, w_up [hidden, intermediate], w_down [intermediate, hidden]   (dense layers)
    router [hidden, E], w_gate_exps / w_up_exps [E, hidden, moe_intermediate],
    w_down_exps [E, moe_intermediate, hidden]     (num_experts = E > 0, instead of w_gate...)
    router_bias [E]                                      (router_bias: the choice's bias)
    b_router [E]                   (router_logit_bias: the router's own bias, gpt-oss)
    b_gate_exps / b_up_exps [E, moe_intermediate], b_down_exps [E, hidden]  (expert_bias)
    w_gate_shared / w_up_shared [hidden, Fs], w_down_shared [Fs, hidden]
                  (num_shared_experts, Fs = moe_intermediate * num_shared_experts)
  Expert layers may follow num_dense_layers dense ones (GLM-4.5): layer i < num_dense_layers
  has w_gate/w_up/w_down and no expert params, the others the reverse. Stacked, each name is
  stacked over the layers that have it: w_gate [num_dense_layers, ...], router
  [num_layers - num_dense_layers, ...], the rest [num_layers, ...] (models/llama.py layer_at).
  final_norm: [hidden]
  lm_head:    [hidden, vocab]                                    (absent when tied)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
)
# Multi-head latent attention (models/mla.py): the pool holds a latent per token, not K/V.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Expert layers' router scores: softmax over all experts (Qwen3-MoE, Mixtral, OLMoE), an
# independent sigmoid per expert (DeepSeek-V3, GLM-4.5), or a softmax over the top-k logits
# only (gpt-oss).
MOE_SCORINGS = ("softmax", "sigmoid", "topk_softmax")
# Activations of the gated MLP (hidden_act / hidden_activation).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """rope_scaling of type "llama3" (other types are rejected when the config is read)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
    """rope_scaling of type "linear": positions divided by factor."""

    factor: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongRopeScaling:
    """rope_scaling of type "longrope" (Phi-3's "su"): per-frequency divisors, short_factor
    for sequences of at most original_max_position_embeddings tokens and long_factor past
    them (chosen per sequence by its length in the step, as transformers chooses by the
    length of its forward), and cos/sin multiplied by attention_factor."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """rope_scaling of type "yarn" (DeepSeek-V2/V3), as transformers computes it: each
    frequency blended between itself and itself / factor by a linear ramp over the dims
    between the correction range of beta_fast and beta_slow rotations; cos/sin times
    attention_factor; an MLA model's softmax scale times mscale(mscale_all_dim) squared."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    rope_scaling: (
        RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling | None
    ) = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention: layer i's sliding window (None: full attention); () means every
    # layer has sliding_window. Under lax.scan the layers run in groups of the repeating
    # pattern (models/llama.py).
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    gemma_norms: bool = False  # norms in float32; HF's (1 + w) weights stored as w + 1
    post_norms: bool = False  # norms of the attention and MLP outputs (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden), in the activation dtype
    attn_soft_cap: float | None = None  # cap * tanh(score / cap) on attention scores
    final_soft_cap: float | None = None  # the same on the logits
    query_pre_attn_scalar: float | None = None  # softmax scale 1 / sqrt(it) (else head_dim)
    # Rope base of the sliding-window layers (Gemma 3), which then get no rope scaling;
    # rope_theta and rope_scaling apply to the full-attention layers. None: one rope.
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0  # rope on the first head_dim * it dims of a head
    # Mixture of experts (models/moe.py), every layer: num_experts > 0 replaces the MLP by
    # num_experts experts of moe_intermediate_size, num_experts_per_tok of them per token
    # (softmax over all experts, top-k, renormalised when norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Experts split over the tensor-parallel devices (E / T each, all tokens) instead of
    # their intermediate dim (--enable-expert-parallel); a layout, not a model, setting.
    expert_parallel: bool = False
    # DeepSeek-V3-style routing (GLM-4.5), models/moe.py route_grouped: the scores of
    # moe_scoring; router_bias (e_score_correction_bias) added to them to choose the experts
    # only; experts in num_expert_groups groups, of which the topk_groups with the highest
    # sum of their best two biased scores are eligible; the chosen unbiased scores times
    # routed_scaling_factor (after the renormalisation of norm_topk_prob).
    moe_scoring: str = "softmax"
    router_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Shared experts run on every token beside the routed ones: one gated MLP of
    # moe_intermediate_size * num_shared_experts.
    num_shared_experts: int = 0
    # The first layers keep a dense MLP of intermediate_size (first_k_dense_replace).
    num_dense_layers: int = 0
    qk_norm_full: bool = False  # q/k RMSNorm over the whole projection (OLMoE), not per head
    clip_qkv: float | None = None  # q, k, v clamped to [-it, it] (OLMoE)
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py), kv_lora_rank > 0: the pool
    # holds per token the normed latent [kv_lora_rank] and the rotated shared key
    # [qk_rope_head_dim], one row split in halves over the K and V pools, so num_kv_heads is
    # 1 and head_dim is (kv_lora_rank + qk_rope_head_dim) / 2 (the pool's geometry); a query
    # head has qk_nope_head_dim + qk_rope_head_dim dims, a value head v_head_dim; q_lora_rank
    # > 0: the query goes through a low-rank projection with its norm.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dims in pairs (models/mla.py)
    # The router's group score (DeepSeek-V2's group_limited_greedy: the group's best score;
    # else the sum of its best two).
    group_score: str = "top2"
    # gpt-oss: a learned logit per query head joins each softmax's denominator (a "sink"
    # that takes probability and gives no value); a bias on the output projection; the
    # router's own bias on its logits (moe_scoring "topk_softmax"); biases on the experts'
    # projections; the experts' clamped SwiGLU (up + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit) and up clamped to [-limit, limit] (swiglu_limit None: act(gate) * up).
    attention_sinks: bool = False
    o_bias: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

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
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for "
                f"{self.num_layers} layers"
            )
        for w in self.layer_windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"a layer's sliding window must be >= 1, got {w!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        for name in ("attn_soft_cap", "final_soft_cap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and "
                f"give an even number of rotary dims (head_dim {self.head_dim})"
            )
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                    f"num_experts ({self.num_experts})"
                )
            self._check_routing()
        elif self.expert_parallel:
            raise ValueError(f"expert parallelism needs experts; {self.architecture} has none")
        if self.kv_lora_rank:
            self._check_mla()
        rs = self.rope_scaling
        if isinstance(rs, LongRopeScaling):
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != self.rotary_dim // 2:
                    raise ValueError(
                        f"rope_scaling {name} has {len(getattr(rs, name))} entries, expected "
                        f"{self.rotary_dim // 2} (rotary dims / 2)"
                    )

    def _check_routing(self) -> None:
        """The DeepSeek-style routing fields (module docstring) are consistent."""
        if self.moe_scoring not in MOE_SCORINGS:
            raise ValueError(
                f"expert scoring {self.moe_scoring!r} is not supported; supported: "
                f"{', '.join(MOE_SCORINGS)}"
            )
        groups, topk = self.num_expert_groups, self.topk_groups
        if not (isinstance(groups, int) and groups >= 1 and self.num_experts % groups == 0):
            raise ValueError(
                f"n_group ({groups!r}) must be a positive integer dividing the "
                f"{self.num_experts} experts"
            )
        if groups > 1 and self.num_experts // groups < 2:
            raise ValueError(
                f"n_group ({groups}) leaves fewer than 2 experts per group (a group's score "
                "is the sum of its best two)"
            )
        if not (isinstance(topk, int) and 1 <= topk <= groups):
            raise ValueError(f"topk_group ({topk!r}) must be in [1, n_group ({groups})]")
        if topk * (self.num_experts // groups) < self.num_experts_per_tok:
            raise ValueError(
                f"topk_group ({topk}) groups of {self.num_experts // groups} experts hold "
                f"fewer than num_experts_per_tok ({self.num_experts_per_tok})"
            )
        if self.group_score not in ("top2", "max"):
            raise ValueError(f"group_score must be 'top2' or 'max', got {self.group_score!r}")
        for name in ("num_shared_experts", "num_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"first_k_dense_replace ({self.num_dense_layers}) exceeds the "
                f"{self.num_layers} layers"
            )

    def _check_mla(self) -> None:
        """The latent attention's dims (the class comment) and the pool geometry they set."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        row = self.kv_lora_rank + self.qk_rope_head_dim
        if row % 2 or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim ({row}) and qk_rope_head_dim "
                f"({self.qk_rope_head_dim}) must be even (the latent row is split in halves)"
            )
        if (self.num_kv_heads, self.head_dim) != (1, row // 2):
            raise ValueError(
                f"a latent-attention pool has 1 KV head of {row // 2} dims, got "
                f"{self.num_kv_heads} of {self.head_dim}"
            )

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer` runs experts (else the dense MLP)."""
        return bool(self.num_experts) and layer >= self.num_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts' intermediate dim (0: none)."""
        return self.moe_intermediate_size * self.num_shared_experts

    def with_expert_parallel(self, enable: bool) -> ModelConfig:
        """This config with expert_parallel set when enabled and the model has experts (a
        dense model ignores the flag, as vLLM's does)."""
        if not enable or not self.num_experts:
            return self
        return dataclasses.replace(self, expert_parallel=True)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return self.layer_windows or (self.sliding_window,) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rope rotates (the first ones; latent attention: the
        decoupled rotary dims of every query head and of the shared key)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers (projections; norms are negligible): what a step
        reads per token besides the embedding and head."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q + 2 * kv)  # q, k, v, o
        if self.kv_lora_rank:  # the latent attention's projections (models/mla.py)
            h, d, r, dq = self.num_heads, self.hidden_size, self.kv_lora_rank, self.q_lora_rank
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = dq * (d + h * qk) if dq else d * h * qk
            attention = q + d * (r + self.qk_rope_head_dim) + r * h * (
                self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d
        dense = 3 * self.hidden_size * self.intermediate_size
        if not self.num_experts:
            return self.num_layers * (attention + dense)
        # every expert's weights, the router and the shared experts
        d, e = self.hidden_size, self.num_experts
        experts = e * (3 * d * self.moe_intermediate_size + d) + 3 * d * self.shared_intermediate_size
        num_dense = self.num_dense_layers
        return (
            self.num_layers * attention
            + num_dense * dense
            + (self.num_layers - num_dense) * experts
        )

    def kv_bytes_per_page(self, page_size: int, itemsize: int) -> int:
        """Bytes of one page of the KV pool: K and V of every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * page_size * self.head_dim * itemsize

    @property
    def sm_scale(self) -> float:
        if self.kv_lora_rank:  # a query head's dims, and YaRN's mscale (transformers')
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            rs = self.rope_scaling
            if isinstance(rs, YarnRopeScaling) and rs.mscale_all_dim:
                scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
            return scale
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
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
        rope = _rope_fields(hf, arch, source)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None
        family = _family_fields(arch, hf, sliding, source)
        family.update(_moe_fields(arch, hf, source))
        family.setdefault("num_kv_heads", hf.get("num_key_value_heads") or num_heads)
        family.setdefault("head_dim", head_dim)
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            **rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            # Gemma's configs leave it out: transformers' Gemma classes default to tied.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch.startswith("Gemma"))),
            attention_bias=arch == "Qwen2ForCausalLM"
            or bool(hf.get("attention_bias", arch == "GptOssForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM")
            or (arch == "Glm4MoeForCausalLM" and bool(hf.get("use_qk_norm", False))),
            sliding_window=sliding,
            **family,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


def _rope_fields(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, rope_local_theta and partial_rotary_factor of a config.json.

    transformers >= 5 writes "rope_parameters" (rope_theta inside it; Gemma 3: one object per
    layer type, "full_attention" and "sliding_attention"); older versions write
    "rope_scaling" with a top-level "rope_theta" (and Gemma 3's "rope_local_base_freq")."""
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rs = hf.get(rope_key) or {}
    if not isinstance(rs, dict):
        raise ValueError(f"{source}: field {rope_key!r} must be an object, got {rs!r}")  # noqa: TRY004
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rs or "sliding_attention" in rs:
        local = rs.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"{source}: {rope_key}.sliding_attention type {local['rope_type']!r} is not "
                "supported"
            )
        local_theta = local.get("rope_theta", local_theta)
        rs = rs.get("full_attention") or {}
        rope_key += ".full_attention"
    default_theta = 150000.0 if arch == "GptOssForCausalLM" else 10000.0
    if arch == "GptOssForCausalLM" and not rs:  # transformers' GptOssConfig default
        rs = dict(_GPT_OSS_ROPE)
    if arch == "Gemma3ForCausalLM":  # transformers' Gemma 3 defaults
        default_theta, local_theta = 1e6, 10000.0 if local_theta is None else local_theta
    rope_theta = hf.get("rope_theta", rs.get("rope_theta", default_theta))
    # GLM-4.5's configs may leave it out: transformers' Glm4MoeConfig defaults it to 0.5.
    default_partial = 0.5 if arch == "Glm4MoeForCausalLM" else 1.0
    partial = hf.get("partial_rotary_factor", rs.get("partial_rotary_factor", default_partial))
    rope_scaling = None
    rtype = rs.get("rope_type", rs.get("type", "default"))
    try:
        if rtype == "llama3":
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        elif rtype == "linear":
            rope_scaling = LinearRopeScaling(factor=float(rs["factor"]))
        elif rtype in ("longrope", "su"):
            original = rs.get("original_max_position_embeddings")
            original = int(original or hf["original_max_position_embeddings"])
            factor = rs.get("factor") or hf.get("max_position_embeddings", 2048) / original
            attention = rs.get("attention_factor")
            if attention is None:  # the LongRoPE paper's, as transformers computes it
                attention = 1.0 if factor <= 1 else (1 + math.log(factor) / math.log(original)) ** 0.5
            rope_scaling = LongRopeScaling(
                short_factor=tuple(float(x) for x in rs["short_factor"]),
                long_factor=tuple(float(x) for x in rs["long_factor"]),
                original_max_position_embeddings=original,
                attention_factor=float(attention),
            )
        elif rtype == "yarn":
            rope_scaling = _yarn(rs, hf)
        elif rtype != "default":
            raise ValueError(f"{source}: {rope_key} type {rtype!r} is not supported")
    except KeyError as e:
        raise ValueError(f"{source}: {rope_key} is missing field {e.args[0]!r}") from None
    return {
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "rope_local_theta": None if local_theta is None else float(local_theta),
        "partial_rotary_factor": float(partial),
    }


def _yarn(rs: dict[str, Any], hf: dict[str, Any]) -> YarnRopeScaling:
    """A "yarn" rope_scaling object's fields, with transformers' defaults."""
    original = int(rs["original_max_position_embeddings"])
    factor = rs.get("factor") or hf.get("max_position_embeddings", 2048) / original
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    attention = rs.get("attention_factor")
    if attention is None:
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return YarnRopeScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(rs.get("beta_fast") or 32),
        beta_slow=float(rs.get("beta_slow") or 1),
        attention_factor=float(attention),
        mscale_all_dim=float(mscale_all or 0),
        truncate=bool(rs.get("truncate", True)),
    )


# Layer types of transformers' "layer_types" that jpaged runs.
LAYER_TYPES = ("full_attention", "sliding_attention")


def _family_fields(
    arch: str, hf: dict[str, Any], sliding: int | None, source: str
) -> dict[str, Any]:
    """The ModelConfig fields of Gemma 2/3 and Phi-3 (none for the Llama family)."""
    if arch == "Phi3ForCausalLM":
        return {"hidden_act": hf.get("hidden_act", "silu")}
    if arch == "GptOssForCausalLM":
        return _gpt_oss_fields(hf, sliding, source)
    if not arch.startswith("Gemma"):
        return {}
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention (an encoder) is not supported")
    num_layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:  # transformers' rule: full attention on every pattern-th layer
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern", 6))
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers or 0)
        ]
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"{source}: field 'layer_types' must list {' or '.join(LAYER_TYPES)} for each "
            f"layer, got {types!r}"
        )
    return {
        "layer_windows": tuple(sliding if t == "sliding_attention" else None for t in types),
        "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        "gemma_norms": True,
        "post_norms": True,
        "embed_scale": True,
        "attn_soft_cap": hf.get("attn_logit_softcapping"),
        "final_soft_cap": hf.get("final_logit_softcapping"),
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
    }


def _moe_fields(arch: str, hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of Qwen3-MoE, Mixtral, OLMoE and GLM-4.5 (none for dense
    families)."""
    if arch == "Glm4MoeForCausalLM":
        return _glm4_moe_fields(hf, source)
    if arch in MLA_ARCHITECTURES:
        return _deepseek_fields(arch, hf, source)
    if arch == "GptOssForCausalLM":
        return {}  # _gpt_oss_fields
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"):
        return {}
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts, as Mixtral's.
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise ValueError(f"{source}: missing required field 'num_experts'")
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
        "moe_intermediate_size": hf.get("moe_intermediate_size") or hf.get("intermediate_size"),
        "norm_topk_prob": arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False)),
    }
    if arch == "Qwen3MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ValueError(
                f"{source}: dense MLP layers among the expert layers (decoder_sparse_step "
                f"{step}, mlp_only_layers {dense}) are not supported"
            )
    if arch == "OlmoeForCausalLM":
        fields["qk_norm_full"] = True
        fields["clip_qkv"] = hf.get("clip_qkv")
    if hf.get("num_experts_per_tok") is None:
        raise ValueError(f"{source}: missing required field 'num_experts_per_tok'")
    return fields


def _glm4_moe_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """GLM-4.5's expert fields, with transformers' Glm4MoeConfig defaults."""
    num_experts = hf.get("n_routed_experts", hf.get("num_local_experts", 128))
    method = hf.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"{source}: topk_method {method!r} is not supported; supported: noaux_tc")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": hf.get("moe_intermediate_size", 1408),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "moe_scoring": "sigmoid",
        "router_bias": True,
        "num_expert_groups": hf.get("n_group") or 1,
        "topk_groups": hf.get("topk_group") or 1,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "num_shared_experts": hf.get("n_shared_experts", 1),
        "num_dense_layers": hf.get("first_k_dense_replace", 1),
    }


def _deepseek_fields(arch: str, hf: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V2/V3's latent attention and expert fields, with transformers' defaults
    (V3: GLM-4.5's noaux_tc routing; V2: softmax scores, greedy or group_limited_greedy top-k,
    never renormalised)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    r, dr = hf.get("kv_lora_rank", 512), hf.get("qk_rope_head_dim", 64)
    fields = {
        "kv_lora_rank": r,
        "q_lora_rank": hf.get("q_lora_rank", 1536) or 0,
        "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": dr,
        "v_head_dim": hf.get("v_head_dim", 128),
        "rope_interleave": bool(hf.get("rope_interleave", True)) if v3 else True,
        "num_kv_heads": 1,
        "head_dim": (r + dr) // 2,
    }
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias is not supported for {arch}")
    if not hf.get("n_routed_experts", 256 if v3 else 64):
        return {**fields, "num_dense_layers": 0}
    if v3:
        moe = _glm4_moe_fields({"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                                "routed_scaling_factor": 2.5, "n_routed_experts": 256,
                                "moe_intermediate_size": 2048, **hf}, source)  # fmt: skip
        return {**fields, **moe}
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"{source}: topk_method {method!r} is not supported; supported: greedy, "
            "group_limited_greedy"
        )
    grouped = method == "group_limited_greedy"
    return {
        **fields,
        "num_experts": hf.get("n_routed_experts", 64),
        "num_experts_per_tok": hf.get("num_experts_per_tok") or 6,
        "moe_intermediate_size": hf.get("moe_intermediate_size", 1407),
        "norm_topk_prob": False,
        "num_expert_groups": (hf.get("n_group") or 1) if grouped else 1,
        "topk_groups": (hf.get("topk_group") or 1) if grouped else 1,
        "group_score": "max",
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "num_shared_experts": hf.get("n_shared_experts", 2),
        "num_dense_layers": hf.get("first_k_dense_replace", 0),
    }


# transformers' GptOssConfig rope when a config names none.
_GPT_OSS_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip


def _gpt_oss_fields(hf: dict[str, Any], sliding: int | None, source: str) -> dict[str, Any]:
    """gpt-oss's fields, with transformers' GptOssConfig defaults: sliding-window layers at
    even indices and full ones at odd (layer_types), every layer's experts."""
    num_layers = hf.get("num_hidden_layers") or 0
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"{source}: field 'layer_types' must list {' or '.join(LAYER_TYPES)} for each "
            f"layer, got {types!r}"
        )
    if "sliding_attention" in types and sliding is None:
        raise ValueError(f"{source}: sliding_attention layers need field 'sliding_window'")
    limit, alpha = hf.get("swiglu_limit", 7.0), hf.get("swiglu_alpha", 1.702)
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{source}: field {name!r} must be a number > 0, got {value!r}")
    return {
        "layer_windows": tuple(sliding if t == "sliding_attention" else None for t in types),
        "attention_sinks": True,
        "o_bias": bool(hf.get("attention_bias", True)),
        "num_experts": hf.get("num_local_experts", hf.get("num_experts", 128)),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 4),
        "moe_intermediate_size": hf.get("intermediate_size", 2880),
        "norm_topk_prob": True,
        "moe_scoring": "topk_softmax",
        "router_logit_bias": True,
        "expert_bias": True,
        "swiglu_limit": float(limit),
        "swiglu_alpha": float(alpha),
    }
