"""Orbax checkpoints of the params: written from a Hugging Face directory, restored into shards.

A converted model directory is a loadable model directory:

    CKPT_DIR/config.json, generation_config.json, tokenizer.json,  (copied from the HF dir
             tokenizer_config.json, special_tokens_map.json,        when present)
             chat_template.jinja
    CKPT_DIR/params/                                               (Orbax, params layout of
                                                                    models/config.py)

Restoring builds the target from the config alone (shape, dtype, NamedSharding per param), so
Orbax reads on each device only the slice that device holds: no full copy on the host.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from models import hf_checkpoint
from models.config import ModelConfig

logger = logging.getLogger(__name__)

PARAMS_DIR = "params"
_COPIED_FILES = (
    hf_checkpoint.CONFIG_FILE,
    hf_checkpoint.GENERATION_CONFIG_FILE,
    hf_checkpoint.TOKENIZER_FILE,
    hf_checkpoint.TOKENIZER_CONFIG_FILE,
    hf_checkpoint.SPECIAL_TOKENS_MAP_FILE,
    hf_checkpoint.CHAT_TEMPLATE_FILE,
)


def is_orbax_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / PARAMS_DIR).is_dir()


def convert_hf_to_orbax(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Any = None
) -> Path:
    """Writes out_dir (config and tokenizer files + Orbax params) from a Hugging Face directory.

    Args:
      hf_dir: a directory load_hf_model reads.
      out_dir: created; must not already hold params.
      dtype: dtype of the stored params (default: the loader's default for this platform).

    Returns:
      out_dir.
    """
    import orbax.checkpoint as ocp

    src, out = Path(hf_dir), Path(out_dir).absolute()
    if is_orbax_dir(out):
        raise ValueError(f"{out}: already holds an Orbax checkpoint ({PARAMS_DIR}/)")
    loaded = hf_checkpoint.load_hf_model(src, dtype=dtype, on_host=True)
    out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / PARAMS_DIR, loaded.params)
    checkpointer.wait_until_finished()
    return out


def abstract_params(cfg: ModelConfig, dtype: Any, mesh: Any = None) -> dict:
    """jax.ShapeDtypeStruct per param (with its NamedSharding under a mesh)."""
    import jax

    from models.sharding import param_shardings

    shapes = {key: _layout_shape(cfg, key) for key in hf_checkpoint.tensor_specs(cfg)}
    shardings = param_shardings(cfg, mesh) if mesh is not None else None
    params: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
    for key, shape in shapes.items():
        if key[0] == "layers":
            sharding = shardings["layers"][key[1]][key[2]] if shardings else None
            params["layers"][key[1]][key[2]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        else:
            sharding = shardings[key[0]] if shardings else None
            params[key[0]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return params


def _layout_shape(cfg: ModelConfig, key: tuple) -> tuple[int, ...]:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {
        "embed": (v, d),
        "final_norm": (d,),
        "lm_head": (d, v),
        "input_norm": (d,),
        "post_attn_norm": (d,),
        "attn_out_norm": (d,),
        "mlp_out_norm": (d,),
        "wq": (d, hq, dh),
        "wk": (d, hkv, dh),
        "wv": (d, hkv, dh),
        "wo": (hq, dh, d),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
        "bq": (hq, dh),
        "bk": (hkv, dh),
        "bv": (hkv, dh),
        "q_norm": (dh,),
        "k_norm": (dh,),
    }
    e, fe = cfg.num_experts, cfg.moe_intermediate_size
    shapes.update(
        router=(d, e), w_gate_exps=(e, d, fe), w_up_exps=(e, d, fe), w_down_exps=(e, fe, d)
    )
    if cfg.qk_norm_full:  # OLMoE's norms over the whole projection
        shapes.update(q_norm=(hq, dh), k_norm=(hkv, dh))
    return shapes[key[-1]]


def load_orbax_model(
    path: str | os.PathLike, *, dtype: Any = None, mesh: Any = None
) -> hf_checkpoint.LoadedModel:
    """Restores a converted directory straight into the mesh's shardings (or one device)."""
    import orbax.checkpoint as ocp

    model_dir = Path(path).absolute()
    t0 = time.perf_counter()
    config = hf_checkpoint.read_hf_config(model_dir)
    target = abstract_params(config, hf_checkpoint.resolve_dtype(dtype), mesh)
    params = ocp.StandardCheckpointer().restore(model_dir / PARAMS_DIR, target)
    logger.info(
        "restored %s from Orbax in %.2fs (%s)",
        model_dir,
        time.perf_counter() - t0,
        "one device" if mesh is None else f"mesh {dict(mesh.shape)}",
    )
    return hf_checkpoint.directory_model(model_dir, config, params, mesh)
