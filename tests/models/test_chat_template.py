"""Chat templates render exactly as transformers' apply_chat_template(..., tokenize=False).

Three templates: SmolLM2's (read from its GGUF), and a Llama-3-style and a Qwen-style one
written here after the public ones (Llama 3's writes bos_token itself and trims contents;
Qwen's has a default system prompt and a tools branch with tojson). Each is rendered for
conversations with and without a system message, several turns, with and without the
generation prompt, and with the final assistant message left open. Then the errors, the BOS
rule of prompt_token_ids, and how a Hugging Face directory's chat settings are read.
"""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from models.chat_template import (
    ChatTemplateError,
    prompt_token_ids,
    render_chat,
    validate_messages,
)
from models.gguf import GGUFFile
from models.loader import load_hf_model

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hi"}],
    "system_and_turns": [
        {"role": "system", "content": "  You answer in one short sentence.  "},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": 'And of Italy? Use "quotes" & <tags>, é 中文.'},
    ],
    "no_system_turns": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now backwards.\n"},
    ],
}
# Conversations ending in an assistant message to continue: one whose text ends in a space
# (kept by templates that copy the content, trimmed by Llama 3's `| trim`).
CONTINUED = {
    "open_answer": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "The color is"},
    ],
    "trailing_space": [
        {"role": "user", "content": "Start a list."},
        {"role": "assistant", "content": "1. Apples\n2. "},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "later" in a city, é',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf) -> str:
    return GGUFFile(smollm2_gguf).metadata["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoints):
    """A transformers tokenizer to call apply_chat_template on (the template is passed in)."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_checkpoints["llama"] / "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


def _templates(smollm2_template: str) -> dict[str, str]:
    return {"smollm2": smollm2_template, "llama3": LLAMA3_TEMPLATE, "qwen": QWEN_TEMPLATE}


def _ours(template: str, messages, **kwargs) -> str:
    return render_chat(
        template, messages, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", **kwargs
    )


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen"])
def test_renders_as_transformers(smollm2_template, hf_tokenizer, name):
    template = _templates(smollm2_template)[name]
    cases = [(c, {"add_generation_prompt": g}) for c in CONVERSATIONS for g in (False, True)]
    cases += [(c, {"continue_final_message": True}) for c in CONTINUED]
    conversations = {**CONVERSATIONS, **CONTINUED}
    for case, kwargs in cases:
        messages = conversations[case]
        expected = hf_tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **kwargs
        )
        assert _ours(template, messages, **kwargs) == expected, (case, kwargs)


def test_exact_prompts():
    """Two renderings spelled out, independent of transformers."""
    assert _ours(LLAMA3_TEMPLATE, CONVERSATIONS["one_user"], add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert _ours(QWEN_TEMPLATE, CONTINUED["trailing_space"], continue_final_message=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nStart a list.<|im_end|>\n"
        "<|im_start|>assistant\n1. Apples\n2. "
    )


def test_smollm2_template_default_system_prompt(smollm2_template):
    assert render_chat(smollm2_template, CONVERSATIONS["one_user"], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_and_tojson_as_transformers(hf_tokenizer):
    messages = CONVERSATIONS["system_and_turns"]
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=QWEN_TEMPLATE, tools=TOOLS, tokenize=False
    )
    ours = _ours(QWEN_TEMPLATE, messages, tools=TOOLS)
    assert ours == expected
    assert '"description": "Weather <now> & \\"later\\" in a city, é"' in ours  # not HTML-escaped


def test_list_content_is_joined():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [{"role": "user", "content": parts}]
    assert validate_messages(messages) == [{"role": "user", "content": "first\nsecond"}]
    assert messages[0]["content"] is parts  # the caller's messages are not changed
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>" in render_chat(QWEN_TEMPLATE, messages)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], r"messages: must be a non-empty list"),
        ("hello", r"messages: must be a non-empty list"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\.role: must be one of system, user, assistant, tool, got 'robot'",
        ),
        ([{"content": "a"}], r"messages\[0\]\.role: must be one of .*, got None"),
        ([{"role": "user"}], r"messages\[0\]\.content: missing"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            r"messages\[0\]\.content\[0\]: must be \{'type': 'text', 'text': \.\.\.\}",
        ),
        (["hi"], r"messages\[0\]: must be an object with 'role' and 'content'"),
    ],
)
def test_invalid_messages(messages, message):
    with pytest.raises(ValueError, match=message):
        render_chat(QWEN_TEMPLATE, messages)


def test_template_that_raises_names_the_message_it_was_reading():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(LLAMA3_TEMPLATE, messages)
    assert str(info.value) == (
        "messages[1]: chat template error: Conversation roles must alternate "
        "user/assistant/user/assistant/..."
    )
    assert (info.value.message_index, isinstance(info.value, ValueError)) == (1, True)


@pytest.mark.parametrize(
    ("template", "message", "index"),
    [
        # A Python error inside the template's expressions: its type, words and line.
        (
            "{% for m in messages %}\n{{ m.content + m.count }}{% endfor %}",
            ('messages[1]: chat template error: TypeError: can only concatenate str (not "int") '
            "to str (template line 2)"),
            1,
        ),
        (
            "{{ 1 // (messages | length - 2) }}",
            ("chat template error: ZeroDivisionError: integer division or modulo by zero "
            "(template line 1)"),
            None,
        ),
        (
            "{{ messages[0].content }}{{ messages[1].nope.deeper }}",
            "messages[1]: chat template error: 'dict object' has no attribute 'nope'",
            1,
        ),
    ],
)
def test_any_template_exception_is_a_chat_template_error(template, message, index):
    messages = [{"role": "user", "content": "a", "count": "1"}, {"role": "assistant",
                "content": "b", "count": 2}]  # fmt: skip
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, messages)
    assert (str(info.value), info.value.message_index) == (message, index)


# The turn after a tool call, as agent frameworks send it: the assistant message that made
# the call has "content": null (the openai client) or no content at all (others).
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C."},
    {"role": "user", "content": "And in Rome?"},
    {"role": "assistant", "tool_calls": [{"id": "call_2", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]  # fmt: skip


def test_null_and_missing_assistant_content_render_as_empty(smollm2_template):
    """SmolLM2's own template concatenates message['content']: a tool-calling turn renders
    as an empty assistant turn instead of a TypeError."""
    text = render_chat(smollm2_template, TOOL_TURN, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n21 C<|im_end|>\n"
        "<|im_start|>assistant\nIt is 21 C.<|im_end|>\n<|im_start|>user\nAnd in Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n25 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    checked = validate_messages(TOOL_TURN)
    assert [m["content"] for m in checked] == ["Weather in Paris?", "", "21 C", "It is 21 C.",
                                               "And in Rome?", "", "25 C"]  # fmt: skip
    assert checked[5]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert "content" not in TOOL_TURN[5]  # the caller's messages are not changed


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }", r"chat template error: line 1: unexpected '}'"),
        ("{{ messages[0].content.nope() }}", r"chat template error: 'str object' has no attribute"),
        # The sandbox is immutable: a template cannot change the caller's messages.
        ("{{ messages.pop() }}", r"chat template error: access to attribute 'pop' of 'list'"),
    ],
)
def test_broken_templates(template, message):
    with pytest.raises(ValueError, match=message):
        render_chat(template, CONVERSATIONS["one_user"])


def test_continue_needs_a_final_message_the_template_writes():
    with pytest.raises(ValueError, match="cannot both be set"):
        render_chat(
            QWEN_TEMPLATE,
            CONTINUED["open_answer"],
            add_generation_prompt=True,
            continue_final_message=True,
        )
    with pytest.raises(ValueError, match="does not write the final message's content"):
        render_chat("{{ 'fixed text' }}", CONTINUED["open_answer"], continue_final_message=True)


def test_strftime_now():
    import datetime

    year = datetime.date.today().year
    assert render_chat("{{ strftime_now('%Y') }}", CONVERSATIONS["one_user"]) in {
        str(year),
        str(year + 1),
    }


# --- BOS exactly once -------------------------------------------------------------------------


def test_prompt_token_ids_adds_bos_once(tiny_checkpoints):
    tokenizer = load_hf_model(tiny_checkpoints["llama"]).tokenizer  # adds <s> (id 0)
    with_bos = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    without_bos = "{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "the pages"}]
    body = tokenizer.encode("the pages", add_special_tokens=False).ids
    for template in (with_bos, without_bos):
        text = render_chat(template, messages, bos_token="<s>")
        assert prompt_token_ids(tokenizer, text, "<s>") == [0, *body], template
    # Without a BOS text the tokenizer's default applies.
    assert prompt_token_ids(tokenizer, "the pages", None) == [0, *body]


# --- a Hugging Face directory's chat settings ---------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path, tiny_checkpoints):
    path = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    return path


def test_hf_dir_without_chat_files(llama_dir):
    loaded = load_hf_model(llama_dir)
    assert loaded.chat_template is None
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")  # the tokenizer's texts
    assert loaded.generation_defaults == {}


def test_hf_dir_chat_template_and_tokens(llama_dir):
    (llama_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": QWEN_TEMPLATE,
                "bos_token": {"__type": "AddedToken", "content": "<|begin|>"},
                "eos_token": "<|end|>",
            }
        )
    )
    (llama_dir / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [1, 7],
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "min_p": None,
                "repetition_penalty": 1.05,
                "max_new_tokens": 99,
            }
        )
    )
    loaded = load_hf_model(llama_dir)
    assert loaded.chat_template == QWEN_TEMPLATE
    assert (loaded.bos_token, loaded.eos_token) == ("<|begin|>", "<|end|>")
    assert loaded.eos_token_ids == (1, 7)
    assert loaded.generation_defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    # chat_template.jinja takes precedence over tokenizer_config.json's template.
    (llama_dir / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    assert load_hf_model(llama_dir).chat_template == LLAMA3_TEMPLATE


def test_hf_dir_named_templates(llama_dir):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (llama_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_hf_model(llama_dir).chat_template == "D"
    (llama_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: field 'chat_template' must be"):
        load_hf_model(llama_dir)


def test_orbax_conversion_keeps_chat_settings(llama_dir, tmp_path):
    from models.loader import load_model
    from models.orbax_checkpoint import convert_hf_to_orbax

    (llama_dir / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    (llama_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    (llama_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1], "temperature": 0.3})
    )
    out = convert_hf_to_orbax(llama_dir, tmp_path / "orbax", dtype="float32")
    loaded = load_model(out)
    assert (out / "params").is_dir()
    assert loaded.chat_template == QWEN_TEMPLATE
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "<|end|>")
    assert loaded.generation_defaults == {"temperature": 0.3}
