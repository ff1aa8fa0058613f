"""Mixture-of-experts: routing (softmax, top-k, renormalisation) and the expert MLPs; the references
(reference.py), the kernels (kernels.py) and the dispatchers (ops.py)."""

from .ops import moe_combine, moe_experts, moe_experts_add_rms_norm, moe_route, moe_router_route
from .reference import moe_experts_ref, moe_experts_sorted, moe_route_ref

__all__ = ["moe_combine", "moe_experts", "moe_experts_add_rms_norm", "moe_experts_ref", "moe_experts_sorted", "moe_route", "moe_route_ref", "moe_router_route"]
