"""Where a jitted step's time goes, on the real model's shapes (CPU profiling aid).

    python scripts/profile_step.py                       # SmolLM2-135M, f32, decode at batch 32
    python scripts/profile_step.py --model DIR --batch 64 --context 160 --prefill-tokens 2048

Builds the engine's own step (jpaged.worker.programs.step, jitted with the pool donated, as the
runner compiles it) for a decode step of --batch rows at --context tokens each, and a ragged
prefill step of --prefill-tokens prompt tokens (--prefill-len per sequence), then times:

  - the whole step (median of --repeat calls, the pool fed back as the runner does);
  - its parts, each jitted alone over every layer (so that the weights come from memory as in
    the step, not from cache): the projections, rope, the K/V writes, the attention, the MLP,
    the LM head, sampling; and the step with parts removed (no attention, no sampling ...).

Parts do not add up exactly to the step (XLA fuses across them), but what a part costs alone
bounds what removing it can save. With --ops, also jax's profiler over --repeat steps: the
time of every compiled op (XLA fusion or thunk) summed over threads, grouped by the jax
operation it came from (its op_name metadata; every layer's alike) and its result shape,
the --top largest printed. Prints one line per figure and `RESULT_JSON {...}`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))


def _median_ms(fn, repeat: int) -> float:
    """Median wall milliseconds of fn() (which must block), after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _inputs(cfg, key, *, rows, context, new_per_row, page_size, pages_per_seq):
    """StepInputs of `rows` sequences, each with `new_per_row` new tokens ending at `context`
    cached tokens; sequence i owns pages 1 + i * pages_per_seq ... (page 0 is the null page)."""
    from jpaged.sample.sampler import SamplingInputs
    from jpaged.worker.step_inputs import StepInputs, update_capacity

    t_pad, s_pad = key.num_tokens, key.num_seqs
    pages = 1 + np.arange(rows * pages_per_seq, dtype=np.int32).reshape(rows, pages_per_seq)
    pos = np.arange(context - new_per_row, context, dtype=np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.zeros(t_pad, np.int32)
    positions[: rows * new_per_row] = np.tile(pos, rows)
    slots[: rows * new_per_row] = (pages[:, pos // page_size] * page_size + pos % page_size).ravel()
    query_start = np.full(s_pad + 1, rows * new_per_row, np.int32)
    query_start[: rows + 1] = np.arange(rows + 1) * new_per_row
    table_rows = np.full(s_pad, s_pad, np.int32)
    table_rows[:rows] = np.arange(rows)
    context_lens = np.zeros(s_pad, np.int32)
    context_lens[:rows] = context
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:rows] = np.arange(1, rows + 1) * new_per_row - 1
    rng = np.random.default_rng(0)
    sampling = SamplingInputs(
        temperature=np.zeros(s_pad, np.float32),
        top_k=np.zeros(s_pad, np.int32),
        top_p=np.ones(s_pad, np.float32),
        min_p=np.zeros(s_pad, np.float32),
        key_data=np.zeros((s_pad, 2), np.uint32),
        num_generated=np.zeros(s_pad, np.int32),
        banned=np.full((s_pad, 8), -1, np.int32),
        token_bitmask=np.full((s_pad, -(-cfg.vocab_size // 32)), -1, np.int32),
        use_bitmask=np.bool_(False),
    )
    inputs = StepInputs(
        token_ids=rng.integers(3, cfg.vocab_size, t_pad).astype(np.int32),
        src_rows=np.full(t_pad, -1, np.int32),
        positions=positions,
        slot_mapping=slots[None],  # one paging group
        table_rows=table_rows,
        context_lens=context_lens,
        query_start=query_start,
        logits_indices=logits_indices,
        page_updates=np.tile(np.array([[s_pad, 0, 0]], np.int32),
                             (update_capacity(key, page_size), 1)),
        page_copies=np.zeros((s_pad, 2), np.int32),
        sampling=sampling,
    )
    table = np.zeros((s_pad + 1, pages_per_seq), np.int32)
    table[:rows] = pages
    return inputs, table


def _state(cfg, num_pages, page_size, table, dtype):
    import jax.numpy as jnp

    from jpaged.worker.programs import DeviceState

    shape = (cfg.num_kv_heads, cfg.num_layers * num_pages, page_size, cfg.head_dim)
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=shape).astype(dtype)) for _ in range(2))
    return DeviceState(k, v, jnp.asarray(table))


class StepBench:
    """One step shape: the engine's step program and its parts, on the same inputs."""

    def __init__(self, params, cfg, key, inputs, table, num_pages, page_size, repeat):
        import jax
        import jax.numpy as jnp

        from jpaged.worker import programs

        self.jax, self.jnp = jax, jnp
        self.params, self.cfg, self.key, self.repeat = params, cfg, key, repeat
        self.inputs = jax.device_put(inputs)
        self.state = _state(cfg, num_pages, page_size, table, np.float32)
        self.prev = jnp.zeros(key.num_seqs, jnp.int32)
        body = functools.partial(programs.step, model_config=cfg, key=key, backend=None)
        self.step_fn = jax.jit(body, donate_argnums=(1,))
        self.table = jnp.asarray(table)[inputs.table_rows, : key.num_page_cols]
        self.results: dict[str, float] = {}

    def time_step(self, name: str = "step", fn=None) -> float:
        fn = fn or self.step_fn

        def call():
            out, _, self.state = fn(self.params, self.state, self.inputs, self.prev)
            self.jax.block_until_ready(out.tokens)

        ms = _median_ms(call, self.repeat)
        self.results[name] = ms
        print(f"  {name:<44}{ms:9.2f} ms", flush=True)
        return ms

    def time_part(self, name: str, fn, *args, donate=()) -> float:
        """fn jitted alone; donated arguments are fed back from its outputs (first ones)."""
        jax = self.jax
        jitted = jax.jit(fn, donate_argnums=donate)
        args = list(args)

        def call():
            out = jitted(*args)
            for i, a in enumerate(donate):
                args[a] = out[i] if isinstance(out, tuple) else out
            jax.block_until_ready(out)

        ms = _median_ms(call, self.repeat)
        self.results[name] = ms
        print(f"  {name:<44}{ms:9.2f} ms", flush=True)
        return ms


def op_profile(bench: StepBench, top: int) -> list[tuple[str, float, int]]:
    """jax's profiler over bench.repeat steps: milliseconds per step of each group of
    compiled ops, a group being the jax operation the op came from (op_name metadata, the
    same for every layer) and the op's result shape; summed over threads."""
    import jax

    compiled = bench.step_fn.lower(bench.params, bench.state, bench.inputs, bench.prev).compile()
    hlo = compiled.as_text()
    origin = {}  # HLO op name -> "jax op  result shape"
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\S+) .*$", hlo, re.MULTILINE):
        meta = re.search(r'op_name="([^"]*)"', m.group(0))
        where = meta.group(1) if meta else m.group(1)
        where = re.sub(r"^jit\(step\)/", "", where)
        origin[m.group(1)] = f"{where}  {m.group(2).split('{')[0]}"

    def call():
        out, _, bench.state = bench.step_fn(bench.params, bench.state, bench.inputs, bench.prev)
        jax.block_until_ready(out.tokens)

    call()
    tmp = tempfile.mkdtemp(prefix="jpaged-profile-")
    try:
        with jax.profiler.trace(tmp):
            for _ in range(bench.repeat):
                call()
        data = jax.profiler.ProfileData.from_file(
            glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0]
        )
        total = collections.Counter()
        count = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    if event.name in origin:
                        total[origin[event.name]] += event.duration_ns
                        count[origin[event.name]] += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [(k, v / bench.repeat / 1e6, count[k] // bench.repeat) for k, v in total.items()]
    rows.sort(key=lambda r: -r[1])
    print(f"  ops (summed over threads): {sum(r[1] for r in rows):.2f} ms per step", flush=True)
    for name, ms, n in rows[:top]:
        print(f"  {ms:9.2f} ms  x{n:<4d} {name[-110:]}", flush=True)
    return rows


def profile(bench: StepBench, *, sampling: bool) -> None:
    """The step, then its parts over every layer."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from jpaged.sample.sampler import SamplerOutput as sample_output
    from jpaged.sample.sampler import sample
    from jpaged.worker import programs
    from models import llama

    cfg, params, inputs, key = bench.cfg, bench.params, bench.inputs, bench.key
    layers = llama.unstack_layers(params)["layers"]  # the parts below time layer by layer
    per_layer = bench.state.k_pages.shape[1] // cfg.num_layers  # pages of one layer
    num_tokens = key.num_tokens
    bench.time_step()

    # The step with a part removed (same program otherwise): what removing it saves.
    def without(name, module, attr, stub):
        original = getattr(module, attr)
        setattr(module, attr, stub)
        try:
            body = functools.partial(programs.step, model_config=cfg, key=key, backend=None)
            bench.time_step(f"step without {name}", jax.jit(body, donate_argnums=(1,)))
        finally:
            setattr(module, attr, original)

    def no_attention(q, *args, **kwargs):
        return q

    def greedy_only(logits, inputs, *, num_logprobs):
        tokens = jnp.zeros(logits.shape[0], jnp.int32) + logits[:, 0].astype(jnp.int32)
        return sample_output(tokens, jnp.zeros(tokens.shape, jnp.float32), None, None)

    without("attention", pallas_kernels, "paged_decode_attention" if key.decode_only
            else "paged_prefill_attention", no_attention)
    without("rope", llama, "rotate", lambda x, cos, sin: x)
    without("K/V writes", llama, "_write_kv", lambda pages, new, slots: pages)
    without("page copies (CoW)", programs, "_copy_pages", lambda k, v, copies, n: (k, v))
    without("page-table update", programs, "_apply_updates", lambda table, updates: table)
    if sampling:
        without("sampling", programs, "sample", greedy_only)

    x = jax.random.normal(jax.random.key(0), (num_tokens, cfg.hidden_size), jnp.float32)
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def qkv(x, layers):
        outs = []
        for layer in layers:
            h = llama.rms_norm(x, layer["input_norm"], cfg.rms_norm_eps)
            outs.append(jnp.einsum("td,dhk->thk", h, layer["wq"]).sum()
                        + jnp.einsum("td,dhk->thk", h, layer["wk"]).sum()
                        + jnp.einsum("td,dhk->thk", h, layer["wv"]).sum())
        return jnp.stack(outs)

    def wo(a, layers):
        return jnp.stack([jnp.einsum("thk,hkd->td", a, layer["wo"]).sum() for layer in layers])

    def mlp(x, layers):
        outs = []
        for layer in layers:
            h = llama.rms_norm(x, layer["post_attn_norm"], cfg.rms_norm_eps)
            gate = jax.nn.silu(h @ layer["w_gate"])
            outs.append(((gate * (h @ layer["w_up"])) @ layer["w_down"]).sum())
        return jnp.stack(outs)

    a = jax.random.normal(jax.random.key(3), (num_tokens, hq, dh), jnp.float32)

    def matmuls(x, a, layers):
        return qkv(x, layers) + wo(a, layers) + mlp(x, layers)

    bench.time_part("layers' matmuls (+norms), all layers", matmuls, x, a, layers)
    bench.time_part("  q/k/v projections", qkv, x, layers)
    bench.time_part("  o projection", wo, a, layers)
    bench.time_part("  MLP", mlp, x, layers)
    q = jax.random.normal(jax.random.key(1), (num_tokens, hq, dh), jnp.float32)
    k = jax.random.normal(jax.random.key(2), (num_tokens, hkv, dh), jnp.float32)

    page_size = bench.state.k_pages.shape[2]

    def write(kv, k, slots):
        kp, vp = kv
        for layer in range(cfg.num_layers):
            at = slots + layer * per_layer * page_size
            kp, vp = llama._write_kv(kp, k, at), llama._write_kv(vp, k, at)
        return [kp, vp]  # a list: time_part feeds a tuple's first item back, a list whole

    kv = bench.state.kv_pages
    bench.time_part("K/V writes, all layers", write, kv, k, inputs.slot_mapping[0], donate=(0,))
    # The donated pool was consumed above: fresh buffers for what follows.
    kv = (jnp.zeros_like(bench.state.k_pages), jnp.zeros_like(bench.state.v_pages))
    bench.state = programs.DeviceState(*kv, bench.state.page_table)

    attn_kwargs = {"sm_scale": cfg.sm_scale, "sliding_window": cfg.sliding_window}

    def attention(q, kv, context_lens, table, query_start):
        outs = []
        kp, vp = kv
        for layer in range(cfg.num_layers):
            at = table + layer * per_layer
            if key.decode_only:
                o = pallas_kernels.paged_decode_attention(q, kp, vp, context_lens, at,
                                                          **attn_kwargs)
            else:
                o = pallas_kernels.paged_prefill_attention(q, kp, vp, context_lens, at,
                                                           query_start, **attn_kwargs)
            outs.append(o.sum())
        return jnp.stack(outs)

    bench.time_part("attention, all layers", attention, q, kv, inputs.context_lens,
                    bench.table, inputs.query_start)
    hidden = x[inputs.logits_indices]
    bench.time_part("LM head", lambda h: llama.compute_logits(params, cfg, h), hidden)
    if sampling:
        logits = llama.compute_logits(params, cfg, hidden)
        for n in (0, 20):
            bench.time_part(
                f"sampling (greedy, {n} logprobs)",
                lambda lg, s, n=n: sample(lg, s, num_logprobs=n), logits, inputs.sampling,
            )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    p.add_argument("--batch", type=int, default=32, help="decode rows (0: no decode step)")
    p.add_argument("--context", type=int, default=160, help="tokens per decode row")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="0: no prefill step")
    p.add_argument("--prefill-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--max-model-len", type=int, default=208)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--parts", action=argparse.BooleanOptionalAction, default=True,
                   help="time the parts too (default on)")
    p.add_argument("--ops", action="store_true", help="jax's profiler: time per compiled op")
    p.add_argument("--top", type=int, default=30, help="op groups printed with --ops")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="the step with its layers under lax.scan (default on; the parts are "
                        "timed layer by layer either way)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jpaged.worker.step_inputs import StepKey
    from models.loader import load_model

    if args.model is None:
        from models.demo import ensure_smollm2

        args.model = str(ensure_smollm2())
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=jnp.float32)
    from models.llama import stack_layers

    cfg, params = loaded.config, loaded.params
    if args.scan_layers:
        params = stack_layers(params)
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}", flush=True)
    ps = args.page_size
    pages_per_seq = -(-args.max_model_len // ps)
    result = {"model": args.model, "args": vars(args)}

    def run(name, key, rows, context, new_per_row, repeat):
        """One step shape: build, time (parts, ops) and record it under name."""
        inputs, table = _inputs(cfg, key, rows=rows, context=context, new_per_row=new_per_row,
                                page_size=ps, pages_per_seq=pages_per_seq)
        bench = StepBench(params, cfg, key, inputs, table, rows * pages_per_seq + 1, ps, repeat)
        if args.parts:
            profile(bench, sampling=key.decode_only)
        else:
            bench.time_step()
        result[name] = bench.results
        if args.ops:
            result[f"{name}_ops"] = op_profile(bench, args.top)

    if args.batch:
        print(f"decode step: batch {args.batch}, context {args.context}", flush=True)
        key = StepKey(args.batch, args.batch, pages_per_seq, True)
        run("decode", key, args.batch, args.context, 1, args.repeat)
    if args.prefill_tokens:
        n = args.prefill_tokens // args.prefill_len
        print(f"prefill step: {n} sequences x {args.prefill_len} tokens", flush=True)
        key = StepKey(args.prefill_tokens, n, pages_per_seq, False)
        run("prefill", key, n, args.prefill_len, args.prefill_len, max(2, args.repeat // 4))
    print("RESULT_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
