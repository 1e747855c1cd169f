"""Public test helpers: tiny random-weight models of real architectures, fakes."""

from asyncengine.testing.models import TINY_ARCHITECTURES, build_tiny_model

__all__ = ["TINY_ARCHITECTURES", "build_tiny_model"]
