"""State layers: Mamba-1's model-facing layer, and the torch ops (CPU path and kernel reference)
of Mamba-1 (`torch_ops`), Mamba-2's SSD (`ssd_torch`) and the causal conv they and LFM2 share."""

from pagedserve.attention.mamba.layer import MambaLayer

__all__ = ["MambaLayer"]
