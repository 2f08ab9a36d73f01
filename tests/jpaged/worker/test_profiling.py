"""The benchmarks' step timer wraps a runner without changing what the engine does."""

from jpaged import SamplingParams
from jpaged.worker.profiling import StepTimer


def test_step_timer_logs_every_step_and_detaches(demo_llm):
    engine = demo_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = demo_llm.generate(["time me", "and me"], params)
    runner = engine.runner
    timer = StepTimer.attach(engine)
    try:
        got = demo_llm.generate(["time me", "and me"], params)
    finally:
        timer.detach()
    assert engine.runner is runner
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(timer.log) >= 5  # a prefill, then one step per decode token
    key, rows, context, seconds = timer.log[-1]
    # A decode step: its own program where the platform has them (on CPU the ragged one).
    assert key.decode_only == engine.config.decode_programs
    assert rows == 2 and context > 0 and seconds >= 0
