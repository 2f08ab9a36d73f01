"""Engine behaviour on the demo model: bounded compilation, validation, seeds, stops, n."""

import threading

import numpy as np
import pytest

from jpaged import SamplingParams
from jpaged.sample.sampling_params import RequestOutputKind


@pytest.fixture
def llm(demo_llm):
    return demo_llm


def test_compiled_programs_stay_within_the_bucket_count(llm):
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(1, 100, 50)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(1, 24, 50)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    stats = llm.stats()
    assert 0 < stats["num_compiled"] <= stats["num_buckets"]
    assert stats["pages_used"] == 0


BAD = [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "prompt must not be empty"),
    ([1] * 300, SamplingParams(), "max_model_len"),
    ([10**7], SamplingParams(), "outside the vocabulary"),
]


@pytest.mark.parametrize("prompt,params,match", BAD)
def test_bad_prompt_raises_and_engine_stays_usable(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n must be"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed="x"), "seed"),
        (dict(stop=[1, 2]), "stop"),
        (dict(stop=3), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_seed_gives_the_same_tokens_alone_and_in_a_batch(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["the seed test"], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=int(5 + i), seed=i, ignore_eos=True)
              for i in range(15)]
    prompts = [f"other prompt {i} " * (i + 1) for i in range(15)]
    batch = llm.generate(prompts[:7] + ["the seed test"] + prompts[7:], others[:7] + [p] + others[7:])
    assert batch[7].outputs[0].token_ids == alone
    different = llm.generate(["the seed test"], p.clone(seed=4321))[0].outputs[0].token_ids
    assert different != alone


def test_top_k_one_equals_greedy(llm):
    prompts = ["a b c", "hello world"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    topk = llm.generate(
        prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=10, seed=5, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = llm.generate(["stop here"], greedy)[0].outputs[0]
    stop_at = ref.token_ids[4]
    first = ref.token_ids.index(stop_at)
    out = llm.generate(["stop here"], greedy.clone(stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert ref.finish_reason == "length"


def test_n_samples_share_the_prompt_and_differ(llm):
    out = llm.generate(["fork me"], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3,
                                                   ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(s) == 8 for s in seqs)
    assert len(set(seqs)) > 1
    again = llm.generate(["fork me"], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3,
                                                     ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert llm.stats()["pages_used"] == 0


def test_final_only_gets_one_output_when_finished(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request(
        "quiet", "a quiet one", params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    )
    engine.add_request("loud", "a quiet one", params)  # CUMULATIVE: SamplingParams' default
    seen = {"quiet": [], "loud": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["quiet"]] == [True]
    assert len(seen["loud"]) == 6 and seen["loud"][-1].finished
    assert seen["quiet"][0].outputs[0].token_ids == seen["loud"][-1].outputs[0].token_ids


class _FakeAccelerator:
    platform = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 10_000_000, "bytes_in_use": 2_000_000}


@pytest.mark.parametrize("tp,shards", [(1, 1), (2, 2), (8, 4)])
def test_pool_from_free_device_memory_counts_each_device_share(monkeypatch, tp, shards):
    from jpaged.config import CacheConfig, EngineConfig, ParallelConfig
    from jpaged.core.memory_plan import resolve_num_pages
    from models.config import ModelConfig

    monkeypatch.setattr("jax.devices", lambda *a: [_FakeAccelerator()])
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=256,
    )
    cache = CacheConfig(page_size=16, kv_memory_fraction=0.5)
    config = EngineConfig(cache=cache, parallel=ParallelConfig(tensor_parallel_size=tp))
    per_page = 2 * 2 * 4 * 16 * 8 * 4  # K and V, layers, kv heads, page, head_dim, f32
    # 0.5 x 8 MB free on each device; each device holds 1/shards of a page.
    assert resolve_num_pages(cache, config, cfg, 4) == 4_000_000 // (per_page // shards) + 1


def test_a_second_thread_stepping_the_engine_is_refused(llm, monkeypatch):
    """While one thread is inside step(), another's step() raises and changes nothing: the
    first step's request finishes with the tokens it makes alone."""
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = llm.generate(["hello"], greedy)[0].outputs[0].token_ids
    fetch = engine.runner.fetch
    inside, go_on = threading.Event(), threading.Event()

    def held_fetch(step):
        inside.set()
        assert go_on.wait(60)
        return fetch(step)

    monkeypatch.setattr(engine.runner, "fetch", held_fetch)
    engine.add_request("owner", "hello", greedy)
    outputs = []
    owner = threading.Thread(target=lambda: outputs.extend(engine.step()))
    owner.start()
    assert inside.wait(60)
    with pytest.raises(RuntimeError, match="another thread is stepping this engine"):
        engine.step()
    go_on.set()
    owner.join(60)
    monkeypatch.setattr(engine.runner, "fetch", fetch)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished]
    assert [o.request_id for o in final] == ["owner"]
    assert final[0].outputs[0].token_ids == want
