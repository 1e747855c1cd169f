"""`LoRARequest` (which adapter a request runs with) and `LoRAConfig` (the engine's bounds)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter by name: `path` is its PEFT folder (`adapter_config.json` and
    `adapter_model.safetensors`), or None for an adapter the engine already holds
    (`add_lora`, `--lora-modules`).

    Passed as `generate(..., lora_request=...)`: a name the engine does not know yet is
    loaded from `path` first. As vLLM's, less its integer id (the name is the key).
    """

    name: str
    path: str | None = None

    def __init__(self, name: str, path: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"LoRARequest name must be a non-empty string, not {name!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"LoRARequest path must be a folder path, not {path!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "path", None if path is None else os.fspath(path))


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving bounds: adapters resident in one step (`max_loras`), kept loaded
    (`max_cpu_loras`, least recently used unloaded beyond; reloaded from their folder when
    asked for again), and the largest rank an adapter may have."""

    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None  # None: max_loras
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        """ValueError naming the field whose value this config can't hold."""
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora={self.enable_lora!r}: must be True or False")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < 1):
            raise ValueError(f"max_cpu_loras={cpu!r} is invalid: must be an integer >= 1")
        if cpu is not None and cpu < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={cpu} is invalid: must be >= max_loras ({self.max_loras}), "
                "since every adapter of a step is loaded"
            )

    @property
    def loaded_limit(self) -> int:
        """How many adapters stay loaded (max_cpu_loras, or max_loras when unset)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
