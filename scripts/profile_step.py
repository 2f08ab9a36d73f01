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
the --top largest printed, and summed into the step's parts (projections, attention's page
gather and its softmax, MLP, LM head, sampling, the layer loop's weight copies): the table
printed last, each part also as its share of the ops' time times the step's CPU time (the
figure that another process's preemption inflates least on a shared machine).

With --bounds, the machine's copy bandwidth and float32 matmul peak (XLA:CPU, this process)
and each step's two bounds: bytes read (weights, tied LM head, the rows' K/V) / bandwidth,
FLOPs / peak. With --matmuls, the step's matmul shapes in XLA:CPU and in torch (oneDNN) at 1
and all threads, weights cycled through more copies than the last-level cache holds. For
one core, run the script under `taskset -c 1`. The issue-53 table (docs/benchmarks.md):

    python scripts/profile_step.py --batch 1,8,32 --prefill-tokens 512 --prefill-len 512 \
        --no-parts --ops --bounds --matmuls --top 0

Prints one line per figure and `RESULT_JSON {...}`.
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


def _median_ms(fn, repeat: int, cpu: list | None = None) -> float:
    """Median wall milliseconds of fn() (which must block), after one untimed call; with
    cpu, the median CPU milliseconds of this process (every thread) appended to it: on a
    machine shared with other work, the figure preemption does not inflate."""
    fn()
    times, cpu_times = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    if cpu is not None:
        cpu.append(1e3 * statistics.median(cpu_times))
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

        cpu = []
        ms = _median_ms(call, self.repeat, cpu)
        self.results[name] = ms
        self.results[f"{name} cpu"] = cpu[0]
        print(f"  {name:<44}{ms:9.2f} ms  (CPU {cpu[0]:.2f} ms: {cpu[0] / ms:.2f} cores busy)",
              flush=True)
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
    same for every layer) and the op's result shape; exclusive of nested ops, summed over
    runs and threads."""
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
        # Summed over the runs: on a shared machine, preemption stretches every op alike on
        # average, so the shares stay fair (a median run would undercount short ops, most
        # runs of which no preemption hits, against long ones).
        total = collections.Counter()
        count = collections.Counter()
        for name, runs in _exclusive_ns(data, origin).items():
            total[origin[name]] += sum(runs)
            count[origin[name]] += len(runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [(k, v / bench.repeat / 1e6, count[k] // bench.repeat) for k, v in total.items()]
    rows.sort(key=lambda r: -r[1])
    print(f"  ops (exclusive, summed over threads): "
          f"{sum(r[1] for r in rows):.2f} ms per step",
          flush=True)
    for name, ms, n in rows[:top]:
        print(f"  {ms:9.2f} ms  x{n:<4d} {name[-110:]}", flush=True)
    return rows


# -- the step's parts from jax's profiler, and the two bounds ---------------------------------

_SWITCHED = r"while/body/(closed_call/)?cond/branch_\d+_fun/"

# Each compiled op, by its origin ("jax op  result shape", op_profile), goes to one part of
# the step; the first rule that matches wins. The layer loop's weight slices are the copies
# XLA:CPU makes of each scanned layer's weights out of the stacked arrays.
_PART_RULES = (
    ("LM head", r"^dot_general  f32\[(\d+,)?{vocab}\]"),
    ("sampling", r"{vocab}|reduce_min|^cond"),
    ("layer loop: weight copies", r"while/body/.*dynamic_index_in_dim|^copy"),
    ("layer matmuls (op name lost: batch 1)", r"^dot\.\d+  f32\[1,\d+\]"),
    # Switched layers (models/llama.py switch_layers): a layer's own ops sit in the branches
    # of its lax.switch, the attention's in the while loops nested in its own branches.
    ("q/k/v projections", _SWITCHED + r"(?!.*while/).*td,dhk->thk/dot_general"),
    ("o projection", _SWITCHED + r"(?!.*while/).*thk,hkd->td/dot_general"),
    ("MLP matmuls", _SWITCHED + r"(?!.*while/).*dot_general"),
    ("norms, rope, residual, act", _SWITCHED + r"(?!.*while/)(?!.*(sort|gather))"),
    ("attention: page gather + mask",
     r"while/body/.*cond.*/(gather|jit\(_where\)/select_n)  f32\[\d+,\d+,\d+,\d+\]$"),
    ("attention: scores, softmax, PV", r"while/body/.*(cond|attention|ktld|ktgl)"),
    ("K/V writes", r"while/body/.*scatter"),
    ("q/k/v projections", r"while/body/.*td,dhk->thk/dot_general"),
    ("o projection", r"while/body/.*thk,hkd->td/dot_general"),
    ("MLP matmuls", r"while/body/.*dot_general"),
    ("norms, rope, residual, act", r"while/body/"),
)


def _exclusive_ns(data, names) -> dict[str, list[int]]:
    """Nanoseconds of each run of each traced op in names, less the ops nested inside it on
    the same thread (a while or cond thunk's event spans its body's ops)."""
    runs = collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            stack: list[list] = []  # [name, end_ns, nested_ns, duration_ns]
            events = sorted(
                ((e.start_ns, e.duration_ns, e.name) for e in line.events if e.name in names),
                key=lambda e: (e[0], -e[1]),
            )
            for start, dur, name in events + [(float("inf"), 0, None)]:
                while stack and stack[-1][1] <= start:
                    done = stack.pop()
                    runs[done[0]].append(done[3] - done[2])
                if name is None:
                    break
                if stack:
                    stack[-1][2] += dur
                stack.append([name, start + dur, 0, dur])
    return runs


def _kernel_rules(cfg) -> tuple[tuple[str, str], ...]:
    """The CPU kernels' calls (pallas_kernels/cpu_kernel.py): ffi_calls, told apart by their
    result's shape: the attention's [T, Hq, D], the LM head's [T, vocab], greedy sampling's
    (s32[T], ...), and the packed products' [T, N] by N (models/packed.py: q/k/v together,
    gate and up together; the o projection and the MLP's down projection both [T, hidden])."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return (
        ("attention kernel", rf"ffi_call  f32\[\d+,{cfg.num_heads},{cfg.head_dim}\]$"),
        ("LM head", rf"ffi_call  f32\[\d+,{cfg.vocab_size}\]$"),
        ("sampling", r"ffi_call  \(s32\["),
        ("q/k/v projections", rf"ffi_call  f32\[\d+,{qkv}\]$"),
        ("MLP gate and up", rf"ffi_call  f32\[\d+,{2 * cfg.intermediate_size}\]$"),
        ("o projection and MLP down", rf"ffi_call  f32\[\d+,{cfg.hidden_size}\]$"),
        ("other kernel calls", r"ffi_call  "),
    )


