"""Runs engines on simulated CPU devices in a fresh process; prints one JSON line of results.

    python tests/parallel/sharded_worker.py tp CKPT ORBAX_DIR     # 8 devices, one process
    python tests/parallel/sharded_worker.py multihost CKPT ADDR N I OUT   # 4 devices each
    python tests/parallel/sharded_worker.py quant CKPT TMP_DIR     # quantized weights, 8 devices
    python tests/parallel/sharded_worker.py orbax_quant CKPT TMP_DIR   # Orbax + int8/fp8, T = 2
    python tests/parallel/sharded_worker.py lora CKPT TMP_DIR      # LoRA adapters, T = 1 and 8
    python tests/parallel/sharded_worker.py host_write     # the host tier's per-shard writes

The device count must be set before JAX starts, so the tests run this file as a subprocess
(pytest's own process has already initialised JAX with one device).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

# (tensor_parallel_size, data_parallel_size) checked against T = 1.
CONFIGS = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2))
ENGINE = {
    "max_num_seqs": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 32,
    "page_size": 16,
    "num_pages": 32,
    # the accelerators' smallest token bucket (the CPU's is 4): the program counts and
    # collectives the tests assert are those a sharded GPU/TPU engine runs
    "min_token_bucket": 16,
    "compilation_cache_dir": None,
}


def prompts() -> list:
    """Mixed: short text, a prompt longer than one step's token budget (chunked), repeats."""
    long = [(7 * i) % 1900 + 20 for i in range(40)]
    return ["Hello world", "The meaning of life is", long, [5, 6, 7, 8, 9], "Hello world, again"]


def sampling():
    from jpaged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _env(num_devices: int) -> None:
    from simulated_devices import set_simulated_devices

    set_simulated_devices(num_devices)


def _generate(llm) -> dict:
    outs = llm.generate(prompts(), sampling())
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[sorted(step.items()) for step in o.outputs[0].logprobs] for o in outs],
    }


def assert_same_tokens_and_logprobs(res: dict, base: dict) -> None:
    """A worker run's greedy tokens equal base's exactly, and the top logprobs of each step
    name the same tokens with values within 1e-5."""
    import numpy as np

    assert res["tokens"] == base["tokens"]
    for ours, ref in zip(res["logprobs"], base["logprobs"], strict=True):
        for pos_ours, pos_ref in zip(ours, ref, strict=True):
            assert [t for t, _ in pos_ours] == [t for t, _ in pos_ref]
            np.testing.assert_allclose(
                [lp for _, lp in pos_ours], [lp for _, lp in pos_ref], rtol=0, atol=1e-5
            )


def _layout(runner) -> dict:
    """Spec and per-device shape of each weight of the layers (stacked: "layers.wq"; a list:
    layer 0's, "layers.0.wq") and the top level, and pool bytes."""
    p = runner.params
    named = {"embed": p["embed"], "final_norm": p["final_norm"], "lm_head": p.get("lm_head")}
    if isinstance(p["layers"], dict):
        named.update({f"layers.{k}": v for k, v in p["layers"].items()})
    else:
        named.update({f"layers.0.{k}": v for k, v in p["layers"][0].items()})
    weights = {}
    for name, x in named.items():
        if x is None:
            continue
        x = getattr(x, "panels", x)  # a weight packed for the CPU (models/packed.py): its panels
        spec = getattr(x.sharding, "spec", None)
        weights[name] = [str(spec), list(x.addressable_shards[0].data.shape)]
    k = runner.state.k_pages
    return {
        "weights": weights,
        "pool_total_bytes": k.nbytes,
        "pool_device_bytes": [s.data.nbytes for s in k.addressable_shards],
        "pool_devices": len(k.sharding.device_set),
    }


def _collectives(runner) -> list[dict]:
    out = []
    for key in runner.programs.step_keys():
        text = runner.programs.executable(key).as_text()
        out.append(
            {
                "key": repr(key),
                "modules": len(re.findall(r"^HloModule ", text, re.MULTILINE)),
                "all_reduce": len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
                "all_gather": len(re.findall(r"\ball-gather(?:-start)?\(", text)),
            }
        )
    return out


