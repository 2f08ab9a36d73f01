"""Random PEFT LoRA adapters for a checkpoint, written as PEFT saves them (benchmarks and tests).

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight   [out, r]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# The seven projections an adapter may target, and the submodule each one sits in.
PLACES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL_MODULES = tuple(PLACES)


def write_random_adapter(
    path: str | Path,
    base: str | Path,
    *,
    rank: int,
    modules=ALL_MODULES,
    alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
    dtype=np.float32,
) -> Path:
    """A random adapter (normal(0, std) A and B) for the checkpoint at base (a Hugging Face
    directory or a GGUF), saved as PEFT does into path; lora_alpha defaults to 2 * rank."""
    from safetensors.numpy import save_file

    from models.loader import read_config

    cfg = read_config(str(base))
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, k = cfg.num_heads * dh, cfg.num_kv_heads * dh
    dims = {"q_proj": (d, q), "k_proj": (d, k), "v_proj": (d, k), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for module in modules:
            n_in, n_out = dims[module]
            key = f"base_model.model.model.layers.{i}.{PLACES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, std, (rank, n_in)).astype(dtype)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, std, (n_out, rank)).astype(dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "use_rslora": use_rslora,
        "target_modules": list(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out
