"""LoRAManager's slots without a device: admission holds a slot per request, evicts only
unheld slots (least recently admitted first), writes each load once, and refuses to unload
an adapter a request uses."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_adapters import write_adapter

from jpaged.config import LoRAConfig
from jpaged.core.sequence import RequestGroup
from jpaged.lora import LoRAError, LoRAManager, LoRARequest
from jpaged.sample.sampling_params import SamplingParams
from models.config import ModelConfig

# A tiny Llama's config.json alone: adapters need no weights (and no torch) to be written
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip


@pytest.fixture
def manager(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_hf_config(CONFIG)
    m = LoRAManager(LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8), cfg)
    reqs = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp_path / f"a{i}", base, rank=4,
                                                           seed=i))) for i in range(3)]  # fmt: skip
    return m, reqs


def _group(rid: str):
    return RequestGroup(rid, None, [1, 2], SamplingParams(), 0)


def test_slots_are_held_until_release_and_evicted_lru(manager):
    m, (a0, a1, a2) = manager
    groups = {}
    for rid, req in (("r0", a0), ("r1", a1), ("r2", a2)):
        groups[rid] = _group(rid)
        m.attach(groups[rid], m.resolve(req))
    assert m.admit(groups["r0"]) and m.admit(groups["r1"])
    assert (groups["r0"].lora_slot, groups["r1"].lora_slot) == (0, 1)
    assert [s for s, _ in m.take_loads()] == [0, 1]
    assert not m.admit(groups["r2"])  # both slots held: it waits
    assert m.take_loads() == ()
    m.release(groups["r1"])
    assert m.admit(groups["r2"]) and groups["r2"].lora_slot == 1  # r1's slot, now unheld
    assert [(s, a.name) for s, a in m.take_loads()] == [(1, "a2")]
    again = _group("r3")
    m.attach(again, m.resolve(a0))
    assert m.admit(again) and again.lora_slot == 0 and m.take_loads() == ()  # resident


def test_unload_refused_while_in_use(manager):
    m, (a0, *_) = manager
    m.add(a0)
    g = _group("r0")
    m.attach(g, m.resolve(a0))
    with pytest.raises(LoRAError, match="'a0': in use by 1 request"):
        m.remove("a0")
    m.release(g)
    m.remove("a0")
    with pytest.raises(LoRAError, match="no adapter of that name"):
        m.remove("a0")


def test_memory_plan_counts_the_slot_bytes():
    import jax.numpy as jnp

    from jpaged.config import EngineConfig
    from jpaged.core.memory_plan import lora_slot_bytes
    from models import lora
    from models.llama import init_params

    cfg = ModelConfig.from_hf_config({**CONFIG, "architectures": ["Qwen2ForCausalLM"],
                                      "model_type": "qwen2", "num_key_value_heads": 1})  # fmt: skip
    config = EngineConfig(lora=LoRAConfig(enable_lora=True, max_loras=3, max_lora_rank=8))
    params = lora.with_slots(init_params(cfg), cfg, 3, 8, jnp.float32)
    slots = lora.split_slots(params)[1]
    want = sum(a.nbytes for layer in slots for a in layer.values())
    assert lora_slot_bytes(cfg, config, 4) == want > 0
    assert lora_slot_bytes(cfg, EngineConfig(), 4) == 0
    bf16 = EngineConfig(lora=LoRAConfig(enable_lora=True, max_loras=3, max_lora_rank=8,
                                         lora_dtype="bfloat16"))  # fmt: skip
    slots = lora.split_slots(lora.with_slots(init_params(cfg), cfg, 3, 8,
                                             lora.storage_dtype("bfloat16", jnp.float32)))[1]
    assert lora_slot_bytes(cfg, bf16, 4) == sum(a.nbytes for s in slots for a in s.values())
    assert lora_slot_bytes(cfg, bf16, 4) * 2 == want
    with pytest.raises(ValueError, match="max_cpu_loras \\(2\\) must be >= max_loras \\(3\\)"):
        LoRAConfig(max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_dtype must be one of .* got 'float16'"):
        LoRAConfig(lora_dtype="float16")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "admit", "release", "step", "unload"]),
                              st.integers(0, 5), st.integers(0, 2)), max_size=60))  # fmt: skip
def test_interleavings_never_serve_the_wrong_adapter(manager, ops):
    """Requests arrive on adapters (or the base), are admitted, stepped, released, and
    adapters are unloaded, in any order: every step's rows read their own adapter from the
    device slots (the slot writes applied in step order), a held slot is never rewritten,
    and an unload of an adapter in use is refused."""
    m0, reqs = manager
    m = LoRAManager(m0.config, m0.model_config)  # fresh for each example
    for r in reqs:
        m.registered[r.lora_name] = r
    device: list = [None] * m.num_slots  # what each device slot holds, writes applied
    groups: dict[int, RequestGroup] = {}  # waiting or admitted, by request number
    admitted: set[int] = set()
    for op, g, a in ops:
        if op == "add" and g not in groups:
            group = groups[g] = _group(f"r{g}")
            if a < 2:  # adapter a; 2: the base model
                m.attach(group, m.resolve(reqs[a]))
        elif op == "admit" and g in groups and m.admit(groups[g]):
            admitted.add(g)
        elif op == "release" and g in groups:
            m.release(groups.pop(g))
            admitted.discard(g)
        elif op == "step":
            for slot, adapter in m.take_loads():
                holders = [groups[i] for i in admitted if groups[i].lora_slot == slot]
                assert all(h.lora is adapter for h in holders)  # no held slot rewritten
                device[slot] = adapter
            for i in admitted:
                group = groups[i]
                if group.lora is None:
                    assert group.lora_slot == -1
                else:
                    assert device[group.lora_slot] is group.lora
        elif op == "unload":
            name = reqs[a].lora_name
            in_use = any(x.lora is not None and x.lora.name == name for x in groups.values())
            if in_use:
                with pytest.raises(LoRAError, match="in use"):
                    m.remove(name)
            elif name in m.registered:
                m.remove(name)
                m.registered[name] = reqs[a]  # registered again for the next ops
