"""The mapping budget: a compile near vm.max_map_count is refused with an error, not an abort."""

import os

import pytest

from jpaged import LLM, SamplingParams
from jpaged.core.engine import EngineStepError
from jpaged.worker.map_count import MAX_MAP_COUNT, MIN_MARGIN, MapBudget, MapCountError, map_usage

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_map_usage_counts_the_lines_of_the_maps_file_and_reads_the_limit(tmp_path):
    maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
    maps.write_text("a\nb\nc\n")
    limit.write_text("100\n")
    assert map_usage(str(maps), str(limit)) == (3, 100)
    assert map_usage(str(maps), str(tmp_path / "absent")) is None
    limit.write_text("many\n")
    assert map_usage(str(maps), str(limit)) is None


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_map_usage_of_this_process():
    if not os.path.exists(MAX_MAP_COUNT):
        pytest.skip("no /proc/sys/vm/max_map_count here (not Linux)")
    # The count is read between two countings of our own: other threads of this worker (an
    # earlier test's engine or compile threads) map and unmap meanwhile; once in a CI run
    # the two readings were 138 apart, past a fixed tolerance of 50.
    before = _maps()
    count, limit = map_usage()
    after = _maps()
    with open(MAX_MAP_COUNT) as f:
        assert limit == int(f.read())
    assert min(before, after) - 50 < count < max(before, after) + 50


def test_the_budget_refuses_a_compile_within_its_margin_of_the_cap():
    usage = [(65530 - MIN_MARGIN, 65530)]
    budget = MapBudget(usage=lambda: usage[-1])
    assert budget.margin == MIN_MARGIN == 1024
    assert budget.check("prelude") == (64506, 65530)
    usage.append((64507, 65530))
    with pytest.raises(MapCountError) as err:
        budget.check("prelude")
    assert str(err.value) == (
        "not compiling prelude: this process has 64507 memory mappings, vm.max_map_count is "
        "65530 and a compile may add 1024; raise it (sysctl -w vm.max_map_count=262144) or "
        "compile fewer programs (a smaller --precompile-max-len, --max-num-seqs or "
        "--max-model-len)"
    )
    assert isinstance(err.value, OSError)  # the CLI's one-line error, exit status 1


def test_the_budget_learns_the_largest_compile():
    usage = [(1000, 65530)]
    budget = MapBudget(usage=lambda: usage[-1])
    before = budget.check("a")
    usage.append((1800, 65530))
    budget.record(before)
    assert (budget.largest_increase, budget.margin) == (800, 1200)
    before = budget.check("b")
    usage.append((2100, 65530))
    budget.record(before)
    assert (budget.largest_increase, budget.margin) == (800, 1200)  # 300 is not larger
    usage.append((65530 - 1200, 65530))
    assert budget.check("c") == (64330, 65530)
    usage.append((64331, 65530))
    with pytest.raises(MapCountError, match="a compile may add 1200;"):
        budget.check("c")


def test_without_proc_the_budget_checks_nothing():
    budget = MapBudget(usage=lambda: None)
    assert budget.check("a") is None
    budget.record(None)
    assert budget.largest_increase == 0


def test_at_the_cap_a_request_no_compiled_program_holds_is_refused_and_others_served(
    demo_model_dir, monkeypatch
):
    """At the cap, a request whose prompt needs a step bigger than every compiled program
    is refused at add_request, naming the step and the cap; one the compiled programs hold
    is served, and with room to compile the big ones are too."""
    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    engine = llm.llm_engine
    programs = engine.runner.programs
    one = [list(range(3, 8))]
    four = [list(range(3, 3 + n)) for n in (30, 31, 32, 33)]
    want_one = [o.outputs[0].token_ids for o in llm.generate(one, GREEDY)]
    compiled = programs.num_compiles
    monkeypatch.setattr(programs, "map_budget", MapBudget(usage=lambda: (65000, 65530)))
    # The programs one short prompt needs are compiled: no compile, no check.
    assert [o.outputs[0].token_ids for o in llm.generate(one, GREEDY)] == want_one
    for i, prompt in enumerate(four):
        with pytest.raises(ValueError) as err:
            engine.add_request(f"big-{i}", prompt, GREEDY)
        assert str(err.value).startswith(
            f"the request needs a step of {len(prompt)} tokens and 1 row, which no compiled "
            "step program holds: not compiling its step program: this process has 65000 "
            "memory mappings, vm.max_map_count is 65530"
        ), err.value
    assert not engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(one, GREEDY)] == want_one
    assert programs.num_compiles == compiled
    monkeypatch.setattr(programs, "map_budget", MapBudget())
    outs = llm.generate(four, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4, 4]
    assert programs.num_compiles > compiled


