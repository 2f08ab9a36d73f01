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

from jpaged.lora.random_adapter import write_random_adapter

# One writer serves the tests and scripts/bench_lora.py (jpaged/lora/random_adapter.py).
write_adapter = write_random_adapter


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
