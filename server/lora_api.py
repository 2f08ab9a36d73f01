"""LoRA adapters over HTTP (vLLM's endpoints): the served adapters by name, loaded at start
(--lora-modules name=path ...) or at run time, and the OpenAI `model` field resolved to one.

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}   200, or 400 / 409
    POST /v1/unload_lora_adapter  {"lora_name": ...}                     200, or 404 / 409
    GET /v1/models                the base model, then each adapter (parent: the base)

A request whose `model` names an adapter runs on it; the base model's name (or no model)
runs on the base; any other name is a 404 with code model_not_found. An adapter is read and
checked in a worker thread, then handed to the engine thread (LoRAManager.add); a bad one is a
400 naming it and the problem, and nothing is registered. Unloading an adapter that a request
still uses is refused (409, "in use"): the client retries once its requests finish; nothing
waits on the server.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pydantic
from fastapi import APIRouter

from jpaged.lora import LoRAError, LoRARequest, load_adapter
from server.openai_protocol import APIError


class LoadLoRARequest(pydantic.BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(pydantic.BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _managers(engine) -> list:
    """Each replica's LoRAManager (empty: LoRA is off)."""
    engines = getattr(engine, "replicas", [engine])
    return [e.loras for e in engines if getattr(e, "loras", None) is not None]


class LoRAAdapters:
    """The server's adapters by name (owned here, on the event loop's thread; the engine's
    LoRAManagers hold the weights)."""

    def __init__(self, loop, *, base_name: str) -> None:
        self._loop = loop
        self._base = base_name
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._created: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return bool(_managers(self._loop.engine))

    def load_now(self, name: str, path: str) -> None:
        """Registers an adapter before the engine thread starts (--lora-modules); raises
        ValueError naming it."""
        if not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        request = self._new_request(name, path)
        for manager in _managers(self._loop.engine):
            manager.add(request)
        self._register(request)

    def find(self, name: str) -> LoRARequest | None:
        """The adapter served under name, or None."""
        return self._adapters.get(name)

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; APIError 404 otherwise."""
        if model is None or model == self._base:
            return None
        request = self._adapters.get(model)
        if request is None:
            served = ", ".join([f"`{self._base}`", *(f"`{n}`" for n in self._adapters)])
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves {served}).",
                param="model",
                code="model_not_found",
            )
        return request

    def cards(self, max_model_len: int) -> list[dict]:
        return [
            {"id": name, "object": "model", "created": self._created[name], "owned_by": "jpaged",
             "root": req.lora_path, "parent": self._base, "max_model_len": max_model_len}
            for name, req in self._adapters.items()
        ]  # fmt: skip

    def add_routes(self, router: APIRouter) -> None:
        router.add_api_route("/load_lora_adapter", self.load, methods=["POST"])
        router.add_api_route("/unload_lora_adapter", self.unload, methods=["POST"])

    async def load(self, body: LoadLoRARequest) -> dict:
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
        name = body.lora_name
        if name == self._base or name in self._adapters:
            raise APIError(400, f"LoRA adapter {name!r}: an adapter of that name is already loaded",
                           param="lora_name")  # fmt: skip
        request = self._new_request(name, body.lora_path)
        engine = self._loop.engine
        manager = _managers(engine)[0]
        try:  # read and checked off the engine thread
            adapter = await asyncio.to_thread(
                load_adapter, request, manager.model_config, manager.config.max_lora_rank
            )
            await self._loop.call(lambda e: [m.add(request, adapter) for m in _managers(e)])
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        self._register(request)
        return {"status": "ok", "message": f"LoRA adapter {name!r} loaded"}

    async def unload(self, body: UnloadLoRARequest) -> dict:
        name = body.lora_name
        if name not in self._adapters:
            raise APIError(404, f"LoRA adapter {name!r}: no adapter of that name is loaded",
                           param="lora_name", code="model_not_found")  # fmt: skip
        try:
            await self._loop.call(lambda e: [m.remove(name) for m in _managers(e)])
        except LoRAError as e:
            raise APIError(409, str(e), param="lora_name") from None
        del self._adapters[name]
        del self._created[name]
        return {"status": "ok", "message": f"LoRA adapter {name!r} unloaded"}

    def _new_request(self, name: str, path: str) -> LoRARequest:
        try:
            return LoRARequest(name, next(self._ids), path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None

    def _register(self, request: LoRARequest) -> None:
        self._adapters[request.lora_name] = request
        self._created[request.lora_name] = int(time.time())
