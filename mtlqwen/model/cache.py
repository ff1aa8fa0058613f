"""Model-side cache memory: paged KV pools for attention layers, per-slot GDN state pools.

The model never decides which block or slot a sequence uses; the runtime does, and hands the model a
`SeqLayout` naming them. Block id b indexes the K and V pool of *every* full-attention layer (a bundle).
"""

from __future__ import annotations

import mlx.core as mx

from .config import Qwen35Config


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
        # Filled by a forward with verifying sequences (SeqLayout.verify), consumed by
        # Qwen35Model.commit_candidates: per GDN layer the candidate states of those sequences (or, in
        # replay mode, their delta-rule inputs), plus "layout" and "mode".
        self.candidates: dict = {}

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

    def clear_stash(self) -> None:
        """Drop what a verifying forward left for commit_candidates (its step was abandoned)."""
        self.candidates = {}

    def reset(self) -> None:
        """Every pool back to zeros (new arrays: the old contents may be undefined after a failed evaluation)."""
        for pools in (self.k_pools, self.v_pools, self.conv_states, self.rec_states):
            for i, p in enumerate(pools):
                pools[i] = mx.zeros(p.shape, dtype=p.dtype)
        self.clear_stash()
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [*self.k_pools, *self.v_pools, *self.conv_states, *self.rec_states]
