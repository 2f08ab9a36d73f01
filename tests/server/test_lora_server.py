"""LoRA adapters over the OpenAI API (server/lora_api.py) on a real engine: --lora-modules at
start, load and unload at run time (vLLM's endpoints and bodies), /v1/models listing them
with the base as parent, the `model` field selecting an adapter (the same tokens as the
offline API) or the base, and unknown models / bad adapters as 4xx errors."""

from __future__ import annotations

import grpc
import httpx
import pytest
from lora_adapters import write_adapter
from serving_helpers import RunningServer, collect, request

from jpaged import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.needs_torch  # left out by --without-torch (tests/needs_torch.py)

PROMPT = [1, 5, 9, 13, 17, 21]


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    base = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("lora_server")
    a1 = write_adapter(root / "a1", base, rank=8, seed=11)
    a2 = write_adapter(root / "a2", base, rank=4, seed=12, modules=("q_proj", "down_proj"))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4,
              max_model_len=64, num_pages=64, page_size=4, max_num_batched_tokens=32)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=5)
    want = {
        name: llm.generate([PROMPT], greedy, lora_request=req)[0].outputs[0].token_ids
        for name, req in (("base", None), ("a1", LoRARequest("o1", 1, str(a1))),
                          ("a2", LoRARequest("o2", 2, str(a2))))
    }  # fmt: skip
    assert len({tuple(v) for v in want.values()}) == 3
    server = RunningServer(llm.llm_engine, model_name="tiny", lora_modules=(("a1", str(a1)),))
    yield server, want, a2, root
    server.close()


def _complete(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    return httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)


def test_models_lists_adapters_with_their_base(setup):
    server, *_ = setup
    data = httpx.get(f"{server.http_url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a1", "tiny")]
    assert httpx.get(f"{server.http_url}/v1/models/a1").json()["parent"] == "tiny"


def test_model_field_selects_adapter_or_base(setup):
    server, want, *_ = setup
    for model, key in (("a1", "a1"), ("tiny", "base")):
        r = _complete(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want[key]
        assert r.json()["model"] == model


def test_unknown_model_is_404_model_not_found(setup):
    server, *_ = setup
    r = _complete(server, "nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(setup):
    server, want, a2, _ = setup
    url = server.http_url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2)})
    assert r.status_code == 200, r.text
    assert _complete(server, "a2").json()["choices"][0]["token_ids"] == want["a2"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2)})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200, r.text
    assert _complete(server, "a2").status_code == 404
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404


def test_bad_adapter_is_400_naming_it_and_server_serves_on(setup):
    server, want, _, root = setup
    url = server.http_url
    missing = root / "missing"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(missing)})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"LoRA adapter 'bad': {missing} is not a directory"
    names = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert "bad" not in names
    assert _complete(server, "a1").json()["choices"][0]["token_ids"] == want["a1"]


def test_grpc_lora_name_selects_adapter_and_unknown_is_not_found(setup):
    server, want, *_ = setup
    for name, key in (("a1", "a1"), ("tiny", "base")):
        req = request(PROMPT, temperature=0, max_tokens=5)
        req.lora_name = name
        assert collect(server.stub, req).token_ids[0] == want[key]
    req = request(PROMPT, temperature=0, max_tokens=5)
    req.lora_name = "nope"
    with pytest.raises(grpc.RpcError) as err:
        collect(server.stub, req)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no LoRA adapter 'nope'" in err.value.details()
