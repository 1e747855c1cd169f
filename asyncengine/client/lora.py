"""What a request's `lora_request` asks of the engine: the adapter's name, and whether it
must be added first (AsyncLLM and the offline LLM share this)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from asyncengine.lora.request import LoRARequest


def resolve_lora(
    lora_request: LoRARequest | None, held: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """(adapter name or None, the folder to add it from first or None), given the adapters
    the engine `held` (name -> folder). ValueError for something other than a LoRARequest, or
    a name without a folder that the engine does not hold."""
    if lora_request is None:
        return None, None
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(
            f"lora_request must be a LoRARequest or None, not {type(lora_request).__name__}"
        )
    name, path = lora_request.name, lora_request.path
    folder = None if path is None else os.path.abspath(path)
    if name in held and (folder is None or held[name] == folder):
        return name, None
    if folder is None:
        known = ", ".join(sorted(held)) or "none"
        raise ValueError(
            f"unknown LoRA adapter {name!r}: the engine holds {known} (give the "
            "LoRARequest a path, or add_lora it first)"
        )
    return name, folder


def adapter_folder(lora_request: LoRARequest) -> tuple[str, str]:
    """(name, absolute folder) of a LoRARequest given to add_lora; ValueError without one."""
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"add_lora takes a LoRARequest, not {type(lora_request).__name__}")
    if lora_request.path is None:
        raise ValueError(f"add_lora({lora_request.name!r}): the LoRARequest needs a path")
    return lora_request.name, os.path.abspath(lora_request.path)
