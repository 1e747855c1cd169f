"""A peers run as a record: its figures, each round's, and when, where and how it ran.

`--json FILE` writes one; `--from-json FILE` reads it back, so the report, the plots and the
tables of docs/performance.md can be made again without running the engines (a full run takes
up to an hour). The file:

    {"meta": {"date", "cpu", "kind", "command", "repeats"},
     "results": [{"engine", "model", ...figures}, ...],     # the medians of the rounds
     "rounds": [[{"engine", "model", ...}, ...], ...]}     # each round's own

A file from before the record had a meta part is a bare list of results: it reads as one
round, dated by the file's modification time, on this machine's CPU, with no command.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.report import PeerResult

# /proc/cpuinfo flags named in the docs, in the order they are listed.
FEATURES = (
    ("avx2", "AVX2"),
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_tile", "AMX"),
)
# Options that say where output goes or which interpreter runs a peer, not what was measured.
_NOT_MEASUREMENT = ("--json", "--from-json", "--update-doc", "--plot-dir", "--python", "--verbose")
UNRECORDED_COMMAND = "python -m benchmarks.peers (arguments not recorded)"


@dataclass(slots=True)
class RunRecord:
    results: list[PeerResult]  # each (model, engine): the medians of its rounds
    rounds: list[list[PeerResult]]  # each round's results, for the per-round ratios
    date: str  # YYYY-MM-DD
    cpu: str  # e.g. "AMD EPYC (family 26, model 2), 2 cores; AVX2, AVX-512, AVX512-BF16"
    kind: str  # "amx" | "avx512-bf16" | "avx2" | "other": which table of the docs it fills
    command: str  # the command line, without output and interpreter options
    repeats: int = 3

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": {
                "date": self.date,
                "cpu": self.cpu,
                "kind": self.kind,
                "command": self.command,
                "repeats": self.repeats,
            },
            "results": [_result_json(r) for r in self.results],
            "rounds": [[_result_json(r) for r in results] for results in self.rounds],
        }

    @classmethod
    def from_json(cls, data: Any, *, fallback_date: str = "") -> RunRecord:
        """The record `to_json` wrote, or a bare list of results (one round, no command,
        dated `fallback_date`, on this machine's CPU)."""
        if isinstance(data, list):
            kind, cpu = this_cpu()
            results = [_result(item) for item in data]
            return cls(results, [results], fallback_date, cpu, kind, UNRECORDED_COMMAND)
        meta = data["meta"]
        return cls(
            results=[_result(item) for item in data["results"]],
            rounds=[[_result(item) for item in results] for results in data["rounds"]],
            date=str(meta["date"]),
            cpu=str(meta["cpu"]),
            kind=str(meta["kind"]),
            command=str(meta.get("command") or UNRECORDED_COMMAND),
            repeats=int(meta.get("repeats", 3)),
        )


def save(record: RunRecord, path: Path) -> None:
    path.write_text(json.dumps(record.to_json(), indent=2) + "\n")


def load(path: Path) -> RunRecord:
    modified = datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()
    return RunRecord.from_json(json.loads(path.read_text()), fallback_date=modified)


def today() -> str:
    return datetime.date.today().isoformat()


def command_line(argv: Sequence[str]) -> str:
    """`python -m benchmarks.peers` with `argv`'s options that decide what is measured."""
    kept: list[str] = []
    value_of_dropped = False
    for arg in argv:
        if value_of_dropped:
            value_of_dropped = False
            if not arg.startswith("-"):  # --update-doc's value is optional
                continue
        name = arg.split("=", 1)[0]
        if name in _NOT_MEASUREMENT:
            value_of_dropped = "=" not in arg and name != "--verbose"
            continue
        kept.append(arg)
    return " ".join(["python -m benchmarks.peers", *map(shlex.quote, kept)])


def describe_cpu(cpuinfo: str, cpus: int) -> tuple[str, str]:
    """(kind, description) of the CPU that /proc/cpuinfo's text `cpuinfo` shows.

    The kind names the table a run fills: "amx", "avx512-bf16", "avx2" or "other"; the
    description names the model, its family and model numbers, the cores and the features
    the kernels choose their paths by."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first processor's block is enough
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    features = [name for flag, name in FEATURES if flag in flags]
    if "amx_tile" in flags:
        kind = "amx"
    elif "avx512_bf16" in flags:
        kind = "avx512-bf16"
    elif "avx2" in flags:
        kind = "avx2"
    else:
        kind = "other"
    name = fields.get("model name", "unknown CPU")
    numbers = [
        f"{label} {fields[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
        if key in fields
    ]  # fmt: skip
    if numbers:
        name += f" ({', '.join(numbers)})"
    cores = f"{cpus} core{'s' if cpus != 1 else ''}"
    return kind, f"{name}, {cores}; {', '.join(features) or 'no AVX2'}"


def this_cpu() -> tuple[str, str]:
    """`describe_cpu` of this machine (kind "other" where /proc/cpuinfo cannot be read)."""
    cpus = os.cpu_count() or 1
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "other", f"unknown CPU, {cpus} cores"
    return describe_cpu(text, cpus)


def _result_json(result: PeerResult) -> dict[str, Any]:
    return {"engine": result.engine, "model": result.model, **result.data}


def _result(item: dict[str, Any]) -> PeerResult:
    data = dict(item)
    return PeerResult(engine=str(data.pop("engine")), model=str(data.pop("model")), data=data)
