"""Mamba-1 state: the model-facing layer and the torch ops (CPU path and kernel reference)."""

from pagedserve.attention.mamba.layer import MambaLayer

__all__ = ["MambaLayer"]
