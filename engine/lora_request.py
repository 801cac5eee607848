"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's name and fields); docs/lora.md."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, a positive id unique per adapter, and its PEFT directory
    (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id <= 0
        ):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What the prefix cache's root digest mixes in: KV computed under one adapter is never another's."""
        return f"{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
