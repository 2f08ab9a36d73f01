"""SmolLM2-135M-Instruct's GGUF (Q4_1 + Q8_0) through jpaged equals transformers on the same file.

The strongest checks of GGUF loading: the tokenizer built from the metadata gives transformers'
ids and text, and greedy generation through the whole engine (paged cache, chunked batches,
more prompts than sequence slots) gives transformers' tokens, which only holds if every
dequantized weight, the Q/K un-permutation, the config and the tokenizer are right.
"""

from __future__ import annotations

import json

import pytest
import torch  # the reference runs transformers (tests/needs_torch.py reads this import)

from models.config import ModelConfig
from models.gguf import read_gguf_config
from models.loader import load_model

_PARAGRAPH = (
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. Photosynthesis in plants generally "
    "involves the green pigment chlorophyll and generates oxygen as a byproduct. The process "
    "takes place mainly in the leaves, inside small structures called chloroplasts. Light "
    "energy is absorbed and used to split water molecules, releasing oxygen, while the hydrogen "
    "is combined with carbon dioxide to build sugars. These sugars feed the plant and, through "
    "food chains, almost every other living thing on Earth. Scientists study photosynthesis to "
    "improve crop yields and to design artificial systems that could turn sunlight into fuel. "
    "Some bacteria perform a simpler version of the process without producing oxygen, and they "
    "were probably the first organisms on the planet to capture the energy of light. Over "
    "billions of years, their work filled the atmosphere with oxygen. In summary,"
)
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    (
        "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the boiling point",
    _PARAGRAPH,
    (
        'import numpy as np\n\n\ndef softmax(x: np.ndarray) -> np.ndarray:\n    """Numerically '
        'stable softmax over the last axis."""\n'
    ),
    "Translate to French: 'Good morning, how are you today?'\nFrench:",
]
NUM_NEW_TOKENS = 32

MIXED_TEXT = (
    "Hello, World! The year 2024 had 366 days; π ≈ 3.14159.\n"
    "def add(a: int, b: int) -> int:\n\treturn a + b  # tabs, spaces   and\r\nnewlines\n"
    "Café crème, naïve façade, Ångström, Straße, São Paulo, Ελληνικά, русский текст.\n"
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.\n"
    "Emoji: 🙂🚀👍🏽 and 👨‍👩‍👧 family. Symbols: ©®™ €£¥ ∑∫√ ←→ «quotes» “curly” — dash…\n"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|><|endoftext|>"
    "   leading and trailing spaces   "
)


def _greedy_reference(model, input_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping at EOS (jpaged's ignore_eos)."""
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), use_cache=True)
        tokens = []
        for _ in range(num_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens


def test_config_from_metadata(smollm2_gguf):
    cfg = read_gguf_config(smollm2_gguf)
    assert cfg == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=float.fromhex("0x1.4f8b58p-17"),  # 1e-5 as the file's float32
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf)


def test_tokenizer_matches_transformers(smollm2, hf_smollm2_tokenizer):
    loaded_tok = smollm2.tokenizer
    ours = loaded_tok.encode(MIXED_TEXT)
    theirs = hf_smollm2_tokenizer.encode(MIXED_TEXT)
    assert ours.ids == theirs
    assert len(ours.ids) > 150
    assert ours.ids[:3] == [19556, 28, 2260]  # "Hello", ",", " World": no BOS for SmolLM2
    for skip in (False, True):
        text = loaded_tok.decode(ours.ids, skip_special_tokens=skip)
        assert text == hf_smollm2_tokenizer.decode(theirs, skip_special_tokens=skip)
    assert loaded_tok.decode(ours.ids, skip_special_tokens=False) == MIXED_TEXT
    # Special tokens are single ids, marked special (dropped by skip_special_tokens).
    assert loaded_tok.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert "<|im_start|>" not in loaded_tok.decode(ours.ids, skip_special_tokens=True)


