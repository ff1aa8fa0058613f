"""Model-side cache memory: paged KV pools for attention layers, per-slot GDN state pools.

The model never decides which block or slot a sequence uses; the runtime does, and hands the model a
`SeqLayout` naming them. Block id b indexes the K and V pool of *every* full-attention layer (a bundle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..kernels import SeqLayout
from .config import Qwen35Config


@dataclass
class GDNStash:
    """One GDN layer's part of a verification. rec: the state after every verify row [Tv, Hv, dv, dk]
    ("candidates" mode) or the verify rows' delta-rule inputs (y, a, b) ("replay" mode; y: the packed conv
    output q | k | v [Tv, 2*Hk*dk + Hv*dv]); raw: the verify rows' conv inputs [Tv, C]. The verifying slots'
    old conv rows stay in the pool, where the commit reads them: nothing writes a verifying slot between
    its verification and its commit."""

    rec: mx.array | tuple[mx.array, ...]
    raw: mx.array

    def tree(self) -> tuple:
        """The arrays as a nested tuple (what an `mx.compile` trace returns); from_tree inverts it."""
        return (self.rec, self.raw)

    @classmethod
    def from_tree(cls, t) -> GDNStash:
        rec, raw = t
        return cls(tuple(rec) if isinstance(rec, (list, tuple)) else rec, raw)


@dataclass
class VerifyStash:
    """What a verifying forward (Qwen35Model.forward_verifying) returns for Qwen35Model.commit_candidates:
    the commit mode it was run in, the layout of the verifying sequences alone, each GDN layer's part
    (by GDN state index). The forward fills it layer by layer; a commit applies it once (`committed`):
    a second commit would move the states on from ones they already left."""

    mode: str
    layout: SeqLayout | None = None
    layers: dict[int, GDNStash] = field(default_factory=dict)
    committed: bool = False


class ModelCache:
    """k_pools / v_pools: per full-attention layer [num_blocks, block_tokens, nKV, hd] (activation dtype).
    conv_states: per GDN layer [num_slots, K-1, conv_dim]; rec_states: per GDN layer [num_slots, Hv, dv, dk] fp32."""

    def __init__(
        self,
        config: Qwen35Config,
        num_blocks: int,
        num_slots: int,
        block_tokens: int = 128,
        dtype: mx.Dtype = mx.bfloat16,
    ):
        c = config
        self.config = c
        self.num_blocks, self.num_slots, self.block_tokens, self.dtype = num_blocks, num_slots, block_tokens, dtype
        kv_shape = (num_blocks, block_tokens, c.num_key_value_heads, c.head_dim)
        n_attn, n_gdn = len(c.full_attention_layers), len(c.linear_attention_layers)
        self.k_pools = [mx.zeros(kv_shape, dtype=dtype) for _ in range(n_attn)]
        self.v_pools = [mx.zeros(kv_shape, dtype=dtype) for _ in range(n_attn)]
        conv_shape = (num_slots, c.linear_conv_kernel_dim - 1, c.conv_dim)
        rec_shape = (num_slots, c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim)
        self.conv_states = [mx.zeros(conv_shape, dtype=dtype) for _ in range(n_gdn)]
        self.rec_states = [mx.zeros(rec_shape, dtype=mx.float32) for _ in range(n_gdn)]
        mx.eval(self.k_pools, self.v_pools, self.conv_states, self.rec_states)
        # A speculative engine's model.dflash.DrafterCache: drafter K/V indexed by the same bundle ids, so
        # whoever copies a bundle (the prefix cache's partial blocks) copies its drafter rows too.
        self.drafter_cache: Any = None
        # GDN states at snapshot boundaries inside the step's prefill chunks (model/gdn_taps.py), by
        # (state row, position), then GDN layer: (conv [1, K-1, C], rec [1, Hv, dv, dk]); the step's
        # snapshots (runtime/kv_manager.py) take them and clear the dict
        self.gdn_taps: dict = {}

    @staticmethod
    def bytes_per_block(config: Qwen35Config, block_tokens: int, dtype: mx.Dtype = mx.bfloat16) -> int:
        """K + V bytes of one bundle across all full-attention layers."""
        per_token = 2 * config.num_key_value_heads * config.head_dim * dtype.size
        return per_token * block_tokens * len(config.full_attention_layers)

    @staticmethod
    def bytes_per_slot(config: Qwen35Config, dtype: mx.Dtype = mx.bfloat16) -> int:
        c = config
        conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * dtype.size
        rec = c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim * 4
        return (conv + rec) * len(c.linear_attention_layers)

    def reset(self) -> None:
        """Every pool back to zeros (new arrays: the old contents may be undefined after a failed evaluation)."""
        for pools in (self.k_pools, self.v_pools, self.conv_states, self.rec_states):
            for i, p in enumerate(pools):
                pools[i] = mx.zeros(p.shape, dtype=p.dtype)
        if self.drafter_cache is not None:
            self.drafter_cache.reset()
        self.gdn_taps.clear()
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [*self.k_pools, *self.v_pools, *self.conv_states, *self.rec_states]
