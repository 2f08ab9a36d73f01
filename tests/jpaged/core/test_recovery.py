"""A failed step: the engine drops the requests it held, rebuilds its state and serves again.

Faults are injected inside the step before dispatch (the step program raises) and after it
(fetching the sampled tokens raises, when the donated pool is already consumed). The engine's
outputs after the fault must equal a fresh run's, prefix cache included (it is dropped with
the pool: a hit on a page of the old pool would read zeros).
"""

import pytest

from jpaged import LLM, SamplingParams
from jpaged.core.engine import EngineStepError

PROMPTS = [list(range(3, 3 + n)) for n in (5, 21, 40)]  # 40: two full pages shared below
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(
        str(demo_model_dir),
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        page_size=16,
        num_pages=32,
    )


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


class Once:
    """Raises RuntimeError the first time it is called, then calls through."""

    def __init__(self, fn):
        self.fn, self.fired = fn, False

    def __call__(self, *args, **kwargs):
        if not self.fired:
            self.fired = True
            raise RuntimeError("injected fault")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("where", ["before_dispatch", "after_dispatch"])
def test_a_failed_step_drops_its_requests_and_the_engine_serves_the_same_tokens(
    llm, monkeypatch, where
):
    engine = llm.llm_engine
    want = tokens(llm.generate(PROMPTS, GREEDY))  # also fills the prefix cache
    assert engine.stats()["pages_cached"] > 0
    if where == "before_dispatch":
        monkeypatch.setattr(engine.runner.programs, "step", Once(engine.runner.programs.step))
    else:
        monkeypatch.setattr(engine.runner, "fetch", Once(engine.runner.fetch))
    recoveries = engine.stats()["num_recoveries"]
    with pytest.raises(EngineStepError, match="injected fault") as err:
        llm.generate(PROMPTS, GREEDY)
    assert len(err.value.request_ids) == len(PROMPTS)
    stats = engine.stats()
    assert stats["num_recoveries"] == recoveries + 1
    assert (stats["pages_used"], stats["pages_cached"]) == (0, 0)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert not engine.has_unfinished_requests()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want  # nothing stale survives
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want  # prefix hits on the new pool
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
