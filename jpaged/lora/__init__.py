"""LoRA adapters on the host: requests name them (LoRARequest), adapter.py reads and checks
PEFT files, slots.py decides which adapter sits in which device slot (models/lora.py holds
the device math)."""

from jpaged.lora.adapter import HostAdapter, LoRAError, load_adapter
from jpaged.lora.request import LoRARequest
from jpaged.lora.slots import LoRAManager

__all__ = ["HostAdapter", "LoRAError", "LoRAManager", "LoRARequest", "load_adapter"]
