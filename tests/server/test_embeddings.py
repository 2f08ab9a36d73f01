"""POST /v1/embeddings on SmolLM2 over loopback: transformers' pooled hidden states, OpenAI's
shapes (float and base64), usage, and bad inputs as 400s naming the field."""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import pytest
import torch  # the reference runs transformers (tests/needs_torch.py reads this import)
from serving_helpers import RunningServer, openai_client

from jpaged import LLM

INPUTS = [
    "Paris",
    "The capital of France is Paris, a city on the Seine.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen; "
    "plants, algae and some bacteria do it, and almost all life depends on it.",
]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    llm = LLM(
        str(smollm2_gguf), max_num_seqs=2, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32
    )
    # Compiled here, outside RunningServer's 60 s start-up limit (which a loaded machine
    # passed); the server's own warm-up then finds every program compiled.
    llm.llm_engine.warm_up(64, up_to=MAX_MODEL_LEN)
    s = RunningServer(llm.llm_engine, model_name="smollm2")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(hf_smollm2_tokenizer, hf_smollm2_model):
    """transformers' normalised last-token hidden state of each input, and its token ids
    (tests/smollm2_fixtures.py: the model test_gguf_smollm2 also uses, on the same worker)."""
    tok, model = hf_smollm2_tokenizer, hf_smollm2_model
    out = []
    with torch.no_grad():
        for text in INPUTS:
            ids = tok(text, return_tensors="pt").input_ids
            h = model.model(ids).last_hidden_state[0, -1].double().numpy()
            out.append((ids[0].tolist(), h / np.linalg.norm(h)))
    return out


def post(server, body) -> httpx.Response:
    return httpx.post(f"{server.http_url}/v1/embeddings", json=body, timeout=120)


def test_embeddings_equal_transformers_in_float_and_base64(server, reference):
    # Three mixed-length inputs, two sequence slots, a 32-token budget: chunked and batched.
    r = post(server, {"model": "smollm2", "input": INPUTS, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["object"], body["model"]) == ("list", "smollm2")
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(3)]
    for d, (_, want) in zip(body["data"], reference, strict=True):
        np.testing.assert_allclose(d["embedding"], want, atol=1e-5)
    num_tokens = sum(len(ids) for ids, _ in reference)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    # The official client asks for base64 and decodes it: the same float32 values.
    got = openai_client(server, timeout=120).embeddings.create(model="smollm2", input=INPUTS)
    assert [e.embedding for e in got.data] == [d["embedding"] for d in body["data"]]
    # The same inputs (the same batch, so the same programs: a lone input runs a smaller
    # token bucket, whose float32 sums may round differently) asked for as base64.
    raw = post(server, {"input": INPUTS, "encoding_format": "base64"}).json()["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in raw]
    assert decoded == [d["embedding"] for d in body["data"]]


def test_token_id_inputs_and_dimensions(server, reference):
    ids = [i for i, _ in reference]
    r = post(server, {"input": ids[:2], "dimensions": 64, "encoding_format": "float"}).json()
    for d, (_, full) in zip(r["data"], reference[:2], strict=True):
        want = full[:64] / np.linalg.norm(full[:64])
        np.testing.assert_allclose(d["embedding"], want, atol=1e-5)
    one = post(server, {"input": ids[0], "encoding_format": "float"}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids[0])


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"input": "word " * 200}, "input[0] has 201 tokens; the limit is 127 (max_model_len "
         "128 less one)", "input"),
        ({"input": ["fine", ""]}, "input[1]: must not be empty", "input"),
        ({"input": []}, "input: must not be empty", "input"),
        ({"input": [[1, 2], [3, 99999]]}, "input[1]: prompt token id 99999 is outside the "
         "vocabulary [0, 49152)", "input"),
        ({"input": "x", "dimensions": 4096}, "dimensions: 4096 is more than the model's 576 "
         "dimensions", "dimensions"),
        ({"input": "x", "model": "gpt-4"}, "The model `gpt-4` does not exist (this server "
         "serves `smollm2`).", "model"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400s_naming_the_field_and_the_server_serves_on(
    server, body, message, param
):
    r = post(server, body)
    error = r.json()["error"]
    assert r.status_code in (400, 404) and (error["message"], error["param"]) == (message, param)
    ok = post(server, {"input": "Paris"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) > 0
    assert server.wait_until(lambda s: s.num_running == 0).num_running == 0


def test_grpc_embed_gives_the_http_embeddings(server, reference):
    from server.proto.jpaged.v1 import generation_pb2 as pb

    first, ids = reference[0][0], reference[1][0]  # INPUTS[0]'s token ids, INPUTS[1]'s
    request = pb.EmbedRequest(
        inputs=[pb.EmbedInput(text=INPUTS[0]), pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))],
        dimensions=64,
    )
    got = server.stub.Embed(request, timeout=120)
    # HTTP's answer to the same two inputs in one request (the same batch and programs)
    want = post(server, {"input": [first, ids], "dimensions": 64}).json()
    assert [list(e.values) for e in got.embeddings] == [d["embedding"] for d in want["data"]]
    assert got.prompt_tokens == want["usage"]["prompt_tokens"]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="word " * 200)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("input[0] has 201 tokens; the limit is 127 (max_model_len 128 "
                                   "less one)")  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Embed(pb.EmbedRequest())
    assert err.value.details() == "input: must not be empty"
