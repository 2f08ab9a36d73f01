"""Tiny random Qwen3-MoE, Mixtral, OLMoE, GLM-4.5 MoE and gpt-oss checkpoints from transformers' config classes,
and transformers' greedy tokens for them (float32, eager attention; the reference and
paged-logits helpers are dense_families'). Shared by
tests/models/test_moe.py and tests/parallel/test_expert_parallel.py (which writes them in
the test process and runs the engines in a worker with 8 CPU devices)."""

from __future__ import annotations

from pathlib import Path

import dense_families
from dense_families import prompts_with_shared_prefix

FAMILIES = ("qwen3moe", "mixtral", "olmoe")
# Prompt lengths: longer than a page and than a step's token budget, sharing a prefix.
PROMPT_LENGTHS = (19, 33, 11, 26, 12)
PREFIX = 10
MAX_TOKENS = 8


def tiny_config(family: str):
    """The family's transformers config: 3 layers, 8 experts, top-2, hidden 64 (GLM-4.5's
    "glm4moe" and "glm4moe_qk_norm" are not in FAMILIES: tests/models/test_glm4_moe.py;
    nor is "gpt_oss", tiny_gpt_oss_config)."""
    import transformers

    common = {
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
        )
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=8)
    if family == "gpt_oss":
        return tiny_gpt_oss_config()
    if family == "olmoe":
        return transformers.OlmoeConfig(
            **common, num_experts=8, clip_qkv=0.5, eos_token_id=None, pad_token_id=None
        )
    if family in ("glm4moe", "glm4moe_qk_norm"):
        # A dense first layer, 4 groups of 2 experts of which 2 groups are eligible, a
        # shared expert, partial rotary over half of each head, q/k/v bias.
        return transformers.Glm4MoeConfig(
            **{**common, "intermediate_size": 96},
            n_routed_experts=8, moe_intermediate_size=32, head_dim=16, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
            use_qk_norm=family == "glm4moe_qk_norm", partial_rotary_factor=0.5,
            eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
    if family.startswith("deepseek"):
        return _deepseek_config(family, common)
    raise ValueError(family)


# DeepSeek families (tests/models/test_deepseek.py): latent attention and DeepSeek's experts.
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v2")


def _deepseek_config(family: str, common: dict):
    """A dense first layer then expert layers (8 experts in 4 groups, 2 eligible, a shared
    expert), latent rank 24 + rotary 8 (a 32-value pool row), value heads (12) narrower than
    the query's no-rope dims (16). deepseek_v3: a query LoRA and YaRN (factor 4, mscale);
    deepseek_v3_no_q_lora: plain rope, the query projected directly (V2-Lite's shape);
    deepseek_v2: V2's softmax routing limited to the best groups by their best expert."""
    import transformers

    mla = {
        **common, "num_key_value_heads": common["num_attention_heads"], "intermediate_size": 96,
        "kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
        "n_routed_experts": 8, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "eos_token_id": None,
        # exact in float32, so a GGUF of the checkpoint has its config, and its programs
        "rms_norm_eps": 2.0**-20,
        "pad_token_id": None, "bos_token_id": None,
    }  # fmt: skip
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **mla, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=2.0
        )
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
            "rope_theta": 10000.0}  # fmt: skip
    with_lora = family == "deepseek_v3"
    return transformers.DeepseekV3Config(
        **mla, q_lora_rank=48 if with_lora else None, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0,
        rope_parameters=yarn if with_lora else {"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def save_tiny(path: str | Path, family: str, *, seed: int = 0) -> Path:
    """A random model of the family saved with save_pretrained; norm weights perturbed so a
    misplaced norm shows, router weights scaled so routing is decisive."""
    import torch
    import transformers

    if family == "gpt_oss":
        return save_tiny_gpt_oss(path, seed=seed)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(20.0)
        for name, buffer in model.named_buffers():  # GLM-4.5's bias: it must change choices
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn_like(buffer))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_gpt_oss_config():
    """gpt-oss (tests/models/test_gpt_oss.py): 4 layers alternating a 4-token window and full
    attention, 4 experts of which 2 per token, a SwiGLU clamp at 0.5 that binds, YaRN rope."""
    import transformers

    return transformers.GptOssConfig(
        vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
        tie_word_embeddings=False, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def save_tiny_gpt_oss(path, *, seed: int = 0) -> Path:
    """A random gpt-oss saved with save_pretrained: norms perturbed, biases random (they
    initialise to zero), sinks of std 1, router weights scaled so routing is decisive, the
    experts' and head's weights scaled so the clamp binds and tokens are clear-cut."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_gpt_oss_config(), attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            if name.endswith("router.weight"):
                param.mul_(20.0)
            if name.endswith(("gate_up_proj", "down_proj")):
                param.mul_(5.0)
            if name == "lm_head.weight":
                param.mul_(10.0)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """PROMPT_LENGTHS prompts, each starting with the same PREFIX tokens."""
    return prompts_with_shared_prefix(vocab, list(PROMPT_LENGTHS), prefix=PREFIX, seed=seed)


def hf_greedy(path, token_prompts: list[list[int]], max_new_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens for each prompt alone (dense_families.hf_greedy)."""
    return dense_families.hf_greedy(path, token_prompts, max_new_tokens)


def engine_greedy(path, token_prompts, max_tokens: int = MAX_TOKENS, **engine_kwargs):
    """Our greedy tokens, every prompt submitted together to one LLM; its pool is whole
    again after (dense_families.engine_greedy)."""
    return dense_families.engine_greedy(path, token_prompts, max_tokens, **engine_kwargs)