def run_tp(ckpt: str, orbax_dir: str) -> dict:
    _env(8)
    import jax
    import numpy as np

    from jpaged import LLM
    from models.orbax_checkpoint import convert_hf_to_orbax

    results = {}
    for t, d in CONFIGS:
        llm = LLM(ckpt, tensor_parallel_size=t, data_parallel_size=d, **ENGINE)
        res = _generate(llm)
        engine = llm.llm_engine
        replicas = getattr(engine, "replicas", [engine])
        res["layout"] = _layout(replicas[0].runner)
        res["replica_steps"] = [r.runner.programs.num_compiled for r in replicas]
        res["replica_devices"] = [
            sorted(d.id for d in r.runner.state.k_pages.sharding.device_set)
            for r in replicas
        ]
        if t > 1:
            res["collectives"] = _collectives(replicas[0].runner)
        if (t, d) == (4, 1):
            hf_params = engine.runner.params
        results[f"{t}x{d}"] = res
    # The unrolled layer loop (scan_layers off) under T = 2: same tokens, per-layer weights.
    llm = LLM(ckpt, tensor_parallel_size=2, scan_layers=False, **ENGINE)
    res = _generate(llm)
    res["layout"] = _layout(llm.llm_engine.runner)
    res["collectives"] = _collectives(llm.llm_engine.runner)
    results["unrolled_2x1"] = res
    for t in (2, 8):  # swap preemption: 4 usable pages for 5 prompts of up to 3 pages
        engine = dict(ENGINE, num_pages=5, preemption_mode="swap", num_swap_pages=16)
        if t == 2:  # with the KV host tier, whose 16 host pages (8 KiB) are the swap space
            engine = dict(engine, num_swap_pages=None, kv_offload_bytes=17 * 8192)
        llm = LLM(ckpt, tensor_parallel_size=t, **engine)
        res = _generate(llm)
        if t == 2:  # the same prompts again: their evicted pages come back from host
            res["again"] = _generate(llm)["tokens"]
        res["stats"] = llm.stats()
        res["pool_spec"] = str(llm.llm_engine.runner.state.k_pages.sharding.spec)
        results[f"swap_{t}x1"] = res
    convert_hf_to_orbax(ckpt, orbax_dir)
    llm = LLM(orbax_dir, tensor_parallel_size=4, **ENGINE)
    results["orbax_4x1"] = _generate(llm)
    results["orbax_4x1"]["layout"] = _layout(llm.llm_engine.runner)
    same = jax.tree_util.tree_map(
        lambda a, b: a.sharding == b.sharding and bool(np.array_equal(a, b)),
        llm.llm_engine.runner.params,
        hf_params,
    )
    results["orbax_4x1"]["params_equal_hf"] = all(jax.tree_util.tree_leaves(same))
    return results


def _quantized_layout(params) -> dict:
    """Spec and per-device shape of each array of the stacked quantized params ("wq.q",
    "wq.scale", "w_down.offset"; layer 0's where the layers are per-layer params), and of one
    float one (input_norm)."""
    out = {}
    layers = params["layers"]  # one device on the CPU: a tuple of per-layer params (switched)
    for name, x in (layers if isinstance(layers, dict) else layers[0]).items():
        arrays = {"q": x.q, "scale": x.scale, "offset": x.offset} if hasattr(x, "q") else {"": x}
        for part, a in arrays.items():
            if a is not None:
                key = f"{name}.{part}" if part else name
                spec = getattr(a.sharding, "spec", None)
                out[key] = [str(spec), list(a.addressable_shards[0].data.shape)]
    return out


