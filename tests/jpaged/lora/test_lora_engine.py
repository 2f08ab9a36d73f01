"""LoRA adapters through the engine (issue 55): greedy tokens equal transformers' on the base
checkpoint with the adapter merged in (two families, adapters of different ranks, rsLoRA,
attention-only and all seven modules); a batch mixing adapters and the base equals each run
alone; adapters beyond the device slots wait and swap in LRU; loading one compiles nothing;
prefix-cache pages are never shared across adapters; bad adapters are one-line errors that
leave the engine serving."""

from __future__ import annotations

import json
import re

import pytest
from dense_families import hf_greedy
from lora_adapters import merge, write_adapter

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.lora import LoRAError

pytestmark = pytest.mark.needs_torch  # left out by --without-torch (tests/needs_torch.py)

PROMPTS = [[1, 5, 9, 13, 17, 21, 3, 7, 11], [2, 4, 6, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _llm(base, **kwargs):
    kwargs = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 3, **kwargs}
    return LLM(str(base), enable_lora=True, max_num_seqs=8, max_model_len=64, num_pages=64,
               page_size=4, max_num_batched_tokens=32, **kwargs)  # fmt: skip


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_checkpoints):
    """The tiny Llama, four adapters of it (ranks 8, 4, 16, 2) and one engine."""
    root = tmp_path_factory.mktemp("lora_llama")
    base = tiny_checkpoints["llama"]
    adapters = {
        "all8": write_adapter(root / "all8", base, rank=8, seed=1),
        "attn4": write_adapter(root / "attn4", base, rank=4, seed=2,
                               modules=("q_proj", "v_proj", "o_proj"), use_rslora=True),
        "mlp16": write_adapter(root / "mlp16", base, rank=16, seed=3,
                               modules=("gate_proj", "up_proj", "down_proj"), alpha=8),
        "k2": write_adapter(root / "k2", base, rank=2, seed=4, modules=("k_proj", "down_proj")),
    }  # fmt: skip
    requests = {n: LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(adapters.items(), 1)}
    return base, adapters, requests, _llm(base)


@pytest.mark.parametrize("name", ["all8", "attn4"])
def test_llama_tokens_equal_transformers_merged(llama, name, tmp_path):
    base, adapters, requests, llm = llama
    want = hf_greedy(merge(base, adapters[name], tmp_path / "merged"), PROMPTS, 6)
    assert want != hf_greedy(base, PROMPTS, 6)  # the adapter changes the tokens
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests[name])) == want


def test_qwen2_tokens_equal_transformers_merged(tiny_checkpoints, tmp_path):
    """Qwen2 (q/k/v biases) with a rank-16 adapter on every module and a rank-4 one."""
    base = tiny_checkpoints["qwen2"]
    a16 = write_adapter(tmp_path / "a16", base, rank=16, seed=5)
    a4 = write_adapter(tmp_path / "a4", base, rank=4, seed=6, modules=("q_proj", "up_proj"))
    llm = _llm(base)
    for i, adapter in enumerate((a16, a4), 1):
        want = hf_greedy(merge(base, adapter, tmp_path / f"m{i}"), PROMPTS, 6)
        got = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(f"q{i}", i, str(adapter)))
        assert _tokens(got) == want


def test_mixed_batch_equals_each_alone_and_lru_swaps(llama):
    """Three adapters and the base in one batch with two device slots: the third adapter's
    requests wait for a slot (the least recently used unheld one) and every request gets
    the tokens it gets alone."""
    _, _, requests, llm = llama
    names = [None, "all8", "mlp16", "k2"]
    alone = {
        n: _tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests.get(n)))
        for n in names
    }
    assert len({json.dumps(t) for t in alone.values()}) == 4  # all four differ
    writes = llm.stats()["lora_slot_writes"]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [requests.get(n) for n in names for _ in PROMPTS]
    mixed = _tokens(llm.generate(prompts, GREEDY, lora_request=loras))
    assert mixed == [t for n in names for t in alone[n]]
    stats = llm.stats()
    assert stats["lora_slot_writes"] - writes >= 2  # two of the three were swapped in
    assert stats["lora_slots_used"] == 2


def test_loading_at_run_time_compiles_nothing(llama, tmp_path):
    base, _, requests, llm = llama
    llm.generate(PROMPTS, GREEDY, lora_request=requests["all8"])
    compiled = llm.stats()["num_compiled"]
    fresh = write_adapter(tmp_path / "fresh", base, rank=16, seed=9)
    for i in range(3):  # new adapters read and written into slots while serving
        req = LoRARequest(f"fresh{i}", 100 + i, str(fresh))
        llm.generate(PROMPTS, GREEDY, lora_request=req)
    assert llm.stats()["num_compiled"] == compiled


def test_prefix_cache_is_keyed_by_adapter(llama):
    _, _, requests, llm = llama
    prompt = [[3] * 12]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt, one, lora_request=requests["all8"])
    llm.reset_stats()
    llm.generate(prompt, one, lora_request=requests["attn4"])
    llm.generate(prompt, one)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    llm.generate(prompt, one, lora_request=requests["all8"])
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_host_memory_keeps_max_cpu_loras(llama):
    _, _, requests, llm = llama
    for name in ("all8", "attn4", "mlp16", "k2"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=requests[name])
    assert llm.stats()["lora_host_adapters"] == 3


