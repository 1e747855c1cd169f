"""The engine core: EngineCore.step() and the busy loop that drives it."""

import os

# Before anything here imports torch: let idle OpenMP threads sleep instead of spinning.
# With spinning threads, one other busy process on the machine (the client, a test, a web
# server) stalls every parallel region; measured on 2 cores with one competing process,
# offline throughput fell from ~3,500 to ~150 tok/s, and stays at ~3,500 with this.
# It has no effect once torch is loaded, and an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
