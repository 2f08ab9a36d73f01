"""The persistent compilation cache: a second engine start-up reads compiled steps from disk."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from jpaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16,
              page_size=8, num_pages=16, compilation_cache_dir=sys.argv[2])
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    import jax
    print(json.dumps({"tokens": out[0].outputs[0].token_ids,
                      "dir": llm.llm_engine.compilation_cache_dir,
                      "jax_dir": jax.config.jax_compilation_cache_dir}))
    """
)


def run(model, cache_dir, env_extra=None):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(env_extra or {})
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(cache_dir)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_start_reads_the_cache_and_gives_the_same_tokens(tiny_checkpoints, tmp_path):
    model, cache = tiny_checkpoints["llama"], tmp_path / "xla"
    first = run(model, cache)
    assert first["dir"] == str(cache)
    entries = {p.name for p in cache.iterdir()}
    assert any(name.startswith("jit_step") for name in entries), entries
    second = run(model, cache)
    assert second["tokens"] == first["tokens"]
    assert {p.name for p in cache.iterdir()} == entries  # nothing new had to be compiled


def test_off_and_a_user_setting_are_respected(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    off = run(model, "off")
    assert off["dir"] is None and off["jax_dir"] is None
    mine = tmp_path / "mine"
    kept = run(model, tmp_path / "ignored", {"JAX_COMPILATION_CACHE_DIR": str(mine)})
    assert kept["dir"] == str(mine) and not (tmp_path / "ignored").exists()
