"""RMSNorm, the GDN gated RMSNorm and the residual add + RMSNorm: references, row kernels, dispatchers."""

from .kernels import FLOATS, ROW_INV_RMS, SUM_SQ, eps_array
from .ops import add_rms_norm, gated_rms_norm, rms_norm
from .reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref

__all__ = ["FLOATS", "ROW_INV_RMS", "SUM_SQ", "add_rms_norm", "add_rms_norm_ref", "eps_array", "gated_rms_norm",
           "gated_rms_norm_ref", "rms_norm", "rms_norm_ref"]
