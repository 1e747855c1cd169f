"""Scheduler (continuous batching, chunked prefill, preemption) and the paged KV cache manager."""
