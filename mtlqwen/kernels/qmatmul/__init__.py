"""Projections: the weights (params.py), the references (reference.py), the quantized GEMV's source
fragments (bodies.py), its launches (gemv.py), the GEMV with the residual + RMSNorm epilogue
(residual.py) and the dispatchers (ops.py)."""

from .ops import gather_linear, gdn_in_proj_conv, linear, linear_add_rms_norm, linear_multi, swiglu_linear
from .params import LinearParams
from .reference import gather_linear_ref, linear_add_rms_norm_ref, linear_multi_ref, linear_ref, swiglu_linear_ref

__all__ = ["LinearParams", "gather_linear", "gather_linear_ref", "gdn_in_proj_conv", "linear", "linear_add_rms_norm",
           "linear_add_rms_norm_ref", "linear_multi", "linear_multi_ref", "linear_ref", "swiglu_linear",
           "swiglu_linear_ref"]
