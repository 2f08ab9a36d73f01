"""LoRAManager: which adapters are known, which are in host memory, which sit in which device
slot, and which requests hold each slot.

Owner of the adapters' host state; the engine and the scheduler reach it through a few calls:

    adapter = loras.resolve(lora_request)     # add_request: read (or found in host memory)
    loras.attach(group, adapter)              # the request uses it until released
    loras.admit(group) -> bool                # scheduler admission: a slot, or wait
    loras.take_loads() -> ((slot, adapter),)  # the plan carries them; the runner writes them
    loras.release(group)                      # a finished or aborted request

Invariants: a slot held by an admitted request (its group.lora_slot) keeps its adapter until
every such request is released (admit evicts only unheld slots, least recently used first);
a slot's load is in the plan of the step that first admits a request onto it, so the device
writes it before any row reads it (device order). Requests that find every slot held by
other adapters wait in the queue (admit says no) while base-model requests pass them.
Host memory keeps up to num_cpu_loras adapters, least recently used dropped first (a waiting
request keeps its own reference). An adapter in use by a request is never unloaded: `remove`
refuses (documented in docs/lora.md).
"""

from __future__ import annotations

import collections

from jpaged.config import LoRAConfig
from jpaged.lora.adapter import HostAdapter, LoRAError, load_adapter
from jpaged.lora.request import LoRARequest
from models.config import ModelConfig


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.num_slots = config.max_loras
        self._host: collections.OrderedDict[str, HostAdapter] = collections.OrderedDict()
        self.registered: dict[str, LoRARequest] = {}  # the server's named adapters
        self._slot_adapter: list[HostAdapter | None] = [None] * self.num_slots
        self._holders: list[set[str]] = [set() for _ in range(self.num_slots)]  # request ids
        self._slot_order: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(self.num_slots)
        )  # least recently admitted first
        self._users: collections.Counter[str] = collections.Counter()  # name -> requests
        self._pending: dict[int, HostAdapter] = {}  # slot -> adapter to write before the step
        self.num_loads = 0  # adapters read from disk
        self.num_slot_writes = 0

    # -- adapters ----------------------------------------------------------------------------
    def resolve(self, request: LoRARequest) -> HostAdapter:
        """The adapter of request, from host memory or read now (LoRAError if bad)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(  # noqa: TRY004 - ValueError for every bad field (the API)
                f"lora_request must be a LoRARequest, got {type(request).__name__}"
            )
        adapter = self._host.get(request.lora_name)
        if adapter is not None and adapter.request == request:
            self._host.move_to_end(request.lora_name)
            return adapter
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
        self.num_loads += 1
        self._host[request.lora_name] = adapter
        while len(self._host) > self.config.num_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def add(self, request: LoRARequest, adapter: HostAdapter | None = None) -> HostAdapter:
        """Registers a named adapter (the server's --lora-modules and load endpoint): read
        and checked now (or adapter, read already by load_adapter); a name already
        registered is an error."""
        if request.lora_name in self.registered:
            raise LoRAError(request.lora_name, "an adapter of that name is already loaded")
        if adapter is None:
            adapter = self.resolve(request)
        else:
            self._host[request.lora_name] = adapter
            self._host.move_to_end(request.lora_name)
            while len(self._host) > self.config.num_cpu_loras:
                self._host.popitem(last=False)
        self.registered[request.lora_name] = request
        return adapter

    def remove(self, name: str) -> None:
        """Unregisters a named adapter and drops it from host memory and its slot. Refused
        (LoRAError) while a request uses it."""
        if name not in self.registered:
            raise LoRAError(name, "no adapter of that name is loaded")
        if self._users[name]:
            n = self._users[name]
            raise LoRAError(name, f"in use by {n} request(s); unload it when they finish")
        del self.registered[name]
        self._host.pop(name, None)
        for slot, resident in enumerate(self._slot_adapter):
            if resident is not None and resident.name == name:
                self._slot_adapter[slot] = None
                self._pending.pop(slot, None)

    # -- requests ----------------------------------------------------------------------------
    def attach(self, group, adapter: HostAdapter) -> None:
        """group (a RequestGroup) runs on adapter until `release`."""
        group.lora = adapter
        group.lora_slot = -1
        self._users[adapter.name] += 1

    def admit(self, group) -> bool:
        """Whether group's adapter has a device slot for it now (True for the base model and
        for a group already holding one); puts it in one (the least recently admitted slot
        no request holds) when it can, else False: the request waits."""
        adapter = group.lora
        if adapter is None or group.lora_slot >= 0:
            return True
        slot = next((s for s, a in enumerate(self._slot_adapter) if a is adapter), None)
        if slot is None:
            slot = next((s for s in self._slot_order if not self._holders[s]), None)
            if slot is None:
                return False
            self._slot_adapter[slot] = adapter
            self._pending[slot] = adapter
        self._holders[slot].add(group.request_id)
        self._slot_order.move_to_end(slot)
        group.lora_slot = slot
        return True

    def release(self, group) -> None:
        """A finished or aborted request lets go of its slot and its adapter."""
        adapter = getattr(group, "lora", None)
        if adapter is None:
            return
        if group.lora_slot >= 0:
            self._holders[group.lora_slot].discard(group.request_id)
        group.lora_slot = -1
        group.lora = None
        self._users[adapter.name] -= 1
        if not self._users[adapter.name]:
            del self._users[adapter.name]

    def take_loads(self) -> tuple[tuple[int, HostAdapter], ...]:
        """The slot writes the next step must make first (each once)."""
        loads, self._pending = tuple(self._pending.items()), {}
        self.num_slot_writes += len(loads)
        return loads

    def restart(self) -> None:
        """After a failed step (whose slot writes may not have happened): held slots are
        written again before the next step, unheld ones are emptied."""
        for slot in range(self.num_slots):
            if self._holders[slot]:
                self._pending[slot] = self._slot_adapter[slot]
            else:
                self._slot_adapter[slot] = None

    @staticmethod
    def salt(cache_salt: str | None, adapter: HostAdapter | None) -> str | None:
        """The prefix cache's salt of a request on adapter: no page is shared across
        adapters (by the digest of its files, so also not through the KV disk tier, across
        processes)."""
        if adapter is None:
            return cache_salt
        return f"{cache_salt or ''}\x00lora:{adapter.digest}"

    def stats(self) -> dict:
        return {
            "lora_slots_used": sum(a is not None for a in self._slot_adapter),
            "lora_host_adapters": len(self._host),
            "lora_loads": self.num_loads,
            "lora_slot_writes": self.num_slot_writes,
        }
