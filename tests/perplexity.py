"""Perplexity of a model on a fixed English text, for the quantization tests (issue 29).

The text is prose from the Python Language Reference shipped with every CPython
(pydoc_data.topics): the paragraphs of a fixed list of topics, grammar and code blocks
(indented lines) dropped. A test tokenizes it and keeps a fixed number of tokens, then
compares perplexities of engines that differ only in a quantization setting, in the same
run (the text differs a little between Python versions; the ratio is what tests assert).

Also the twelve real prompts whose greedy continuations the quantized engines are compared on.
"""

from __future__ import annotations

import math

from jpaged.sample.sampling_params import SamplingParams

_TOPICS = (
    "if", "while", "for", "try", "with", "function", "class", "assignment", "import",
    "exceptions", "naming",
)  # fmt: skip

REAL_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    (
        "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the boiling point",
    "Translate to French: 'Good morning, how are you today?'\nFrench:",
    "Once upon a time, in a small village at the edge of a forest, there lived",
    "The three primary colors are",
    "import json\n\nwith open('data.json') as f:\n",
    "Q: What is 12 plus 30?\nA:",
    "The most important invention of the twentieth century was",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def english_text() -> str:
    """About 7,000 words of English prose from the Language Reference (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in _TOPICS:
        for para in topics[key].split("\n\n"):
            lines = para.strip("\n").splitlines()
            if not lines or lines[0].startswith(" ") or set(lines[-1]) <= set("*=-"):
                continue  # a grammar or code block, or a heading's underline
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def english_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first num_tokens ids of english_text() under tokenizer (a jpaged or HF tokenizer)."""
    ids = list(tokenizer.encode(english_text()))
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {num_tokens} asked")
    return ids[:num_tokens]


def perplexity(llm, token_ids: list[int]) -> tuple[float, list[int]]:
    """(exp of the mean negative log-likelihood of token_ids[1:] given the tokens before, the
    most likely token at each of those positions), from the engine's prompt_logprobs (one
    prefill of the whole text)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (out,) = llm.generate([token_ids], params)
    lps = out.prompt_logprobs
    assert lps[0] is None and len(lps) == len(token_ids)
    nll = -sum(lp[tok] for lp, tok in zip(lps[1:], token_ids[1:], strict=True))
    argmax = [max(lp, key=lp.__getitem__) for lp in lps[1:]]
    return math.exp(nll / (len(token_ids) - 1)), argmax
