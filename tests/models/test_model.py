"""The model over the paged pool: prefill logits equal transformers'; decode equals prefill;
the layers scanned (stacked weights), switched (per-layer weights under a scan) and unrolled
give the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from checkpoints import ARCHS
from dense_families import padded_chunk

from models.llama import compute_logits, forward, stack_layers, switch_layers, switchable
from models.loader import load_hf_model
from models.packed import PackedWeight
from pallas_kernels import cpu_kernel

PAGE = 8
_forward = jax.jit(forward, static_argnums=(1,), static_argnames=("decode_only",))


def paged_logits(
    loaded, chunks: list[int], token_ids: list[int], *, num_pages=64, shuffle=True, params=None
):
    """Runs one sequence through forward() in chunks (a chunk of 1 is a decode step) over a
    shuffled page table; returns the logits of every position [len(token_ids), vocab].
    params: loaded.params in another layers layout (stacked), if given."""
    cfg = loaded.config
    params = loaded.params if params is None else params
    shape = (cfg.num_kv_heads, cfg.num_layers * num_pages, PAGE, cfg.head_dim)
    # Unused pages hold NaN: masking must keep them out of every result.
    caches = (jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
    pages = np.arange(1, num_pages)
    if shuffle:
        pages = np.random.default_rng(0).permutation(pages)
    n_pages = -(-len(token_ids) // PAGE)
    table = np.zeros((1, n_pages), np.int32)
    table[0] = pages[:n_pages]
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        # Prefill chunks padded to the longest, as the engine pads (dense_families.paged_logits).
        tokens, positions, slots = padded_chunk(
            token_ids[start : start + n], pos, table[0][pos // PAGE] * PAGE + pos % PAGE,
            1 if n == 1 else max(chunks),
        )  # fmt: skip
        hidden, caches = _forward(
            params,
            cfg,
            caches,
            tokens,
            positions,
            slots,
            jnp.asarray([start + n], jnp.int32),
            jnp.asarray(table),
            jnp.asarray([0, n], jnp.int32),
            decode_only=n == 1,
        )
        out.append(np.asarray(compute_logits(params, cfg, hidden[:n])))
        start += n
    return np.concatenate(out)


def hf_logits(path, token_ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoints, arch):
    loaded = load_hf_model(tiny_checkpoints[arch])
    ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, 37).tolist()
    ours = paged_logits(loaded, [37], ids)
    ref = hf_logits(tiny_checkpoints[arch], ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_step_by_step_equals_one_shot_prefill(tiny_checkpoints, arch):
    loaded = load_hf_model(tiny_checkpoints[arch])
    ids = np.random.default_rng(2).integers(0, loaded.config.vocab_size, 21).tolist()
    one_shot = paged_logits(loaded, [21], ids)
    stepwise = paged_logits(loaded, [5, 8] + [1] * 8, ids)  # chunked prefill, then decodes
    assert np.isfinite(stepwise).all()
    np.testing.assert_allclose(stepwise, one_shot, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_scanned_layers_equal_the_unrolled_loop(tiny_checkpoints, arch):
    loaded = load_hf_model(tiny_checkpoints[arch])
    ids = np.random.default_rng(3).integers(0, loaded.config.vocab_size, 19).tolist()
    unrolled = paged_logits(loaded, [11, 1, 1, 6], ids)
    stacked = stack_layers(load_hf_model(tiny_checkpoints[arch]).params)
    assert isinstance(stacked["layers"], dict)
    assert stacked["layers"]["wq"].shape[0] == loaded.config.num_layers
    scanned = paged_logits(loaded, [11, 1, 1, 6], ids, params=stacked)
    np.testing.assert_allclose(scanned, unrolled, atol=2e-6, rtol=0)
    if arch != "qwen3":  # one family (q/k norms in the switch's branches) keeps CI short
        return
    # Per-layer weights under the scan, each layer's projections picked by lax.switch.
    switched = switch_layers(stacked)
    assert switchable(loaded.config) and isinstance(switched["layers"], tuple)
    assert len(switched["layers"]) == loaded.config.num_layers
    hlo = _forward.lower(switched, loaded.config, *_dummy_args(loaded.config)).as_text()
    assert "stablehlo.case" in hlo and "stablehlo.while" in hlo  # a scan, not unrolled
    by_switch = paged_logits(loaded, [11, 1, 1, 6], ids, params=switched)
    np.testing.assert_allclose(by_switch, unrolled, atol=2e-6, rtol=0)


def _dummy_args(cfg, tokens=4, pages=4):
    """forward's positional arguments after cfg, for lowering: one sequence of tokens."""
    shape = (cfg.num_kv_heads, cfg.num_layers * pages, PAGE, cfg.head_dim)
    ints = jnp.zeros(tokens, jnp.int32)
    table = jnp.zeros((1, pages), jnp.int32)
    lens, starts = jnp.asarray([tokens], jnp.int32), jnp.asarray([0, tokens], jnp.int32)
    return (jnp.zeros(shape), jnp.zeros(shape)), ints, ints, ints, lens, table, starts


def test_switched_layers_keep_a_tied_head_transposed(tiny_checkpoints):
    """switch_layers keeps a tied embedding [V, D] only transposed ("tied_head" [D, V], packed
    for the CPU's matmul kernel: models/packed.py); compute_logits then multiplies it, giving
    the tied product's logits (the forward's lookup of its columns: the parity tests). Untied
    models and switch_layers(tied_head=False) keep the params as they were."""
    loaded = load_hf_model(tiny_checkpoints["llama3"])  # tied
    cfg, embed = loaded.config, np.asarray(loaded.params["embed"])
    switched = switch_layers(loaded.params)
    head = switched["tied_head"]
    assert isinstance(head, PackedWeight)
    np.testing.assert_array_equal(np.asarray(cpu_kernel.unpack(head.panels)), embed.T)
    plain = switch_layers(loaded.params, pack=False)["tied_head"]
    np.testing.assert_array_equal(np.asarray(plain), embed.T)
    assert "embed" not in switched  # one copy of the table
    assert "tied_head" not in switch_layers(loaded.params, tied_head=False)
    hidden = jnp.asarray(np.random.default_rng(5).standard_normal((3, cfg.hidden_size)), jnp.float32)
    np.testing.assert_allclose(np.asarray(compute_logits(switched, cfg, hidden)),
                               np.asarray(hidden) @ embed.T, atol=2e-6, rtol=0)
    untied = load_hf_model(tiny_checkpoints["qwen3"]).params
    assert "lm_head" in untied and "tied_head" not in switch_layers(untied)
