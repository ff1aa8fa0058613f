"""The KV block pool: exact ids, ref counts and free-queue order; the default pool size."""

import mlx.core as mx
import pytest

from mtlqwen.model.config import parse_config
from mtlqwen.model.cache import ModelCache
from mtlqwen.runtime.block_pool import BlockPool, NoFreeBlocks
from mtlqwen.runtime.memory import CPU_KV_BYTES, resolve_num_blocks


def test_allocate_takes_from_the_front_in_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_ids() == [5]
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free, pool.num_used) == (1, 5)


def test_free_returns_a_table_tail_first_to_the_back_of_the_queue():
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.free(a)
    assert pool.free_ids() == [5, 2, 1, 0]
    assert pool.ref_counts == [0, 0, 0, 1, 1, 0]
    assert pool.allocate(2) == [5, 2]  # oldest free first
    pool.free(b)
    assert pool.free_ids() == [1, 0, 4, 3]


def test_shared_bundles_return_only_when_the_last_owner_frees():
    pool = BlockPool(4)
    ids = pool.allocate(2)  # [0, 1]
    pool.share(ids)
    assert pool.ref_counts[:2] == [2, 2]
    pool.free(ids)
    assert pool.ref_counts[:2] == [1, 1] and pool.free_ids() == [2, 3]
    pool.free([1])
    assert pool.ref_counts[:2] == [1, 0] and pool.free_ids() == [2, 3, 1]
    pool.free([0])
    assert pool.free_ids() == [2, 3, 1, 0]


def test_overdraw_raises_and_leaves_the_pool_unchanged():
    pool = BlockPool(3)
    pool.allocate(2)
    assert not pool.can_allocate(2) and pool.can_allocate(1)
    with pytest.raises(NoFreeBlocks, match="asked for 2 KV blocks, 1 free of 3"):
        pool.allocate(2)
    assert pool.free_ids() == [2] and pool.ref_counts == [1, 1, 0]
    assert pool.allocate(0) == []


def test_misuse_is_caught():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([0])
    with pytest.raises(ValueError, match="is free"):
        pool.share([1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


@pytest.mark.parametrize("tokens,expected", [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for(tokens, expected):
    assert BlockPool.blocks_for(tokens, 16) == expected


def _config():
    return parse_config({
        "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
    })


def test_pool_size_from_blocks_bytes_or_default():
    c = _config()

    per = ModelCache.bytes_per_block(c, 16, mx.float32)
    assert per == 2 * c.num_key_value_heads * c.head_dim * 4 * 16 * len(c.full_attention_layers)
    assert resolve_num_blocks(c, mx.float32, 16, 4, 4096, num_blocks=7) == 7
    assert resolve_num_blocks(c, mx.float32, 16, 4, 4096, kv_bytes=10 * per + 5) == 10
    # CPU default: a fixed byte budget, capped at slots x a full context of blocks
    assert resolve_num_blocks(c, mx.float32, 16, 4, 4096) == min(4 * 256, CPU_KV_BYTES // per)
    assert resolve_num_blocks(c, mx.float32, 16, 1, 64) == 4
    with pytest.raises(ValueError, match="not both"):
        resolve_num_blocks(c, mx.float32, 16, 4, 4096, num_blocks=1, kv_bytes=per)
    with pytest.raises(ValueError, match="less than one KV block"):
        resolve_num_blocks(c, mx.float32, 16, 4, 4096, kv_bytes=per - 1)
