"""Worker → ModelRunner: packed varlen batch → model forward → Sampler."""
