"""How one OpenAI request's prompt becomes token ids and its max_tokens (the third check of
server/openai_protocol.py's list): PromptPlan, the renderers of a completion's prompt and a
chat's conversation, and fit_max_tokens (prompt + max_tokens against max_model_len).

A chat is rendered and tokenized in a worker thread before the request is submitted
(PromptPlan.render_now), so a conversation its template cannot render is a 400 naming the
message and never reaches the engine thread; a text prompt is tokenized on the engine
thread, in PromptPlan.prepare, which also fits max_tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jpaged.sample.sampling_params import SamplingParams
from models.chat_template import ChatTemplateError
from server.openai_protocol import APIError, invalid

if TYPE_CHECKING:
    from server.openai_protocol import ChatCompletionRequest, TokenizeChatRequest
    from server.tool_prompts import ToolPrompt


class PromptPlan:
    """How one prompt becomes token ids and its max_tokens.

    render(engine) -> (prompt text, token ids) (tokenizing text, rendering a chat);
    render_now(engine) runs it in the calling thread ahead of submission (a chat, from a
    worker thread), else prepare(engine), EngineLoop.submit's `prepare` on the engine
    thread, runs it there. `prompt_text` is the prompt's text once rendered (for echo).
    """

    def __init__(
        self,
        render,
        params: SamplingParams,
        *,
        default_max_tokens: int | None,
        where: str,
        max_tokens_field: str,
    ) -> None:
        self._render = render
        self.params = params
        self.default_max_tokens = default_max_tokens
        self.where = where  # "prompt" or "messages", as OpenAI names them in errors
        self.max_tokens_field = max_tokens_field
        self.prompt_text: str | None = None
        self._ids: list[int] | None = None

    def render_now(self, engine) -> None:
        """Renders the prompt here (only reading the engine's tokenizer and template, which
        are safe to share between threads); raises render's APIError."""
        self.prompt_text, self._ids = self._render(engine)

    def prepare(self, engine) -> tuple[list[int], SamplingParams]:
        if self._ids is None:
            self.render_now(engine)
        ids = self._ids
        max_tokens = fit_max_tokens(
            len(ids),
            self.params.max_tokens,
            self.default_max_tokens,
            int(engine.max_model_len),
            where=self.where,
        )
        try:
            params = self.params.clone(max_tokens=max_tokens)
        except ValueError as e:  # min_tokens above what fits
            raise invalid(str(e), {"max_tokens": self.max_tokens_field}) from None
        return ids, params


def completion_renderer(prompt: str | list[int], *, echo: bool):
    """Text prompts are tokenized; token-id prompts checked (and decoded when echoed)."""

    def render(engine) -> tuple[str | None, list[int]]:
        vocab = int(engine.model_config.vocab_size)
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise APIError(
                    400, "the model has no tokenizer: send the prompt as token ids", param="prompt"
                )
            return prompt, list(engine.tokenizer.encode(prompt))
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise APIError(
                    400,
                    f"prompt token id {t} (at {i}) is out of range [0, {vocab})",
                    param="prompt",
                )
        text = None
        if echo and engine.tokenizer is not None:
            text = engine.tokenizer.decode(prompt)
        return text, list(prompt)

    return render


def chat_renderer(
    req: ChatCompletionRequest | TokenizeChatRequest,
    server_template: str | None,
    tools: list[dict] | None = None,
    prompt: ToolPrompt | None = None,
):
    """render(engine) -> (prompt text, token ids) of the request's conversation.

    tools: the chat template's `tools` variable (set when the request gives tools); prompt:
    what the conversation gets for its template (ToolPlan.prompt: tools, past calls and
    results the template does not render; None: nothing). render raises APIError(400) for
    a conversation that cannot be rendered, naming the client's message where the template
    was reading one (messages[i]) and quoting the template's own words.
    """
    messages = [m.to_dict() for m in req.messages]
    template = req.chat_template or server_template
    extra = dict(req.chat_template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools

    def render(engine) -> tuple[str, list[int]]:
        origins: list[int | None] = list(range(len(messages)))
        try:
            chat = messages
            if prompt is not None:
                chat, origins = prompt.messages(messages)
            text, ids = engine.chat_prompt(
                chat,
                chat_template=template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **extra,
            )
        except ChatTemplateError as e:
            i = None if e.message_index is None else origins[e.message_index]
            where = "messages" if i is None else f"messages[{i}]"
            raise APIError(400, f"{where}: chat template error: {e.detail}", param=where) from None
        except ValueError as e:  # a malformed conversation, no template, no tokenizer
            raise invalid(str(e)) from None
        return text, list(ids)

    return render


def fit_max_tokens(
    num_prompt: int, max_tokens: int | None, default: int | None, max_model_len: int, *, where: str
) -> int:
    """max_tokens for a prompt of num_prompt tokens, or APIError context_length_exceeded."""
    room = max_model_len - num_prompt
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {where}, "
            f"{max_tokens} in the completion). Please reduce the length of the {where} or "
            "completion.",
            param=where,
            code="context_length_exceeded",
        )
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{where} has {num_prompt} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the {where}.",
            param=where,
            code="context_length_exceeded",
        )
    if max_tokens is not None:
        return max_tokens
    return room if default is None else min(default, room)
