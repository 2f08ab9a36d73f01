"""Reading a PEFT LoRA adapter into host memory, checked against the model and the slots.

A PEFT directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors with, for each adapted projection of layer i,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

(mlp.gate_proj, ... alike; a mixture-of-experts model's attention projections only). `load_adapter` reads and checks everything before it returns, so a
bad adapter leaves nothing behind: each problem is a LoRAError (a ValueError) of one line
naming the adapter. The weights are kept as A [in, r] and B * scale [r, out] per (layer,
module); `slot_weights` pads them to the slots' rank (models/lora.py's layout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

from jpaged.lora.request import LoRARequest
from models import lora as device_lora
from models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_UIDS = itertools.count(1)  # one per adapter read


class LoRAError(ValueError):
    """A bad adapter: one line naming it and the problem."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"LoRA adapter {name!r}: {problem}")
        self.adapter_name = name


@dataclasses.dataclass(frozen=True, eq=False)
class HostAdapter:
    """One adapter read into host memory. weights: (layer, module) -> (A [in, r], scaled
    B [r, out]) float32; digest: sha256 of its two files (what the prefix cache's salt
    names, also across processes: the KV disk tier); uid: unique per read."""

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: str = ""
    uid: int = dataclasses.field(default_factory=lambda: next(_UIDS))

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def slot_weights(self, cfg: ModelConfig, rank: int) -> dict[str, np.ndarray]:
        """{lora_a_<module>: [L, in, rank], lora_b_<module>: [L, rank, out]}: this adapter
        zero-padded to the slots' rank, zeros for the modules and layers it leaves alone."""
        out = {}
        for module, (n_in, n_out) in device_lora.module_dims(cfg).items():
            a = np.zeros((cfg.num_layers, n_in, rank), np.float32)
            b = np.zeros((cfg.num_layers, rank, n_out), np.float32)
            for layer in range(cfg.num_layers):
                pair = self.weights.get((layer, module))
                if pair is not None:
                    a[layer, :, : pair[0].shape[1]] = pair[0]
                    b[layer, : pair[1].shape[0]] = pair[1]
            out[device_lora.a_name(module)] = a
            out[device_lora.b_name(module)] = b
        return out


def _config(request: LoRARequest) -> dict:
    name, path = request.lora_name, Path(request.lora_path)
    if not path.is_dir():
        raise LoRAError(name, f"{path} is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(name, f"{file} is missing")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(name, f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAError(name, f"{file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(name, f"peft_type {peft_type!r} is not LORA")
    for flag in ("use_dora", "lora_bias"):
        if config.get(flag):
            raise LoRAError(name, f"{flag} adapters are not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise LoRAError(name, f"per-module ranks or alphas ({pattern}) are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(name, f"modules_to_save {config['modules_to_save']} are not supported")
    return config


def _scale(name: str, config: dict) -> tuple[int, float]:
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(name, f"r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRAError(name, f"lora_alpha must be a number, got {alpha!r}")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _moe_error(name: str, what: str) -> LoRAError:
    return LoRAError(
        name,
        f"{what}: a mixture-of-experts model's experts and router are not adaptable, only "
        f"its attention projections ({', '.join(device_lora.ATTENTION_MODULES)})",
    )


def _targets(name: str, config: dict, cfg: ModelConfig) -> set[str] | None:
    """The target_modules list (None: a regex, checked by the tensors' names instead)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return None
    if not isinstance(targets, list) or not targets:
        raise LoRAError(name, f"target_modules must be a list of module names, got {targets!r}")
    if cfg.num_experts:
        others = sorted(set(targets) - set(device_lora.ATTENTION_MODULES))
        if others:
            raise _moe_error(name, f"target module(s) {', '.join(map(str, others))}")
    unknown = sorted(set(targets) - set(device_lora.MODULES))
    if unknown:
        raise LoRAError(
            name,
            f"target module(s) {', '.join(unknown)} not in the model's adaptable modules "
            f"({', '.join(device_lora.MODULES)})",
        )
    return set(targets)


def _tensors(name: str, path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(name, f"{file} is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise LoRAError(name, f"{file} is not a readable safetensors file ({e})") from None


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> HostAdapter:
    """Reads and checks a PEFT adapter for a model of cfg and slots of rank max_rank.

    Raises:
      LoRAError: a missing or corrupt file, a rank above max_rank, a target module the
        model lacks, a tensor of the wrong shape or a missing half of a pair.
    """
    name = request.lora_name
    config = _config(request)
    rank, scale = _scale(name, config)
    if rank > max_rank:
        raise LoRAError(name, f"rank {rank} exceeds max_lora_rank {max_rank}")
    targets = _targets(name, config, cfg)
    dims = device_lora.module_dims(cfg)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in _tensors(name, Path(request.lora_path)).items():
        m = _KEY.match(key)
        if m is None and cfg.num_experts and ".lora_" in key:
            raise _moe_error(name, f"tensor {key}")
        if m is None:
            raise LoRAError(name, f"tensor {key} is not a LoRA weight of a decoder layer")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in dims and cfg.num_experts:
            raise _moe_error(name, f"tensor {key}")
        if module not in dims:
            raise LoRAError(name, f"target module {module} is not one the model has ({key})")
        if targets is not None and module not in targets:
            raise LoRAError(name, f"tensor {key} is for {module}, not in target_modules")
        if layer >= cfg.num_layers:
            raise LoRAError(name, f"layer {layer} past the model's {cfg.num_layers} ({key})")
        n_in, n_out = dims[module]
        want = (rank, n_in) if half == "A" else (n_out, rank)
        if tensor.shape != want:
            raise LoRAError(name, f"{key} has shape {list(tensor.shape)}, expected {list(want)}")
        if not np.issubdtype(tensor.dtype, np.floating) and tensor.dtype.name != "bfloat16":
            raise LoRAError(name, f"{key} has dtype {tensor.dtype}, not a float")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAError(name, "no LoRA weights in the adapter")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise LoRAError(name, f"layer {layer} {module} has no lora_{missing} weight")
        a = np.asarray(pair["A"], np.float32).T  # [in, r]
        b = np.asarray(pair["B"], np.float32).T * np.float32(scale)  # [r, out]
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoRAError(name, f"layer {layer} {module} has non-finite weights")
        weights[(layer, module)] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    digest = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((Path(request.lora_path) / file).read_bytes())
    return HostAdapter(request=request, rank=rank, scale=scale, weights=weights,
                       digest=digest.hexdigest())  # fmt: skip
