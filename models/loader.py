"""The one entry point for loading a model: a path or name in, a LoadedModel out.

`load_model` and `read_config` accept every form jpaged reads and pick its loader:

  "org/name" (not a local path)        models/hub.py: fetched into the Hugging Face cache
  a .gguf file, or a directory with    models/gguf.py
    exactly one .gguf and no config.json
  a directory with params/             models/orbax_checkpoint.py
  a directory with config.json         models/hf_checkpoint.py

Every loader returns the same LoadedModel (params in the layout of models/config.py, the
tokenizer, EOS ids, chat template, BOS/EOS texts, sampling defaults). The Hugging Face names
are re-exported here, so `from models.loader import load_hf_model, save_hf_model` keeps
working; this module imports the loaders and none of them imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from models import gguf, hub, orbax_checkpoint
from models.config import ModelConfig
from models.hf_checkpoint import (
    LoadedModel,
    load_hf_model,
    read_hf_config,
    resolve_dtype,
    save_hf_model,
)

__all__ = [
    "LoadedModel",
    "load_hf_model",
    "load_model",
    "read_config",
    "resolve_dtype",
    "save_hf_model",
]


def load_model(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: Any = None,
    revision: str | None = None,
    stacked: bool | Callable[[ModelConfig], bool] = False,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Loads any model jpaged reads (see the module docstring).

    Args:
      path: a local path, or a Hub repo id "org/name".
      dtype: dtype of every param (default: bfloat16 on an accelerator, float32 on CPU).
      mesh: a Mesh of models.sharding (None: every param on the default device).
      revision: branch, tag or commit of a Hub repo (default "main").
      stacked: params["layers"] as one dict of [num_layers, ...] arrays (for lax.scan),
        built on the host by the HF and GGUF loaders (a callable: decided from the model's
        config once read, as EngineConfig.scans_layers); an Orbax checkpoint (saved per layer)
        is restored per layer and stacked on the devices (models/llama.py stack_layers), or
        with quantization stacked on the host as HF's.
      expert_parallel: a mixture-of-experts model's experts split over the mesh's
        tensor-parallel devices (ModelConfig.with_expert_parallel); HF and GGUF only.
      quantization: "int8" or "fp8" weights (models/quantization.py; an Orbax checkpoint is
        then restored to the host and quantized there, orbax_checkpoint.load_orbax_model);
        None: float weights in dtype (a compressed-tensors fp8 checkpoint still loads fp8).

    Raises:
      FileNotFoundError, ValueError: as the chosen loader; ValueError for a repo that cannot
        be fetched. The message names the file or repo and what is wrong.
    """
    local = hub.resolve_model_path(str(path), revision)
    gguf_file = gguf.find_gguf(local)
    if gguf_file is not None:
        return gguf.load_gguf_model(
            gguf_file, dtype=dtype, mesh=mesh, stacked=stacked, expert_parallel=expert_parallel,
            quantization=quantization,
        )
    if orbax_checkpoint.is_orbax_dir(local):
        if expert_parallel:
            raise ValueError(f"{local}: expert parallelism is not supported for Orbax checkpoints")
        return orbax_checkpoint.load_orbax_model(
            local, dtype=dtype, mesh=mesh, stacked=stacked, quantization=quantization
        )
    return load_hf_model(
        local, dtype=dtype, mesh=mesh, stacked=stacked, expert_parallel=expert_parallel,
        quantization=quantization,
    )


def read_config(path: str | os.PathLike, *, revision: str | None = None) -> ModelConfig:
    """The ModelConfig of any model load_model reads, without loading weights (for sizing a
    mesh or max_model_len: ModelConfig.max_position_embeddings).

    A Hugging Face or Orbax directory: config.json, with eos_token_ids from
    generation_config.json when it has them. A GGUF: its metadata. A Hub repo id is resolved
    through the Hugging Face cache first (at revision).
    """
    local = hub.resolve_model_path(str(path), revision)
    gguf_file = gguf.find_gguf(local)
    if gguf_file is not None:
        return gguf.read_gguf_config(gguf_file)
    return read_hf_config(local)
