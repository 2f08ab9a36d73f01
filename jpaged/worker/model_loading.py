"""Which model an EngineConfig names, and loading it onto the devices its parallelism asks for.

    load_for_config(config) -> LoadedModel     # sharded over a mesh when T x D > 1 or multi-host

config.model is a local path (a Hugging Face or Orbax directory, a .gguf file or a directory
holding one), a Hub repo id ("org/name", at config.revision), "demo-random" (the random demo
model) or None: the built-in real model, SmolLM2-135M-Instruct, fetched once into jpaged's
cache (models/demo.py).
"""

from __future__ import annotations

import dataclasses
import functools

from jpaged.config import EngineConfig
from models import sharding
from models.demo import builtin_generation_defaults, resolve_builtin
from models.llama import switches_layers
from models.loader import LoadedModel, load_model, read_config


def model_path(config: EngineConfig) -> str:
    return resolve_builtin(config.model)


def _stacks_layers(config: EngineConfig, platform: str, mesh, model_config) -> bool:
    """Whether the loader stacks the layers: when the engine scans them over stacked
    weights (not switched per layer on the CPU: models/llama.py switches_layers)."""
    switched = switches_layers(model_config, platform, sharded=mesh is not None)
    return config.scans_layers(platform, model_config) and not switched


def load_for_config(config: EngineConfig, *, data_parallel: bool = False) -> LoadedModel:
    """The model of config, sharded over a mesh when it asks for more than one device.

    Without data_parallel the mesh is replica 0's (T devices); with it, all D x T devices.
    The layers come stacked when the engine scans them over stacked weights
    (EngineConfig.scans_layers; on the CPU they are switched per layer: _stacks_layers). The
    built-in model's file gets the sampling defaults jpaged ships for it
    (models.demo.SMOLLM2_GENERATION_DEFAULTS) under any its metadata sets.
    """
    import jax

    path = model_path(config)
    p = config.parallel
    mesh = None
    if p.num_devices > 1 or jax.process_count() > 1:
        d = p.data_parallel_size if data_parallel else 1
        cfg = read_config(path, revision=config.revision)
        cfg = cfg.with_expert_parallel(p.enable_expert_parallel)
        mesh = sharding.make_mesh(cfg, p.tensor_parallel_size, d)
    loaded = load_model(
        path,
        dtype=config.dtype,
        mesh=mesh,
        revision=config.revision,
        expert_parallel=p.enable_expert_parallel,
        stacked=functools.partial(_stacks_layers, config, jax.default_backend(), mesh),
        quantization=config.quantization,
    )
    shipped = builtin_generation_defaults(path)
    if shipped:
        defaults = {**shipped, **loaded.generation_defaults}
        loaded = dataclasses.replace(loaded, generation_defaults=defaults)
    return loaded
