"""InputProcessor: a request's prompt and parameters checked and tokenized before it is queued.

The entry points (LLM, the server, beam search) reach it through the engine's
tokenize_prompt / chat_prompt / add_request; everything here is a pure function of the request
and the model's fixed facts (tokenizer, vocabulary, max_model_len, chat template), so a bad
request is refused with a ValueError naming the field before anything about it is stored.
The checks that need live state (a request id in use, the scheduler's room, the compiled
programs' cap) are handed in by the engine.

Invariants: a prompt that passes is a non-empty list of in-vocabulary ids shorter than
max_model_len; a chat prompt's ids carry the BOS token once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jpaged.pooling import Pooler, PoolingParams
from jpaged.sample.sampling_params import SamplingParams
from jpaged.tokenizer import Tokenizer


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int,
        hidden_size: int,
        max_model_len: int,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    def validate(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None,
        pooling: PoolingParams | None,
        in_use: bool,
        unservable: Callable[[int, int], str | None],
        refusal_at_cap: Callable[..., str | None],
        session: str | None = None,
    ) -> tuple[str | None, list[int], Pooler | None]:
        """Checks a request -> (prompt text or None, token ids, an embedding request's
        Pooler or None). in_use: request_id names a request in the engine; unservable and
        refusal_at_cap: the scheduler's and the runner's refusals (None: it fits).

        Raises ValueError naming what is wrong."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        text, token_ids = self.tokenize_prompt(prompt)
        unservable = unservable(len(token_ids), params.n)
        if unservable is not None:  # no preemption could ever make room for it
            raise ValueError(unservable)
        pooler = None
        if pooling is not None:
            if params.max_tokens != 1 or params.n != 1:
                raise ValueError(
                    "an embedding request's sampling params must have max_tokens=1 and n=1"
                )
            pooler = Pooler(pooling, len(token_ids), self.hidden_size)
        at_cap = refusal_at_cap(params, len(token_ids), pooling=pooler is not None)
        if at_cap is not None:  # its program cannot be compiled: only this request fails
            raise ValueError(at_cap)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if session is not None and (not isinstance(session, str) or not session):
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        vocab = self.vocab_size
        bad = [t for t in (params.logit_bias or ()) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return text, token_ids, pooler

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validates a prompt (text or token ids) -> (text or None, token ids).

        Raises ValueError naming what is wrong: empty, not text nor ids, ids outside the
        vocabulary, or too long for max_model_len.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the model has no tokenizer; pass token ids "
                    "(--prompt-token-ids on the command line)"
                )
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
                raise ValueError("prompt token ids must be integers")
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for one generated token"
            )
        return text, ids

    def chat_prompt(
        self,
        messages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> tuple[str, list[int]]:
        """A conversation rendered with the model's chat template (or chat_template) ->
        (prompt text, token ids with BOS once). Raises ValueError for a bad conversation, a
        template error, or a model without a template."""
        from models.chat_template import prompt_token_ids, render_chat

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "the model has no chat template; pass one (chat_template=..., --chat-template FILE)"
            )
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model has none")
        text = render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        return text, prompt_token_ids(self.tokenizer.backend, text, self.bos_token)
