"""The peers harness: asyncengine against llama.cpp, vLLM and transformers, side by side.

`python -m benchmarks.peers --help` from the repository root; see benchmarks/README.md for
what each module holds and docs/performance.md for the figures.
"""
