"""Public test helpers: tiny random-weight models of real architectures, the transformers
reference for greedy output."""

from asyncengine.testing.models import TINY_ARCHITECTURES, build_tiny_model
from asyncengine.testing.reference import transformers_greedy

__all__ = ["TINY_ARCHITECTURES", "build_tiny_model", "transformers_greedy"]