def test_a_step_that_meets_the_cap_fails_alone_and_the_engine_serves_on(
    demo_model_dir, monkeypatch
):
    """Requests accepted before the cap is reached, whose first step then needs a compile:
    that step fails (EngineStepError naming the cap) for the requests it holds alone (the
    engine's fault isolation: r0's 30-token prefill fills the step, r1 waits), the engine
    rebuilds its state, keeps r1, and serves it once compiles are allowed."""
    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    engine = llm.llm_engine
    programs = engine.runner.programs
    assert len(llm.generate([list(range(3, 8))], GREEDY)) == 1
    compiled = programs.num_compiles
    for i, n in enumerate((30, 31)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), GREEDY)
    monkeypatch.setattr(programs, "map_budget", MapBudget(usage=lambda: (65000, 65530)))
    with pytest.raises(EngineStepError, match="vm.max_map_count is 65530") as err:
        while engine.has_unfinished_requests():
            engine.step()
    assert isinstance(err.value.__cause__, MapCountError)
    assert sorted(err.value.request_ids) == ["r0"]
    assert programs.num_compiles == compiled
    assert engine.has_unfinished_requests()  # r1 is kept
    monkeypatch.setattr(programs, "map_budget", MapBudget())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert list(done) == ["r1"]
    assert engine.stats()["pages_used"] == 0
    assert done["r1"] == llm.generate([list(range(3, 34))], GREEDY)[0].outputs[0].token_ids
    outs = llm.generate([list(range(3, 33))], GREEDY)
    assert len(outs[0].outputs[0].token_ids) == 4


