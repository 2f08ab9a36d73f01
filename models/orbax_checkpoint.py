"""Orbax checkpoints of the params: written from a Hugging Face directory, restored into shards.

A converted model directory is a loadable model directory:

    CKPT_DIR/config.json, generation_config.json, tokenizer.json,  (copied from the HF dir
             tokenizer_config.json, special_tokens_map.json,        when present)
             chat_template.jinja
    CKPT_DIR/params/                                               (Orbax, params layout of
                                                                    models/config.py)

Restoring builds the target from the config alone (shape, dtype, NamedSharding per param), so
Orbax reads on each device only the slice that device holds: no full copy on the host.
Quantized weights (quantization="int8" / "fp8") are the exception: the checkpoint is restored
to the host in its stored dtype and quantized there, as a Hugging Face directory is, before
each param is placed (load_orbax_model).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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
    e, fe, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    shapes.update(
        router=(d, e), w_gate_exps=(e, d, fe), w_up_exps=(e, d, fe), w_down_exps=(e, fe, d),
        router_bias=(e,), w_gate_shared=(d, fs), w_up_shared=(d, fs), w_down_shared=(fs, d),
    )  # fmt: skip
    shapes.update(  # gpt-oss (attention_sinks, o_bias, router_logit_bias, expert_bias)
        bo=(d,), sinks=(hq,), b_router=(e,), b_gate_exps=(e, fe), b_up_exps=(e, fe),
        b_down_exps=(e, d),
    )  # fmt: skip
    if cfg.qk_norm_full:  # OLMoE's norms over the whole projection
        shapes.update(q_norm=(hq, dh), k_norm=(hkv, dh))
    return shapes[key[-1]]


def load_orbax_model(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: Any = None,
    stacked: bool | Callable[[ModelConfig], bool] = False,
    quantization: str | None = None,
) -> hf_checkpoint.LoadedModel:
    """Restores a converted directory straight into the mesh's shardings (or one device).

    Args:
      path: a directory convert_hf_to_orbax wrote.
      dtype: dtype of every float param (default: the loader's default for this platform).
      mesh: a Mesh of models.sharding (None: one device).
      stacked: params["layers"] as one dict of [num_layers, ...] arrays (a callable: decided
        from the config): restored per layer (as saved) and stacked on the devices
        (models/llama.py stack_layers); quantized, stacked on the host by build_params.
      quantization: "int8" or "fp8": the layer projections quantized per output channel at
        load, exactly as load_hf_model does (models.quantization.quantize_param; embeddings,
        norms, LM head and router stay in dtype), then placed as that loader places them
        (models.sharding.quantized_shardings under a mesh). The memory trade-off: the whole
        checkpoint is restored to the host in its stored dtype (not into shards), each param
        quantized (or cast) there and dropped once placed, so the host holds the model once
        as stored. The values equal those of the Hugging Face directory loaded with the same
        flag when the conversion kept its dtype (convert --dtype float32 for a float32 one).

    Raises:
      ValueError: an unknown quantization; quantized, a param missing from the checkpoint,
        one it holds that the config does not imply, or one of another shape (the message
        names the params directory and the param).
    """
    import orbax.checkpoint as ocp

    from models import quantization as quant

    quant.check_method(quantization)
    model_dir = Path(path).absolute()
    t0 = time.perf_counter()
    config = hf_checkpoint.read_hf_config(model_dir)
    if callable(stacked):
        stacked = stacked(config)
    target_dtype = hf_checkpoint.resolve_dtype(dtype)
    if quantization is not None:
        params = _restore_quantized(
            model_dir / PARAMS_DIR, config, target_dtype, mesh, stacked, quantization
        )
    else:
        target = abstract_params(config, target_dtype, mesh)
        params = ocp.StandardCheckpointer().restore(model_dir / PARAMS_DIR, target)
        if stacked:
            params = _stack_on_devices(config, params, mesh)
    logger.info(
        "restored %s from Orbax in %.2fs (%s%s)",
        model_dir,
        time.perf_counter() - t0,
        "one device" if mesh is None else f"mesh {dict(mesh.shape)}",
        f", {quantization} on the host" if quantization else "",
    )
    return hf_checkpoint.directory_model(model_dir, config, params, mesh)


def _stack_on_devices(config: ModelConfig, params: dict, mesh: Any) -> dict:
    """Restored per-layer params stacked for lax.scan, each stacked array on its sharding."""
    import jax

    from models.llama import stack_layers
    from models.sharding import param_shardings

    place = None
    if mesh is not None:
        layers = param_shardings(config, mesh, stacked=True)["layers"]
        place = lambda name, a: jax.device_put(a, layers[name])
    return stack_layers(params, place)


def _restore_quantized(
    params_dir: Path, config: ModelConfig, dtype: Any, mesh: Any, stacked: bool, method: str
) -> dict:
    """The params of load_orbax_model(quantization=method): restored to the host in their
    stored dtype, then quantized, cast and placed by hf_checkpoint.build_params with the
    quantize callback load_hf_model uses (each param read in the layout as stored)."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    stored = checkpointer.metadata(params_dir).item_metadata.tree
    # No sharding in the target: Orbax restores numpy arrays on the host.
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored)
    host = _by_name(params_dir, checkpointer.restore(params_dir, target))
    specs = {  # the param as stored, named "PARAMS_DIR/layers.0.wq" in errors
        key: hf_checkpoint.TensorSpec(
            f"{params_dir}/{'.'.join(map(str, key))}",
            _layout_shape(config, key),
            _as_stored,
            _as_stored,
        )
        for key in hf_checkpoint.tensor_specs(config)
    }
    unexpected = sorted(set(host) - {spec.hf_name for spec in specs.values()})
    if unexpected:
        shown = ", ".join(n.rpartition("/")[2] for n in unexpected[:5])
        raise ValueError(f"{params_dir}: param(s) {shown} not implied by {config.architecture}")

    def read(spec: hf_checkpoint.TensorSpec) -> np.ndarray:
        array = host.pop(spec.hf_name, None)  # the host copy goes once the param is placed
        if array is None:
            raise ValueError(f"{spec.hf_name}: missing from the checkpoint")
        if array.shape != spec.hf_shape:
            raise ValueError(
                f"{spec.hf_name}: shape {list(array.shape)}, expected {list(spec.hf_shape)} "
                f"from {hf_checkpoint.CONFIG_FILE}"
            )
        return array

    return hf_checkpoint.build_params(
        config,
        specs,
        read,
        dtype=dtype,
        mesh=mesh,
        stacked=stacked,
        quantize=hf_checkpoint.quantizer(method),
    )


def _by_name(params_dir: Path, tree: dict) -> dict[str, np.ndarray]:
    """The restored arrays by "params_dir/layers.0.wq"."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        f"{params_dir}/" + ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): a
        for path, a in leaves
    }


def _as_stored(x: np.ndarray) -> np.ndarray:
    """An Orbax param is already in the layout (its TensorSpec maps nothing)."""
    return x
