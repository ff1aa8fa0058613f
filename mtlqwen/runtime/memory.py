"""How an engine's memory is sized: KV bundles (given, from a byte budget, or from the device) and the
prefix cache's share."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import gpu_backend
from ..model.cache import ModelCache
from .block_pool import BlockPool
from .prefix_cache import DEFAULT_CACHE_BYTES

CPU_KV_BYTES = 1 << 30  # a modest fixed budget off-GPU
GPU_MEMORY_FRACTION = 0.9  # of the device's memory (working set on Metal) usable by this process
GPU_KV_SHARE = 0.8  # of what weights and slot states leave, kept for KV; the rest is for activations


def device_memory() -> tuple[int | None, int | None]:
    """(usable bytes, free bytes) of the GPU, or (None, None) off-GPU."""
    if gpu_backend() is None or mx.default_device().type != mx.DeviceType.gpu:
        return None, None
    info = mx.device_info()
    total = info.get("max_recommended_working_set_size") or info.get("total_memory") or info.get("memory_size")
    free = info.get("free_memory")
    return (int(total) if total else None), (int(free) if free is not None else None)


def resolve_num_blocks(
    config, dtype, block_tokens: int, slots: int, max_model_len: int,
    num_blocks: int | None = None, kv_bytes: int | None = None, extra_block_bytes: int = 0,
    reserve_bytes: int = 0,
) -> int:
    """num_blocks, else kv_bytes / bytes per bundle, else a device default capped at what `slots`
    full-context sequences could ever use. extra_block_bytes: what else a bundle holds (drafter K/V).
    reserve_bytes: what the device default leaves out of its KV budget for something else (the prefix
    snapshots), before the cap: a small model whose pool the cap bounds keeps its whole pool.
    Under tensor parallelism `config` is the rank's shard (sharding.shard_config): the bytes per bundle
    and per slot are this rank's, so a budget buys N times the bundles of one process."""
    per_block = ModelCache.bytes_per_block(config, block_tokens, dtype) + extra_block_bytes
    if num_blocks is not None and kv_bytes is not None:
        raise ValueError("give num_blocks or kv_bytes, not both")
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return int(num_blocks)
    if kv_bytes is not None:
        if kv_bytes < per_block:
            raise ValueError(f"kv_bytes={kv_bytes} is less than one KV block ({per_block} bytes)")
        return int(kv_bytes // per_block)
    cap = slots * BlockPool.blocks_for(max_model_len, block_tokens)
    total, free = device_memory()
    if total is None:
        budget = CPU_KV_BYTES
    else:
        avail = total * GPU_MEMORY_FRACTION - mx.get_active_memory()
        if free is not None:
            avail = min(avail, free * GPU_MEMORY_FRACTION)
        avail -= (slots + 1) * ModelCache.bytes_per_slot(config, dtype)
        budget = max(per_block, int(avail * GPU_KV_SHARE) - reserve_bytes)
    return max(1, min(cap, budget // per_block))


@dataclass(frozen=True)
class MemoryPlan:
    """How an engine's memory is divided: KV bundles, the prefix snapshots' budget and one snapshot's size."""

    num_blocks: int
    prefix_bytes: int  # the prefix cache's budget (0 when it is off)
    prefix_entry_bytes: int  # one snapshot: GDN state of a slot, plus a partial block's K/V copy


def plan_memory(config, dtype, engine_config, max_model_len: int, extra_block_bytes: int = 0) -> MemoryPlan:
    """The pool and prefix-cache sizes for an EngineConfig (resolve_num_blocks; with a default, device-sized
    pool and the prefix cache on, the snapshots' budget is taken out of the KV share)."""
    ec = engine_config
    budget = (DEFAULT_CACHE_BYTES if ec.prefix_cache_bytes is None else ec.prefix_cache_bytes) if ec.prefix_interval else 0
    # a default KV budget taken from free device memory leaves the snapshots' share out (a given
    # num_blocks / kv_bytes is the caller's own division)
    num_blocks = resolve_num_blocks(config, dtype, ec.block_tokens, ec.slots, max_model_len, ec.num_blocks,
                                    ec.kv_bytes, extra_block_bytes, reserve_bytes=budget)
    if not ec.prefix_interval:
        return MemoryPlan(num_blocks, 0, 0)
    per_block = ModelCache.bytes_per_block(config, ec.block_tokens, dtype)
    per_entry = ModelCache.bytes_per_slot(config, dtype)
    if ec.prefix_interval % ec.block_tokens:  # plus the copy of the partial last block
        per_entry += per_block
    return MemoryPlan(num_blocks, budget, per_entry)
