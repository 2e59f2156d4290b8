"""Test helpers: re-exported from ``fedswarm.testing``."""

from fedswarm.testing import MiniSwarm, ident

__all__ = ["MiniSwarm", "ident"]
