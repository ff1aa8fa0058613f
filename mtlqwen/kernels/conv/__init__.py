"""The GDN causal conv1d + SiLU with its K-1 row state: reference, kernels, dispatcher."""

from .ops import causal_conv1d
from .reference import causal_conv1d_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref"]
