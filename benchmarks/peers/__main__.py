"""`python -m benchmarks.peers`: the peers harness (harness.py)."""

from __future__ import annotations

import sys

from benchmarks.peers.harness import main

sys.exit(main())
