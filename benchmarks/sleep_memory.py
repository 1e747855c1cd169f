"""What AsyncLLM.sleep releases and how long wake_up takes, on the default model (or MODEL).

    python benchmarks/sleep_memory.py [MODEL]

For each level: the resident memory of the engine core's process tree (psutil) awake, asleep
and after waking and generating again, the address space released, and the sleep and wake_up
times. (On the CPU the KV cache is resident only where blocks were written: a short request
touches a few, so level 1 releases little resident memory but the whole cache's mapping.)
"""

from __future__ import annotations

import sys
import time

import anyio
import psutil

from asyncengine import AsyncLLM, SamplingParams


def _tree_mib(pid: int) -> tuple[float, float]:
    """Resident and virtual MiB of `pid` and its descendants."""
    root = psutil.Process(pid)
    infos = [p.memory_info() for p in [root, *root.children(recursive=True)]]
    return sum(i.rss for i in infos) / 2**20, sum(i.vms for i in infos) / 2**20


async def _generate(engine: AsyncLLM) -> None:
    async for _ in engine.generate("hello", SamplingParams(max_tokens=8)):
        pass


async def main(model: str) -> None:
    for level in (1, 2):
        async with AsyncLLM.from_pretrained(model) as engine:
            proc = engine._core_client.proc  # type: ignore[union-attr]
            pid = proc.pid
            await _generate(engine)
            awake, awake_vms = _tree_mib(pid)
            t0 = time.perf_counter()
            await engine.sleep(level=level)
            slept = time.perf_counter() - t0
            asleep, asleep_vms = _tree_mib(pid)
            t0 = time.perf_counter()
            await engine.wake_up()
            woke = time.perf_counter() - t0
            await _generate(engine)
            print(
                f"level {level}: awake {awake:.0f} MiB, asleep {asleep:.0f} MiB "
                f"(released {awake - asleep:.0f}; address space {awake_vms - asleep_vms:.0f}), "
                f"sleep {slept:.3f} s, wake_up {woke:.3f} s, "
                f"after waking {_tree_mib(pid)[0]:.0f} MiB"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        target = sys.argv[1]
    else:
        from asyncengine.default_model import default_model_dir

        target = str(default_model_dir())
    anyio.run(main, target)
