"""Random PEFT LoRA adapters for tests, and the reference: the adapter merged into a copy of
the base checkpoint (W + scale * B @ A, by hand in numpy), which transformers then runs.

The files are written as PEFT saves them: adapter_config.json and adapter_model.safetensors
with base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in] and
...lora_B.weight [out, r] for every target module of every layer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

_PLACES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ALL_MODULES = tuple(_PLACES)


def _dims(config: dict) -> dict[str, tuple[int, int]]:
    d, f = config["hidden_size"], config["intermediate_size"]
    h, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    dh = config.get("head_dim") or d // h
    q, k = h * dh, (kv or h) * dh
    return {"q_proj": (d, q), "k_proj": (d, k), "v_proj": (d, k), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip


def write_adapter(
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
    """A random adapter for the checkpoint at base, saved as PEFT does into path."""
    from safetensors.numpy import save_file

    config = json.loads((Path(base) / "config.json").read_text())
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module in modules:
            n_in, n_out = _dims(config)[module]
            key = f"base_model.model.model.layers.{i}.{_PLACES[module]}.{module}"
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


def merge(base: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """A copy of the checkpoint at base with the adapter merged into its weights."""
    from safetensors.numpy import load_file, save_file

    base, adapter, out = Path(base), Path(adapter), Path(out)
    shutil.copytree(base, out)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = weights[name]
        merged = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        weights[name] = merged.astype(w.dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