def step_parts(rows: list[tuple[str, float, int]], cfg) -> dict[str, float]:
    """op_profile's rows (exclusive ms per step by origin) summed into the step's parts: the
    CPU kernels' calls by _kernel_rules, the rest by _PART_RULES."""
    rules = _kernel_rules(cfg) + tuple(
        (part, rule.replace("{vocab}", str(cfg.vocab_size))) for part, rule in _PART_RULES
    )
    parts = collections.Counter()
    for name, ms, _ in rows:
        for part, rule in rules:
            if re.search(rule, name):
                parts[part] += ms
                break
        else:
            parts["other (outside the layer loop)"] += ms
    return dict(parts)


def step_bytes_flops(cfg, *, tokens: int, rows: int, context: int) -> tuple[int, int]:
    """float32 bytes a step must read (every layer's weights, the tied LM head's table, the
    rows' cached K/V) and its FLOPs (2 per multiply-add of the matmuls and of attention)."""
    layers = cfg.layer_params  # every layer's
    head = cfg.vocab_size * cfg.hidden_size
    kv = 2 * rows * context * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    attn = 4 * tokens * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 4 * (layers + head + kv), 2 * tokens * layers + 2 * rows * head + attn


def machine_bounds(repeat: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second, a jitted a + 1 over 256 MiB) and the
    float32 matmul peak (2048^3, GFLOP/s) of XLA:CPU in this process: per second of wall
    time (medians) and per CPU second of this process (per core when every thread is busy:
    the robust figure on a shared machine)."""
    import jax
    import jax.numpy as jnp

    # The buffer donated and fed back: a fresh 256 MiB output each call would time the
    # kernel's first-touch page faults too.
    buf = [jnp.ones(64 << 20, jnp.float32)]
    nbytes = buf[0].nbytes
    inc = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def copy():
        buf[0] = inc(buf[0])
        buf[0].block_until_ready()

    cpu = []
    copy_ms = _median_ms(copy, repeat, cpu)
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm_ms = _median_ms(lambda: mm(a).block_until_ready(), repeat, cpu)
    return {"copy_gb_s": 2 * nbytes / copy_ms / 1e6,
            "copy_gb_per_cpu_s": 2 * nbytes / cpu[0] / 1e6,
            "xla_matmul_gflop_s": 2 * n**3 / mm_ms / 1e6,
            "xla_matmul_gflop_per_cpu_s": 2 * n**3 / cpu[1] / 1e6}


def matmul_shapes(cfg, tokens: int) -> dict[str, tuple[int, int, int]]:
    """The step's matmuls (M, K, N) at `tokens` rows (the LM head at as many)."""
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {
        "q/o proj": (tokens, d, cfg.num_heads * dh),
        "k/v proj": (tokens, d, cfg.num_kv_heads * dh),
        "gate/up": (tokens, d, f),
        "down": (tokens, f, d),
        "LM head": (tokens, d, cfg.vocab_size),
    }


