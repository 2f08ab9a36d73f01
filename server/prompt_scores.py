"""A completion with echo and max_tokens 0: its prompt, scored, and no new token.

Legacy clients (HELM, lm-evaluation-harness' loglikelihood over old APIs) ask for a prompt's
log-likelihoods this way. The engine samples at least one token, so the request runs with
max_tokens 1 (openai_protocol.to_sampling_params) and PromptScores, an Assembler, leaves
that token out of everything the client sees: the text is the echoed prompt, logprobs (when
asked) cover the prompt's tokens only (the first one's null, as OpenAI's), token_ids are
empty, usage counts no completion tokens, finish_reason is "length".
"""

from __future__ import annotations

from server.openai_responses import Assembler, Delta


class PromptScores(Assembler):
    """An Assembler whose choices carry their echo and nothing of their one sampled token."""

    def __init__(self, *args, echo_texts: list[str | None] | None = None, **kwargs) -> None:
        super().__init__(*args, echo_texts=echo_texts, **kwargs)
        n = len(self.handles[0].choices)
        echo_texts = echo_texts or [None] * len(self.handles)
        # choice index -> its echo, until the delta carrying it has been taken
        self._echo = {i * n + j: echo_texts[i] or "" for i in range(len(self.handles))
                      for j in range(n)}  # fmt: skip

    def take(self) -> list[Delta]:
        deltas = super().take()
        for d in deltas:
            echo = self._echo.pop(d.index, None)
            # the delta that carries the echo starts with it; what follows is the token's
            d.text = d.text[: len(echo)] if echo is not None else ""
            d.token_ids, d.logprobs = [], []
        return deltas

    def usage(self) -> dict:
        usage = super().usage()
        usage["total_tokens"] = usage["prompt_tokens"]
        usage["completion_tokens"] = 0
        return usage