def _bad(tmp_path, base, change):
    path = write_adapter(tmp_path / "bad", base, rank=4, seed=7)
    change(path)
    return LoRARequest("bad", 77, str(path))


def _set_config(**fields):
    def change(path):
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, **fields}))

    return change


def _reshape_one(path):
    from safetensors.numpy import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    key = next(k for k in tensors if "layers.1.mlp.up_proj.lora_B" in k)
    tensors[key] = tensors[key][:-1]
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set_config(r=32), "rank 32 exceeds max_lora_rank 16"),
        (_set_config(target_modules=["q_proj", "qkv_proj"]), "target module(s) qkv_proj"),
        (_reshape_one, "up_proj.lora_B.weight has shape [127, 4], expected [128, 4]"),
        (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x00garbage"),
         "is not a readable safetensors file"),
        (lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
        (lambda p: (p / "adapter_config.json").write_text("{"), "adapter_config.json is not valid JSON"),
    ],
)  # fmt: skip
def test_bad_adapter_is_one_line_error_and_engine_serves_on(llama, tmp_path, change, message):
    base, _, requests, llm = llama
    bad = _bad(tmp_path, base, change)
    before = llm.stats()
    with pytest.raises(LoRAError) as err:
        llm.generate(PROMPTS, GREEDY, lora_request=[requests["all8"], bad])
    text = str(err.value)
    assert text.startswith("LoRA adapter 'bad': ") and message in text and "\n" not in text
    after = llm.stats()
    assert after["num_running"] == after["num_waiting"] == 0  # nothing was queued
    assert after["lora_slot_writes"] == before["lora_slot_writes"]
    out = llm.generate(PROMPTS[:1], GREEDY, lora_request=requests["all8"])
    assert len(out[0].outputs[0].token_ids) == 6


def test_lora_request_without_enable_lora_is_refused(demo_llm, tmp_path):
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        demo_llm.generate(["hi"], GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))


def test_speculative_decoding_with_adapters_keeps_the_tokens(llama):
    """n-gram speculation verifies proposals with each row's adapter: the same greedy tokens
    as without speculation, in a batch mixing two adapters and the base."""
    base, _, requests, llm = llama
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [4, 5, 4, 5, 4, 5], PROMPTS[0]]
    loras = [requests["all8"], requests["attn4"], None]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = _tokens(llm.generate(prompts, params, lora_request=loras))
    spec = _llm(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 2, "prompt_lookup_min": 1})  # fmt: skip
    assert _tokens(spec.generate(prompts, params, lora_request=loras)) == want
    assert spec.stats()["spec_num_draft_tokens"] > 0


def test_bfloat16_slots_equal_transformers_on_the_rounded_adapter(llama, tmp_path):
    """--lora-dtype bfloat16 on the float32 model: an adapter whose weights are bfloat16
    values (scale 2, exact) gives transformers' tokens with it merged in float32."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    base = llama[0]
    path = write_adapter(tmp_path / "bf16", base, rank=8, seed=7)
    file = str(path / "adapter_model.safetensors")
    tensors = load_file(file)
    for k, v in tensors.items():  # round to nearest bfloat16 (ties to even)
        bits = v.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        tensors[k] = bits.astype(np.uint32).view(np.float32)
    save_file(tensors, file)
    want = hf_greedy(merge(base, path, tmp_path / "merged"), PROMPTS, 6)
    llm = _llm(base, lora_dtype="bfloat16")
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("b", 1, str(path)))) == want


def test_structured_outputs_with_adapters_hold_and_batch_like_alone(llama):
    """Constraints masked over each row's adapter logits: in a batch mixing two adapters and
    the base, every row's text satisfies its constraint and equals the row run alone, and
    the adapters' constrained choices differ from the base's (the mask is applied to the
    adapter's logits, not the base's)."""
    from jpaged.structured_output import StructuredOutputsParams as Constraint

    _, _, requests, llm = llama
    regex = Constraint(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}")
    digits = {"type": "integer", "minimum": 0, "maximum": 9}
    words = Constraint(json={"type": "array", "items": digits, "minItems": 3, "maxItems": 3},
                       disable_any_whitespace=True)  # fmt: skip
    names = [None, "all8", "attn4"]
    cases = [(n, c) for n in names for c in (regex, words)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for _, c in cases]
    loras = [requests.get(n) for n, _ in cases]
    prompt = [PROMPTS[0]] * len(cases)
    alone = [
        llm.generate([p], [sp], lora_request=r)[0].outputs[0]
        for p, sp, r in zip(prompt, params, loras, strict=True)
    ]
    mixed = [o.outputs[0] for o in llm.generate(prompt, params, lora_request=loras)]
    assert [c.token_ids for c in mixed] == [c.token_ids for c in alone]
    for (name, c), out in zip(cases, mixed, strict=True):
        assert out.finish_reason == "stop", (name, c.kind, out.text)
        if c is regex:
            assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}", out.text), (name, out.text)
        else:
            value = json.loads(out.text)
            assert len(value) == 3 and all(v in range(10) for v in value), (name, out.text)
    base_texts = [mixed[0].text, mixed[1].text]
    assert [mixed[2].text, mixed[3].text] != base_texts
    assert [mixed[4].text, mixed[5].text] != base_texts
    assert llm.stats()["pages_used"] == 0
