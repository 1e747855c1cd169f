"""Benchmarks: asyncengine measured side by side with its peers (see README.md)."""
