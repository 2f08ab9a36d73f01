"""Which model an EngineConfig names, and loading it onto the devices its parallelism asks for.

    load_for_config(config) -> LoadedModel     # sharded over a mesh when T x D > 1 or multi-host

The built-in demo model stands in when config.model is None.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jpaged.config import EngineConfig
from models import sharding
from models.loader import LoadedModel, load_model, read_config


def model_path(config: EngineConfig) -> Path:
    if config.model is not None:
        return Path(config.model)
    from models.demo import ensure_demo_model

    return Path(ensure_demo_model())


def load_for_config(config: EngineConfig, *, data_parallel: bool = False) -> LoadedModel:
    """The model of config, sharded over a mesh when it asks for more than one device.

    Without data_parallel the mesh is replica 0's (T devices); with it, all D x T devices.
    """
    path = model_path(config)
    p = config.parallel
    mesh = None
    if p.num_devices > 1 or jax.process_count() > 1:
        d = p.data_parallel_size if data_parallel else 1
        mesh = sharding.make_mesh(read_config(path), p.tensor_parallel_size, d)
    return load_model(path, dtype=config.dtype, mesh=mesh)