def run_quant(ckpt: str, tmp: str) -> dict:
    """int8 and fp8 weights of CKPT (quantized at load) and GGUF Q4_1 (blocks of 32 with
    offsets) at T = 1 and T = 2; int8 under D = 2 x T = 2; a Q8_0 file whose blocks cannot
    split over T = 2 (its refusal)."""
    _env(8)
    from checkpoints import write_gguf
    from numpy_checkpoints import make_llama_checkpoint

    from jpaged import LLM

    root = Path(tmp)
    # Head dim 32 (GGUF blocks of 32 along it for wo); F 512 = 16 blocks for w_down.
    hf = make_llama_checkpoint(root / "hf128", hidden=128, heads=4, kv_heads=2, intermediate=512)
    q4_1 = root / "q4_1.gguf"
    write_gguf(hf, q4_1, "Q4_1")
    # F 96 = 3 blocks of 32 along w_down's input: not whole blocks on each of 2 devices.
    odd = make_llama_checkpoint(root / "hf96", hidden=128, heads=4, kv_heads=2, intermediate=96)
    write_gguf(odd, root / "odd.gguf", "Q8_0")

    results = {}
    for label, model, method in (
        ("int8", ckpt, "int8"), ("fp8", ckpt, "fp8"), ("q4_1", str(q4_1), "int8"),
    ):  # fmt: skip
        for t in (1, 2):
            llm = LLM(model, tensor_parallel_size=t, quantization=method, **ENGINE)
            res = _generate(llm)
            res["layout"] = _quantized_layout(llm.llm_engine.runner.params)
            res["weight_bytes"] = llm.stats()["weight_bytes"]
            results[f"{label}_{t}"] = res
    llm = LLM(ckpt, tensor_parallel_size=2, data_parallel_size=2, quantization="int8", **ENGINE)
    res = _generate(llm)
    stats = llm.stats()
    res["stats"] = {k: stats[k] for k in ("kv_cache_dtype", "kv_bytes_per_token", "quantization")}
    results["int8_2x2"] = res
    try:
        LLM(str(root / "odd.gguf"), tensor_parallel_size=2, quantization="int8", **ENGINE)
    except ValueError as e:
        results["odd_error"] = str(e)
    return results


def run_orbax_quant(ckpt: str, tmp: str) -> dict:
    """CKPT converted to Orbax (float32) and loaded with int8 / fp8 weights under a T = 2
    mesh (stacked, and int8 per layer too), against CKPT loaded the same way: the params of
    each load whose sharding or values differ (none expected), and the stacked layouts."""
    _env(8)
    import jax
    import numpy as np

    from models import sharding
    from models.loader import load_model, read_config
    from models.orbax_checkpoint import convert_hf_to_orbax

    orbax_dir = convert_hf_to_orbax(ckpt, Path(tmp) / "orbax", dtype="float32")
    mesh = sharding.make_mesh(read_config(ckpt), 2)
    results = {}
    for method, stacked in (("int8", True), ("fp8", True), ("int8", False)):
        ours, ref = (
            load_model(path, mesh=mesh, quantization=method, stacked=stacked).params
            for path in (orbax_dir, ckpt)
        )
        paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(ours)[0], strict=True)
        ref_paths, ref_leaves = zip(*jax.tree_util.tree_flatten_with_path(ref)[0], strict=True)
        res = {
            "params": len(leaves),
            "same_paths": paths == ref_paths,
            "different": [
                jax.tree_util.keystr(path)
                for path, a, b in zip(paths, leaves, ref_leaves, strict=True)
                if a.sharding != b.sharding or a.dtype != b.dtype or not np.array_equal(a, b)
            ],
        }
        if stacked:
            res["layout"] = _quantized_layout(ours)
            res["hf_layout"] = _quantized_layout(ref)
        results[f"{method}_{'stacked' if stacked else 'per_layer'}"] = res
    return results


def run_multihost(ckpt: str, addr: str, num_processes: str, process_id: str, out: str) -> dict:
    _env(4)
    from jpaged.worker.multihost import initialize

    initialize(addr, int(num_processes), int(process_id))
    import jax

    from jpaged import LLM

    llm = LLM(ckpt, tensor_parallel_size=jax.device_count(), **ENGINE)
    runner = llm.llm_engine.runner
    if jax.process_index() != 0:
        runner.follow()
        return {"followed": True}
    try:
        res = _generate(llm)
    finally:
        runner.stop_followers()
    res["devices"] = jax.device_count()
    res["processes"] = jax.process_count()
    res["layout"] = _layout(runner)
    Path(out).write_text(json.dumps(res))
    return res


