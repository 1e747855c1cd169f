"""Executors drive the workers that run the model."""
