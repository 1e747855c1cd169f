"""The GPUs a process would see, found without importing torch (the client stays torch-free
and quick to start): whether device "auto" is CUDA here, and CUDA_VISIBLE_DEVICES read as
CUDA reads it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    # Checking for CUDA must not import torch on the client: look for a visible NVIDIA device.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    return "cuda" if Path("/dev/nvidiactl").exists() and _torch_has_cuda() else "cpu"


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The GPUs a CUDA process started from here would see, as CUDA_VISIBLE_DEVICES
    entries in CUDA's order ("0", "1", or "GPU-<uuid>" / "MIG-<uuid>"); None where this
    can't tell (CUDA_VISIBLE_DEVICES unset and no /proc/driver/nvidia).

    Counted without torch, so that the client stays torch-free and quick to start (torch
    asks NVML, which agrees but for MIG UUIDs, which it can check and this can't): the driver
    lists each GPU it drives under /proc/driver/nvidia/gpus/ (in a container the NVIDIA
    runtime mounts only the container's GPUs there), and CUDA_VISIBLE_DEVICES narrows that
    the way CUDA does, up to its first entry that is not a device (out of range, repeated,
    "-1", or not a number or a UUID; a GPU UUID is checked against the driver's, a MIG
    UUID is taken as given). Where this overcounts, the engine's own start fails instead
    (worker_device names the GPU it lacks).

    `environ`: the environment whose CUDA_VISIBLE_DEVICES counts (default: this process's)."""
    installed = _nvidia_gpus()
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None if installed is None else [str(i) for i in range(len(installed))]
    visible: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit():
            entry = str(int(entry))
            if installed is not None and int(entry) >= len(installed):
                break
        elif entry.startswith("GPU-"):
            # CUDA takes a UUID's unambiguous prefix too.
            if installed and all(installed) and not any(u.startswith(entry) for u in installed):
                break
        elif not entry.startswith("MIG-"):
            break
        if entry in visible:
            break
        visible.append(entry)
    return visible


def _nvidia_gpus() -> list[str] | None:
    """The UUID of each GPU the NVIDIA driver lists ("" where it doesn't say); None: no
    driver information here."""
    try:
        folders = sorted(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return None
    uuids: list[str] = []
    for folder in folders:
        try:
            found = re.search(r"GPU UUID:\s*(GPU-\S+)", (folder / "information").read_text())
        except OSError:
            found = None
        uuids.append(found.group(1) if found else "")
    return uuids


def _torch_has_cuda() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    # A CPU wheel has no CUDA libraries next to it.
    lib = Path(spec.origin).parent / "lib"
    return any(lib.glob("libtorch_cuda*"))
