"""State layers: the model-facing layers of Mamba-1 and Mamba-2, and the torch ops (CPU path and
kernel reference) of Mamba-1 (`torch_ops`), Mamba-2's SSD (`ssd_torch`) and the causal conv they
and LFM2 share."""

from pagedserve.attention.mamba.layer import Mamba2Layer, MambaLayer

__all__ = ["Mamba2Layer", "MambaLayer"]
