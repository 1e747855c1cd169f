"""The engine core: EngineCore.step() and the busy loop that drives it."""

import os

# Before anything here imports torch: let idle OpenMP threads sleep instead of spinning.
# With spinning threads, one other busy process on the machine (the client, a test, a web
# server) stalls every parallel region; measured on 2 cores with one competing process,
# offline throughput fell from ~3,500 to ~150 tok/s, and stays at ~3,500 with this.
# It has no effect once torch is loaded, and an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but spin a little first (about 3,000 iterations, tens of microseconds) before sleeping: a
# decode step opens ~240 parallel regions, and waking a sleeping thread at each costs more than
# the region's work (one SmolLM2 stream: 64 tok/s without the spin, 165-174 with it). Spinning
# threads stall when another process wants the cores: the ThreadGovernor (cpu_threads.py)
# then gives the cores up, so the spin only runs while the engine has the cores to itself.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
