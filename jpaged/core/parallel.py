"""Engines over several devices: tensor parallel inside a replica, data parallel across them.

    make_engine(config) -> LLMEngine                   T x 1: one engine over a (1, kv, rep) mesh
                        -> DataParallelEngine          T x D: D engines behind one front

Data parallelism is D engine replicas, each with its own scheduler, page allocator and page
pool on its own T devices (row d of the ("data", "kv", "rep") mesh), behind one front with the
LLMEngine interface. The front sends each new request to the replica with the fewest
unfinished requests (a request naming a session to the replica its session's last request
went to, where its cached pages are: jpaged/core/session_pages.py) and steps every replica that has work. Weights are loaded once onto the
whole mesh (replicated over "data"); each replica's params are views of its devices' shards.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable

import jax

from jpaged.config import EngineConfig
from jpaged.core.engine import EngineStepError, LLMEngine
from jpaged.outputs import RequestOutput
from jpaged.sample.sampling_params import SamplingParams
from jpaged.worker.model_loading import load_for_config
from models import sharding

logger = logging.getLogger(__name__)

MAX_ROUTED_SESSIONS = 1 << 16  # sessions whose replica the front remembers (least recent go)


def make_engine(config: EngineConfig):
    """An LLMEngine, or a DataParallelEngine when data_parallel_size > 1."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine(config)
    return LLMEngine(config, loaded=load_for_config(config))


def _replica_params(params, mesh: jax.sharding.Mesh, index: int):
    """Views of params (sharded over the full mesh) as arrays on replica `index`'s devices."""
    sub = sharding.replica_mesh(mesh, index)
    devices = set(sub.devices.flat)

    def view(x: jax.Array) -> jax.Array:
        target = jax.sharding.NamedSharding(sub, x.sharding.spec)
        shards = [s.data for s in x.addressable_shards if s.device in devices]
        order = {d: i for i, d in enumerate(target.addressable_devices_indices_map(x.shape))}
        shards.sort(key=lambda a: order[next(iter(a.devices()))])
        return jax.make_array_from_single_device_arrays(x.shape, target, shards)

    return jax.tree_util.tree_map(view, params), sub


class DataParallelEngine:
    """D LLMEngine replicas behind the LLMEngine interface (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        if jax.process_count() > 1:
            raise ValueError("data_parallel_size > 1 is supported in one process only")
        loaded = load_for_config(config, data_parallel=True)
        self.config = config
        self.replicas: list[LLMEngine] = []
        for index in range(config.parallel.data_parallel_size):
            params, mesh = _replica_params(loaded.params, loaded.mesh, index)
            replica = dataclasses.replace(loaded, params=params, mesh=mesh)
            self.replicas.append(LLMEngine(config, loaded=replica))
        self._owner: dict[str, LLMEngine] = {}
        self._session_replica: collections.OrderedDict[str, LLMEngine] = collections.OrderedDict()
        first = self.replicas[0]
        self.config = first.config  # resolved (max_model_len ...)
        self.model_config = first.model_config
        self.tokenizer = first.tokenizer
        self.chat_template = first.chat_template
        self.model_name = first.model_name
        self.sampling_defaults = first.sampling_defaults
        self.default_pooling = first.default_pooling
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len = first.max_model_len
        self.load_seconds = sum(r.load_seconds for r in self.replicas)
        self.warmup_seconds = sum(r.warmup_seconds for r in self.replicas)

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        session: str | None = None,
        pooling=None,
        lora_request=None,
    ) -> None:
        """LLMEngine.add_request on the replica with the fewest unfinished requests, or on
        its session's (module docstring)."""
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = self._session_replica.get(session) if session is not None else None
        if replica is None:
            replica = min(self.replicas, key=lambda r: r.num_unfinished_requests())
        replica.add_request(
            request_id, prompt, params, cache_salt=cache_salt, pooling=pooling,
            lora_request=lora_request, session=session,
        )  # fmt: skip
        self._owner[request_id] = replica
        if session is not None:
            self._session_replica[session] = replica
            self._session_replica.move_to_end(session)
            if len(self._session_replica) > MAX_ROUTED_SESSIONS:
                self._session_replica.popitem(last=False)

    def tokenize_prompt(self, prompt):
        return self.replicas[0].tokenize_prompt(prompt)

    def chat_prompt(
        self,
        messages,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra,
    ) -> tuple[str, list[int]]:
        return self.replicas[0].chat_prompt(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            replica = self._owner.pop(rid, None)
            if replica is not None:
                replica.abort_request(rid)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work. A replica's EngineStepError is raised after
        the others stepped, carrying their outputs (error.outputs)."""
        outputs, error = [], None
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                try:
                    outputs += replica.step()
                except EngineStepError as e:
                    error = e
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        if error is not None:
            for rid in error.request_ids:
                self._owner.pop(rid, None)
            error.outputs = outputs
            raise error
        return outputs

    def warm_up(self, context_len: int = 64, *, up_to: int | None = None) -> float:
        return sum(r.warm_up(context_len, up_to=up_to) for r in self.replicas)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests() for r in self.replicas)

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    def num_running(self) -> int:
        return sum(r.num_running() for r in self.replicas)

    def stats(self) -> dict:
        """Counts summed over replicas (weight_bytes too: each replica holds the weights);
        num_buckets and what every replica shares (the KV dtype and its bytes per token, the
        quantization) are one replica's."""
        per = [r.stats() for r in self.replicas]
        shared = ("num_buckets", "kv_cache_dtype", "kv_bytes_per_token", "quantization")
        out = {k: per[0][k] if k in shared else sum(s[k] for s in per) for k in per[0]}
        if out.get("spec_num_drafts"):  # a mean, not a sum
            accepted, drafts = out["spec_num_accepted_tokens"], out["spec_num_drafts"]
            out["spec_mean_acceptance_length"] = 1.0 + accepted / drafts
        return out

    def reset_stats(self) -> None:
        for r in self.replicas:
            r.reset_stats()
