"""transformers' side of scripts/bench_throughput.py, run by it in its own process.

    python scripts/bench_transformers_worker.py --model DIR --dtype bfloat16 \
        --workload-file W.json [--result-file PARTIAL.json] [--hf-batch-size 128]

--model is a Hugging Face directory or a .gguf file (loaded with gguf_file=, dequantized).

Padded generate (sdpa; on GPU also a compiled static cache) and generate_batch, each warmed
up first, on the prompts and output lengths of the workload file ({"prompts": [[ids]],
"output_lens": [n]}). What is measured so far is rewritten to --result-file after each mode
(a timeout loses only the mode it cut); the last line printed is the JSON of every figure.
Needs torch and transformers; jax is never imported here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run_transformers(args) -> None:
    """Subprocess body: padded generate (sdpa; also a compiled static cache on GPU) and
    generate_batch, each warmed up first; prints one JSON line."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"

    def load():
        path, kwargs = Path(args.model), {}
        if path.suffix == ".gguf":  # dequantized at load into dtype (needs the gguf package)
            path, kwargs = path.parent, {"gguf_file": path.name}
        # sdpa where the architecture has it; gpt-oss (its sinks) has only eager on the CPU
        config = transformers.AutoConfig.from_pretrained(path, **kwargs)
        attn = "eager" if config.model_type == "gpt_oss" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, args.dtype), attn_implementation=attn, **kwargs
        ).to(device)
        model.eval()
        model.generation_config.eos_token_id = None  # ignore EOS: requests run to their length
        model.generation_config.pad_token_id = 0
        return model

    def save():  # what is measured so far survives a timeout
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result))

    model = load()
    wl = json.loads(Path(args.workload_file).read_text())
    prompts, olens = wl["prompts"], wl["output_lens"]
    wanted = sum(olens)
    uniform = len({len(p) for p in prompts}) == 1 and len(set(olens)) == 1

    def sync():
        if cuda:
            torch.cuda.synchronize()

    bs = args.hf_batch_size
    batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]

    def padded(batch_list, **kw) -> int:
        made = 0
        for idx in batch_list:
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):  # left padding
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            new = max(olens[i] for i in idx)
            out = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                do_sample=False,
                **kw,
            )
            made += out.shape[0] * (out.shape[1] - width)
        return made

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        value = fn()
        sync()
        return value, time.perf_counter() - t0

    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "hf_batch_size": bs,
    }
    with torch.no_grad():
        # Warm-up: on GPU the first batch at its real shape, on CPU a tiny call.
        _, result["padded_generate_warmup_s"] = timed(
            lambda: (
                padded(batches[:1])
                if cuda
                else model.generate(
                    torch.tensor([prompts[0][:8]]), max_new_tokens=4, do_sample=False
                )
            )
        )
        made, dt = timed(lambda: padded(batches))
        result["padded_generate"] = wanted / dt
        result["padded_generate_generated_tokens"] = made
    save()
    if hasattr(model, "generate_batch"):
        try:
            run_generate_batch(model, prompts, olens, cuda, timed, result)
        except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
            result["generate_batch_error"] = f"{type(e).__name__}: {e}"[:300]
        save()
    # Last, as the slowest to warm up (torch.compile), on a fresh model: generate_batch may
    # have switched the first one's attention to its paged kernels.
    if cuda and uniform:  # the compiled static cache recompiles for every new batch shape
        try:
            model = load()
            with torch.no_grad():
                _, result["padded_generate_static_warmup_s"] = timed(
                    lambda: padded(batches[:1], cache_implementation="static")
                )
                _, dt = timed(lambda: padded(batches, cache_implementation="static"))
            result["padded_generate_static"] = wanted / dt
        except Exception as e:  # noqa: BLE001
            result["padded_generate_static_error"] = f"{type(e).__name__}: {e}"[:300]
    elif cuda:
        result["padded_generate_static_error"] = "skipped: mixed shapes recompile per batch"
    save()
    print(json.dumps(result))


def run_generate_batch(model, prompts, olens, cuda, timed, result) -> None:
    """generate_batch (one max_new_tokens for all) or, for mixed output lengths, its manager
    with a max_new_tokens per request. GPU: a full warm-up run keeps the manager (and its
    captured graphs) for the timed run; CPU: a small warm-up call."""
    import torch
    import transformers

    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=max(olens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    if len(set(olens)) == 1:

        def run(inputs, **kw):
            try:
                outs = model.generate_batch(inputs=inputs, generation_config=gen_cfg, **kw)
            except TypeError:  # a transformers without persistent_manager
                outs = model.generate_batch(inputs=inputs, generation_config=gen_cfg)
            return [len(o.generated_tokens) for o in outs.values()]
    else:

        def run(inputs, **kw):
            tag = time.perf_counter_ns()  # request ids unique across runs of a kept manager
            done = {}
            cm_kwargs = {"generation_config": gen_cfg, "block": True, "timeout": 5}
            try:  # a kept manager skips its warm-up (graph capture) in the next run
                cm = model.continuous_batching_context_manager(**cm_kwargs, **kw)
            except TypeError:  # a transformers without persistent_manager
                cm = model.continuous_batching_context_manager(**cm_kwargs)
            with cm as manager:
                for i, (p, n) in enumerate(zip(inputs, olens, strict=False)):
                    manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=n)
                while len(done) < len(inputs):
                    out = manager.get_result(timeout=1)
                    if out is not None and out.is_finished():
                        done[out.request_id] = len(out.generated_tokens)
                    elif out is None and not manager.is_running():
                        break
            return list(done.values())

    with torch.no_grad():
        if cuda:
            _, result["generate_batch_warmup_s"] = timed(
                lambda: run(prompts, persistent_manager=True)
            )
        else:
            _, result["generate_batch_warmup_s"] = timed(lambda: run([p[:8] for p in prompts[:2]]))
        try:
            lens, dt = timed(lambda: run(prompts, persistent_manager=True))
        finally:  # the kept manager's cache would hold the memory the next mode needs
            destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
            if destroy is not None:
                destroy()
            if cuda:
                torch.cuda.empty_cache()
    result["generate_batch"] = sum(lens) / dt
    if len(lens) != len(prompts) or sum(lens) != sum(olens):
        result["generate_batch_error"] = (
            f"incomplete: {len(lens)} of {len(prompts)} requests, {sum(lens)} of {sum(olens)} tokens"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--workload-file", required=True)
    p.add_argument("--result-file", default=None)
    p.add_argument("--hf-batch-size", type=int, default=128)
    run_transformers(p.parse_args(argv))


if __name__ == "__main__":
    main()
