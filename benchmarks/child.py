"""Run one benchmark child process and read back the JSON record it prints."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def run_child(
    cmd: list[str],
    result_prefix: str,
    *,
    timeout: float,
    verbose: bool = False,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """The record of the last stdout line starting with `result_prefix`, or {"error": ...}
    with the exit code and the tail of stderr (or the timeout) when there is none."""
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=None if verbose else subprocess.PIPE,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(result_prefix):
            record: dict[str, Any] = json.loads(line[len(result_prefix) :])
            return record
    tail = (proc.stderr or "").strip().splitlines()[-25:]
    return {"error": f"exit code {proc.returncode}\n" + "\n".join(tail)}
