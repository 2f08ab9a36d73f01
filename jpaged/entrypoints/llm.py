"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from jpaged.core.beam_search import BeamSearchOutput, beam_search
from jpaged.core.parallel import make_engine
from jpaged.entrypoints.engine_args import engine_config_from_args
from jpaged.lora import LoRARequest
from jpaged.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jpaged.pooling import PoolingParams
from jpaged.sample.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Offline batched generation. Keyword arguments are the engine settings of
    jpaged/config.py (jpaged.entrypoints.engine_args.ENGINE_ARGS); an unknown one is a TypeError naming
    the closest valid one."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        # An LLMEngine, or data-parallel replicas behind the same interface.
        self.llm_engine = make_engine(engine_config_from_args(model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own sampling defaults (its generation config),
        what generate and chat use when given no sampling params."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def reset_stats(self) -> None:
        self.llm_engine.reset_stats()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in prompt order.

        All prompts are validated before any is queued: a bad one raises ValueError (naming
        its index) and nothing is submitted. lora_request: the LoRA adapter every prompt
        runs on, or one per prompt (None: the base model); needs enable_lora=True. A bad
        adapter raises LoRAError (a ValueError naming it) before anything is queued.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [sampling_params]
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                where = f" (item {i})" if len(params) > 1 else ""
                raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                    f"sampling_params must be a SamplingParams or a list of them, got "
                    f"{type(sp).__name__}{where}: {sp!r:.80}"
                )
        engine = self.llm_engine
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            try:
                _, ids = engine.tokenize_prompt(p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            if sp.max_tokens is not None and len(ids) + sp.max_tokens > engine.max_model_len:
                logger.warning(
                    "prompt %d: %d prompt tokens + max_tokens %d exceed max_model_len %d; "
                    "its output stops at %d tokens with finish_reason 'length'",
                    i,
                    len(ids),
                    sp.max_tokens,
                    engine.max_model_len,
                    engine.max_model_len - len(ids),
                )
        loras = self._lora_requests(lora_request, len(prompts))
        ids = []
        for p, sp, lora in zip(prompts, params, loras, strict=True):
            rid = f"offline-{next(self._ids)}"
            kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(rid, p, sp.clone(output_kind=kind), lora_request=lora)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _lora_requests(self, lora_request, n: int) -> list:
        """One LoRARequest (or None) per prompt, each adapter read and checked now."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
        managers = getattr(self.llm_engine, "replicas", [self.llm_engine])
        for lora in dict.fromkeys(x for x in loras if x is not None):
            for engine in managers:
                if engine.loras is None:
                    raise ValueError("lora_request given but LoRA is not enabled (enable_lora)")
                engine.loras.resolve(lora)
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks an adapter now (vLLM's LLM.add_lora); True when it is ready."""
        self._lora_requests(lora_request, 1)
        return True

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = False,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Generates a reply to each conversation (vLLM's signature): messages is one
        conversation (a list of {"role", "content"}) or a list of them, rendered with the
        model's chat template (or chat_template) with BOS once. Returns one RequestOutput
        per conversation, its prompt the rendered text.

        tools: OpenAI's tool definitions ({"type": "function", "function": {"name",
        "description", "parameters"}}), the template's `tools` variable. Assistant messages
        may carry tool_calls (arguments as JSON text or objects) and tool messages the
        results. The reply is text as the model wrote it: to decode a call whose arguments
        follow a tool's schema, pass StructuredOutputsParams(json=that schema).

        Raises ValueError for a malformed conversation (naming the message and field), a
        template that raises, or a model without a chat template when none is given.
        """
        conversations = messages
        if not messages or isinstance(messages[0], dict):
            conversations = [messages]
        rendered = []
        for i, conversation in enumerate(conversations):
            try:
                rendered.append(
                    self.llm_engine.chat_prompt(
                        conversation,
                        chat_template=chat_template,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        **({"tools": tools} if tools is not None else {}),
                        **template_kwargs,
                    )
                )
            except ValueError as e:
                where = f"conversation {i}: " if len(conversations) > 1 else ""
                raise ValueError(f"{where}{e}") from None
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm=use_tqdm)
        for out, (text, _) in zip(outs, rendered, strict=True):
            out.prompt = text
        return outs

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (jpaged/pooling.py; default: the model's
        sentence-transformers pooling, else the last token's hidden state, normalised),
        batched through the engine like generation; returns them in prompt order. A bad
        prompt raises ValueError naming its index and nothing is submitted."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        engine = self.llm_engine
        pooling = engine.default_pooling if pooling_params is None else pooling_params
        if not isinstance(pooling, PoolingParams):
            raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                f"pooling_params must be a PoolingParams, got {type(pooling).__name__}"
            )
        for i, p in enumerate(prompts):
            try:
                engine.tokenize_prompt(p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        one = SamplingParams(
            max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        ids = []
        for p in prompts:
            rid = f"embed-{next(self._ids)}"
            engine.add_request(rid, p, one, pooling=pooling)
            ids.append(rid)
        outs = self._run(ids, use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
            for o in outs
        ]

    def beam_search(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (transformers' semantics, see jpaged.core.beam_search);
        returns one BeamSearchOutput per prompt, in prompt order, beams best first."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        return beam_search(self.llm_engine, prompts, params, ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