def test_at_the_cap_requests_whose_features_were_compiled_apart_run_in_separate_batches(
    demo_model_dir, monkeypatch
):
    """A logprobs program and a penalties program compiled apart, none with both: at the
    cap, a logprobs request, a penalties request and a plain one submitted together are all
    served, each with the tokens it gets alone, without a compile: the scheduler admits a
    request only into a batch some compiled program holds (ModelRunner.admits) and
    a step runs on a compiled program with more features than it asks for (holds)."""
    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    engine = llm.llm_engine
    programs = engine.runner.programs
    prompts = [list(range(3, 13)), list(range(20, 28)), list(range(40, 49))]
    params = [GREEDY.clone(logprobs=2), GREEDY.clone(repetition_penalty=1.3), GREEDY]
    alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    keys = programs.step_keys()
    assert not any(k.num_logprobs and k.penalty_shape for k in keys)
    compiled = programs.num_compiles
    monkeypatch.setattr(programs, "map_budget", MapBudget(usage=lambda: (65000, 65530)))
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    # A padded program is another batch shape: the same tokens, logprobs to float rounding.
    assert [d.keys() for d in together[0].logprobs] == [d.keys() for d in alone[0].logprobs]
    for got, want in zip(together[0].logprobs, alone[0].logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert programs.num_compiles == compiled and programs.step_keys() == keys
    assert engine.stats()["pages_used"] == 0


def test_at_the_cap_a_step_runs_padded_on_a_compiled_program_that_holds_it(
    demo_model_dir, monkeypatch, caplog
):
    """With no compile allowed, a step whose shape is not compiled runs on the smallest
    compiled program of more tokens and rows (ModelRunner._runnable), with the tokens it
    gives freshly compiled, and the padding is logged once."""
    import logging

    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    engine = llm.llm_engine
    programs = engine.runner.programs
    four = [list(range(3, 3 + n)) for n in (30, 31, 32, 33)]  # 126 tokens, 4 rows
    two = [list(range(5, 5 + n)) for n in (9, 11)]  # 20 tokens, 2 rows
    assert len(llm.generate(four, GREEDY)) == 4
    before = set(programs.step_keys())
    fresh = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    want = [o.outputs[0].token_ids for o in fresh.generate(two, GREEDY)]
    compiled = programs.num_compiles
    monkeypatch.setattr(programs, "map_budget", MapBudget(usage=lambda: (65000, 65530)))
    with caplog.at_level(logging.WARNING, logger="jpaged.worker.runner"):
        assert [o.outputs[0].token_ids for o in llm.generate(two, GREEDY)] == want
        assert [o.outputs[0].token_ids for o in llm.generate(two, GREEDY)] == want
    assert programs.num_compiles == compiled and set(programs.step_keys()) == before
    padded = [r.getMessage() for r in caplog.records if "memory-mapping cap" in r.getMessage()]
    assert len(padded) == len(set(padded)) >= 1
    # 20 prompt tokens: the 32-token bucket (rows bucketed to 4), run on the 128-token one.
    assert padded[0].endswith("a step of 32 tokens, 4 rows and 4 page columns runs on the "
                              "compiled program of 128, 4 and 4")  # fmt: skip
    assert engine.stats()["pages_used"] == 0


def test_at_the_cap_only_a_request_asking_for_an_uncompiled_feature_is_refused(
    demo_model_dir, monkeypatch
):
    """A request with logprobs, penalties or logit_bias when no compiled program has them
    and no compile is allowed gets a ValueError naming what it asked for and the cap, at
    add_request; the engine keeps serving the plain requests it holds and new ones."""
    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32)
    engine = llm.llm_engine
    prompt = list(range(3, 13))
    want = [o.outputs[0].token_ids for o in llm.generate([prompt], GREEDY)]
    monkeypatch.setattr(engine.runner.programs, "map_budget",
                        MapBudget(usage=lambda: (65000, 65530)))  # fmt: skip
    engine.add_request("plain", prompt, GREEDY)
    for asked, params in (
        ("logprobs", GREEDY.clone(logprobs=2)),
        ("penalties", GREEDY.clone(presence_penalty=0.5)),
        ("logit_bias", GREEDY.clone(logit_bias={7: 1.0})),
        ("logprobs, penalties", GREEDY.clone(logprobs=1, repetition_penalty=1.2)),
    ):
        with pytest.raises(ValueError) as err:
            engine.add_request(f"r-{asked}", prompt, params)
        message = str(err.value)
        assert message.startswith(
            f"the request asks for {asked}, which no compiled step program has: not compiling "
            "its step program: this process has 65000 memory mappings, vm.max_map_count is "
            "65530"
        ), message
        assert "sysctl -w vm.max_map_count=262144" in message
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].token_ids) for o in done] == [("plain", want[0])]
    assert engine.stats()["pages_used"] == 0
    # With room to compile again, the same request is served.
    monkeypatch.setattr(engine.runner.programs, "map_budget", MapBudget())
    out = llm.generate([prompt], GREEDY.clone(logprobs=2))
    assert out[0].outputs[0].token_ids == want[0] and out[0].outputs[0].logprobs


def test_at_the_cap_a_request_longer_than_every_compiled_program_is_refused(
    demo_model_dir, monkeypatch
):
    """Page-column buckets (as on an accelerator): after short requests only 1-column
    programs are compiled; at the cap a request whose prompt + max_tokens span more is
    refused alone at add_request, with the figures; a short one is served."""
    llm = LLM(str(demo_model_dir), max_num_seqs=4, max_model_len=64, num_pages=32,
              page_size=16, min_page_bucket=1, decode_programs=True)  # fmt: skip
    engine = llm.llm_engine
    short = list(range(3, 8))
    want = [o.outputs[0].token_ids for o in llm.generate([short], GREEDY)]
    assert {k.num_page_cols for k in engine.runner.programs.step_keys()} == {1}
    monkeypatch.setattr(engine.runner.programs, "map_budget",
                        MapBudget(usage=lambda: (65000, 65530)))  # fmt: skip
    with pytest.raises(ValueError) as err:
        engine.add_request("long", list(range(3, 43)), GREEDY)  # 40 + 4 tokens: 3 columns
    assert str(err.value).startswith(
        "the request needs 44 tokens of context, more than any compiled step program holds "
        "(16): not compiling its step program: this process has 65000 memory mappings"
    ), err.value
    assert [o.outputs[0].token_ids for o in llm.generate([short], GREEDY)] == want