def time_matmuls(cfg, token_counts, repeat: int, torch_threads) -> dict[str, dict[str, float]]:
    """Each matmul shape, its weights cycled through enough copies to overflow the last-level
    cache (as a step reads them from memory): microseconds per matmul in XLA:CPU (this
    process's threads) and in torch (oneDNN/MKL) at each of torch_threads."""
    import jax
    import jax.numpy as jnp

    try:
        import torch
    except ImportError:
        torch = None
    out = {}
    for tokens in token_counts:
        for name, (m, k, n) in matmul_shapes(cfg, tokens).items():
            copies = max(2, min(32, (96 << 20) // (4 * k * n)))
            rng = np.random.default_rng(0)
            ws = rng.standard_normal((copies, k, n), dtype=np.float32)
            x = rng.standard_normal((m, k), dtype=np.float32)
            wj, xj = jnp.asarray(ws), jnp.asarray(x)
            # Python-unrolled: each dot reads its own weight buffer, no slice copies.
            f = jax.jit(lambda x, *ws: sum(jnp.sum(x @ w) for w in ws))
            wl = [wj[i] for i in range(copies)]
            cpu = []
            row = {"flops": 2 * m * k * n}
            row["xla_us"] = 1e3 * _median_ms(
                lambda f=f, xj=xj, wl=wl: f(xj, *wl).block_until_ready(), repeat, cpu) / copies
            row["xla_cpu_us"] = 1e3 * cpu.pop() / copies
            if torch is not None:
                wt, xt = [torch.from_numpy(w) for w in ws], torch.from_numpy(x)
                for threads in torch_threads:
                    torch.set_num_threads(threads)
                    with torch.inference_mode():
                        row[f"torch_{threads}t_us"] = 1e3 * _median_ms(
                            lambda xt=xt, wt=wt: [xt @ w for w in wt], repeat, cpu) / copies
                    row[f"torch_{threads}t_cpu_us"] = 1e3 * cpu.pop() / copies
            out[f"{name} {m}x{k}x{n}"] = row
            print(f"  {name:<9} {m:>4}x{k}x{n:<6}" + "".join(
                f"  {c[:-3]} {v:8.1f} us" for c, v in row.items() if c.endswith("_us")), flush=True)
    print("  (_cpu: CPU time of this process per matmul, every thread)", flush=True)
    return out


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


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t and int(t)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    p.add_argument("--batch", type=_ints, default=[32],
                   help="decode rows, comma-separated for several steps (0: no decode step)")
    p.add_argument("--context", type=int, default=160, help="tokens per decode row")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="0: no prefill step")
    p.add_argument("--prefill-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--max-model-len", type=int, default=208)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--parts", action=argparse.BooleanOptionalAction, default=True,
                   help="time the parts too, each jitted alone (default on)")
    p.add_argument("--ops", action="store_true", help="jax's profiler: time per compiled op, "
                   "summed into the step's parts (the table)")
    p.add_argument("--top", type=int, default=30, help="op groups printed with --ops")
    p.add_argument("--bounds", action="store_true",
                   help="the machine's copy bandwidth and matmul peak, and each step's bounds")
    p.add_argument("--matmuls", action="store_true",
                   help="the step's matmul shapes in XLA:CPU and torch, at 1 and all threads")
    p.add_argument("--layers", choices=("switched", "stacked", "unrolled"), default="switched",
                   help="the layers' layout: switched (the CPU engine's: per-layer weights "
                        "under lax.scan, models/llama.py switch_layers), stacked (lax.scan over "
                        "stacked weights, the accelerators') or unrolled; the parts are timed "
                        "layer by layer either way")
    args = p.parse_args(argv)

    import os

    import jax
    import jax.numpy as jnp

    from jpaged.worker.step_inputs import StepKey
    from models.loader import load_model

    if args.model is None:
        from models.demo import ensure_smollm2

        args.model = str(ensure_smollm2())
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=jnp.float32)
    from models.llama import stack_layers, switch_layers

    cfg, params = loaded.config, loaded.params
    layout = {"switched": switch_layers, "stacked": stack_layers}.get(args.layers)
    if layout is not None:
        params = layout(params)
    cpus = len(os.sched_getaffinity(0))
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, {cpus} CPUs, XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    ps = args.page_size
    result = {"model": args.model, "args": vars(args), "cpus": cpus}
    if args.bounds:
        result["machine"] = machine_bounds(max(3, args.repeat // 2))
        m = result["machine"]
        print(f"copy bandwidth {m['copy_gb_s']:.1f} GB/s (read + write; "
              f"{m['copy_gb_per_cpu_s']:.1f} per CPU second), XLA float32 matmul peak "
              f"{m['xla_matmul_gflop_s']:.0f} GFLOP/s ({m['xla_matmul_gflop_per_cpu_s']:.0f} "
              "per CPU second)", flush=True)
    table = []  # (step, part, ms)

    def run(name, key, rows, context, new_per_row, repeat, max_len):
        """One step shape: build, time (parts, ops, bounds) and record it under name."""
        pages_per_seq = -(-max_len // ps)
        inputs, page_table = _inputs(cfg, key, rows=rows, context=context,
                                     new_per_row=new_per_row, page_size=ps,
                                     pages_per_seq=pages_per_seq)
        bench = StepBench(params, cfg, key, inputs, page_table, rows * pages_per_seq + 1, ps,
                          repeat)
        if args.parts:
            profile(bench, sampling=key.decode_only)
        else:
            bench.time_step()
        result[name] = bench.results
        table.append((name, "step (median)", bench.results["step"], bench.results["step cpu"]))
        if args.ops:
            rows_ms = op_profile(bench, args.top)
            result[f"{name}_ops"] = rows_ms
            parts = step_parts(rows_ms, cfg)
            result[f"{name}_parts"] = parts
            # A part's CPU ms: its share of the ops' time times the step's CPU time (the
            # ops' wall times stretch when another process takes the core; shares less so).
            scale = bench.results["step cpu"] / max(sum(parts.values()), 1e-9)
            for part, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
                table.append((name, part, ms, ms * scale))
        if args.bounds:
            nbytes, flops = step_bytes_flops(cfg, tokens=rows * new_per_row, rows=rows,
                                             context=context)
            m = result["machine"]
            bounds = {"bytes": nbytes, "flops": flops,
                      "bandwidth_ms": 1e3 * nbytes / (m["copy_gb_s"] * 1e9),
                      "matmul_peak_ms": 1e3 * flops / (m["xla_matmul_gflop_s"] * 1e9),
                      "bandwidth_cpu_ms": 1e3 * nbytes / (m["copy_gb_per_cpu_s"] * 1e9),
                      "matmul_peak_cpu_ms": 1e3 * flops / (m["xla_matmul_gflop_per_cpu_s"] * 1e9)}
            result[f"{name}_bounds"] = bounds
            table.append((name, f"bound: {nbytes / 1e6:.0f} MB / copy bandwidth",
                          bounds["bandwidth_ms"], bounds["bandwidth_cpu_ms"]))
            table.append((name, f"bound: {flops / 1e9:.2f} GFLOP / matmul peak",
                          bounds["matmul_peak_ms"], bounds["matmul_peak_cpu_ms"]))

    for batch in args.batch:
        print(f"decode step: batch {batch}, context {args.context}", flush=True)
        key = StepKey(batch, batch, -(-args.max_model_len // ps), True)
        run(f"decode_b{batch}", key, batch, args.context, 1, args.repeat, args.max_model_len)
    if args.prefill_tokens:
        n = args.prefill_tokens // args.prefill_len
        print(f"prefill step: {n} sequences x {args.prefill_len} tokens", flush=True)
        max_len = max(args.max_model_len, args.prefill_len)
        key = StepKey(args.prefill_tokens, n, -(-max_len // ps), False)
        run(f"prefill_{args.prefill_tokens}", key, n, args.prefill_len, args.prefill_len,
            max(2, args.repeat // 4), max_len)
    if args.matmuls:
        print(f"matmuls (weights from memory; XLA on this process's {cpus} CPUs)", flush=True)
        counts = sorted({b for b in args.batch} | ({args.prefill_tokens} - {0}))
        result["matmuls"] = time_matmuls(cfg, counts, args.repeat, sorted({1, cpus}))
    if table:
        print(f"\n{'step':<14}{'part (ops: exclusive time)':<44}{'wall ms':>9}"
              f"{'CPU ms':>9}")
        for step_name, part, ms, cpu_ms in table:
            cpu_text = f"{cpu_ms:9.2f}" if cpu_ms is not None else ""
            print(f"{step_name:<14}{part:<44}{ms:9.2f}{cpu_text}")
    print("RESULT_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