def run_lora(ckpt: str, tmp: str) -> dict:
    """Two LoRA adapters (ranks 8 and 4, every module) and the base in one batch at T = 1
    and 8 (KV heads split over 4, each on two devices); the tokens (and the base model's alone at T = 1),
    and the slot params' layout at T = 8
    after a run-time load (the slot write keeps the shardings)."""
    _env(8)
    from jpaged import LLM, LoRARequest
    from jpaged.lora.random_adapter import write_random_adapter

    root = Path(tmp)
    a1 = write_random_adapter(root / "a1", ckpt, rank=8, seed=1)
    a2 = write_random_adapter(root / "a2", ckpt, rank=4, seed=2, modules=("q_proj", "v_proj",
                              "o_proj", "up_proj", "down_proj"))  # fmt: skip
    r1, r2 = LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))
    loras = [r1, None, r2, r1, None]
    results = {}
    for t in (1, 8):
        llm = LLM(ckpt, tensor_parallel_size=t, enable_lora=True, max_loras=2, max_lora_rank=8,
                  **ENGINE)  # fmt: skip
        outs = llm.generate(prompts(), sampling(), lora_request=loras)
        results[f"tokens_{t}"] = [o.outputs[0].token_ids for o in outs]
        if t == 1:  # the base model alone, each prompt
            outs = llm.generate(prompts(), sampling())
            results["base"] = [o.outputs[0].token_ids for o in outs]
        if t == 8:
            w = _layout(llm.llm_engine.runner)["weights"]
            results["layout"] = {k[len("layers.lora_") :]: v for k, v in w.items() if "lora_" in k}
    return results


def run_host_write() -> dict:
    """ModelRunner's host write (runner.write_host_pages) of swap gathers sharded over the KV
    heads, T = 8 and T = 2 of 4 KV heads (two replicas of each shard: "rep"), float32 and
    int8 pages with scales: are the host pages the gathered pages, per host id?"""
    _env(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpaged.worker.programs import SWAP_PAGES
    from jpaged.worker.runner import write_host_pages

    rng = np.random.default_rng(0)
    out = {}
    for kv, rep in ((8, 1), (2, 2)):
        mesh = Mesh(np.array(jax.devices()[: kv * rep]).reshape(kv, rep), ("kv", "rep"))
        sharding = NamedSharding(mesh, P(None, "kv"))
        heads, layers, page, dim, host_pages = 8, 3, 4, 2, 40
        ids = rng.permutation(np.arange(1, host_pages + 1))[:5]  # 5 of SWAP_PAGES filled
        pages = [rng.standard_normal((2, heads, layers * SWAP_PAGES, page, dim), np.float32),
                 rng.integers(-128, 128, (2, heads, layers * SWAP_PAGES, page), np.int8)]  # fmt: skip
        space = [np.zeros((2, heads, layers, host_pages + 1, page, dim), np.float32),
                 np.zeros((2, heads, layers, host_pages + 1, page), np.int8)]  # fmt: skip
        got = [jax.device_put(a, sharding) for a in pages]
        write_host_pages(space, got, ids)
        equal = True
        for a, host in zip(pages, space, strict=True):
            want = a.reshape(2, heads, layers, SWAP_PAGES, *a.shape[3:])[:, :, :, : len(ids)]
            equal &= bool(np.array_equal(host[:, :, :, ids], want))
            others = np.setdiff1d(np.arange(host_pages + 1), ids)
            equal &= not np.any(host[:, :, :, others])
        out[f"{kv}x{rep}"] = {"equal": equal, "shards": len(got[0].addressable_shards)}
    return out


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    modes = {
        "tp": run_tp,
        "multihost": run_multihost,
        "quant": run_quant,
        "orbax_quant": run_orbax_quant,
        "lora": run_lora,
        "host_write": run_host_write,
    }
    result = modes[mode](*args)
    print(json.dumps(result))