def test_loaded_model_chat_fields(smollm2, smollm2_gguf):
    loaded = smollm2
    assert loaded.path == smollm2_gguf
    assert loaded.eos_token_ids == (2,)
    assert (loaded.bos_token, loaded.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert loaded.chat_template.startswith("{% for message in messages %}")
    assert loaded.generation_defaults == {}


@pytest.fixture(scope="module")
def smol_llm(smollm2_gguf):
    """Four sequence slots and 512 tokens of context, shared by the tests below: the shapes of
    test_tool_calling's engine (tests/server/conftest.py smollm2_server), so every step
    program is one the suite's compilation cache already holds."""
    from jpaged import LLM

    return LLM(model=str(smollm2_gguf), max_num_seqs=4, max_model_len=512)


def test_greedy_tokens_equal_transformers(smol_llm, hf_smollm2_tokenizer, hf_smollm2_model):
    from jpaged import SamplingParams

    lengths = [len(hf_smollm2_tokenizer.encode(p)) for p in PROMPTS]
    assert min(lengths) == 1 and max(lengths) > 150 and len(PROMPTS) >= 8

    # Eight prompts through four sequence slots: batches form, finish and refill mid-run.
    llm = smol_llm
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    )
    expected = [
        _greedy_reference(hf_smollm2_model, hf_smollm2_tokenizer.encode(p), NUM_NEW_TOKENS)
        for p in PROMPTS
    ]
    got = [list(o.outputs[0].token_ids) for o in outputs]
    mismatched = [i for i in range(len(PROMPTS)) if got[i] != expected[i]]
    assert mismatched == [], [(i, got[i], expected[i]) for i in mismatched]
    assert outputs[1].outputs[0].text.startswith(" Paris.")


def test_chat_answers_the_capital_of_france(smol_llm, hf_smollm2_tokenizer):
    from jpaged import SamplingParams

    question = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    (out,) = smol_llm.chat(question, greedy)
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    # The prompt is transformers' rendering of the same conversation, tokenized the same way.
    want = hf_smollm2_tokenizer.apply_chat_template(
        question, add_generation_prompt=True, tokenize=False
    )
    assert out.prompt == want
    assert out.prompt_token_ids == hf_smollm2_tokenizer.encode(want, add_special_tokens=False)
    # Bad conversations and templates are one clear error each; the engine still serves.
    with pytest.raises(ValueError, match=r"messages\[0\]\.role: must be one of"):
        smol_llm.chat([{"role": "wizard", "content": "hi"}], greedy)
    with pytest.raises(ValueError, match="chat template error: no tools here"):
        smol_llm.chat(question, greedy, chat_template="{{ raise_exception('no tools here') }}")
    with pytest.raises(ValueError, match="conversation 1: messages: must be a non-empty list"):
        smol_llm.chat([question, []], greedy)
    (again,) = smol_llm.chat(question, greedy)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_json_extraction_gives_valid_json_with_the_prompts_values(smol_llm):
    """A JSON schema on the real model: the output parses, fits the schema, and its strings
    are the prompt's (the 135M model copies names and cities; its ages are not the prompt's,
    so only their type is checked)."""
    import jsonschema

    from jpaged import SamplingParams
    from jpaged.structured_output import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string"},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    texts = {
        ("Maria Lopez", "Madrid"): "Extract the person's name, age and city as JSON: "
        "Maria Lopez is 34 years old and lives in Madrid.",
        ("Tom Baker", "Boston"): "Extract name, age and city as JSON from this text: "
        "Last week Tom Baker, 52, moved to Boston.",
    }
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint)
    outs = smol_llm.chat([[{"role": "user", "content": t}] for t in texts.values()], params)
    for (name, city), out in zip(texts, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        value = json.loads(out.outputs[0].text)
        jsonschema.validate(value, schema)
        assert (value["name"], value["city"]) == (name, city)
