"""EngineConfig: Engine's options validated once, printable, given as keywords or as one value."""

from __future__ import annotations

import pytest

from engine_checks import greedy
from hf_checkpoints import random_token_ids
from mtlqwen.runtime import Engine, EngineConfig
from mtlqwen.runtime.memory import plan_memory


def test_keywords_and_a_config_build_the_same_engine(model):
    cfg = EngineConfig(slots=2, step_tokens=32, block_tokens=16, num_blocks=12, prefix_interval=16)
    by_config, by_keywords = Engine(model, config=cfg), Engine(model, **vars(cfg))
    assert by_config.engine_config == by_keywords.engine_config == cfg
    prompts = [random_token_ids(n, 512, seed=n) for n in (9, 20)]
    outs = [[o.token_ids for o in e.generate(prompts, greedy(5))] for e in (by_config, by_keywords)]
    assert outs[0] == outs[1]
    assert (by_config.num_blocks, by_config.slots, by_config.prefix.interval) == (12, 2, 16)
    # keywords override the config's fields, the rest stand
    over = Engine(model, cfg, slots=1, prefix_interval=0)
    assert over.engine_config == EngineConfig(slots=1, step_tokens=32, block_tokens=16, num_blocks=12, prefix_interval=0)
    assert over.prefix is None and over.slots == 1 and over.scheduler.num_slots == 1


@pytest.mark.parametrize("options, message", [
    (dict(slots=0), "slots must be an int >= 1"),
    (dict(slots=4, step_tokens=3), r"step_tokens \(3\) must be >= slots"),
    (dict(block_tokens=0), "block_tokens must be an int >= 1"),
    (dict(num_blocks=4, kv_bytes=1 << 20), "not both"),
    (dict(num_blocks=0), "num_blocks must be an int >= 1"),
    (dict(prefix_interval=-1), "prefix_interval must be >= 1"),
    (dict(prefix_cache_bytes=-5), "prefix_cache_bytes"),
    (dict(pad_buckets="yes"), "pad_buckets must be true or false"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(n_draft=3), "n_draft needs a drafter"),
    (dict(verify_commit="replay"), "verify_commit needs a drafter"),
    (dict(draft="somewhere", verify_commit="rerun"), "verify_commit must be one of"),
])
def test_bad_options_fail_once_with_the_field_named(model, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):
        Engine(model, **options)


def test_unknown_options_and_a_positional_non_config_are_refused(model):
    with pytest.raises(TypeError, match="slot"):
        Engine(model, slot=2)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.build(None, slot=2)
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(model, 4)


def test_str_lists_every_field_marking_the_changed_ones():
    text = str(EngineConfig(slots=3, prefix_interval=0))
    lines = text.splitlines()
    assert len(lines) == len(vars(EngineConfig()))
    assert "* slots=3" in lines and "* prefix_interval=0" in lines and "  step_tokens=None" in lines


def test_memory_plan_sizes_the_pool_and_the_prefix_share(model):
    c, dt = model.config, model.dtype
    plan = plan_memory(c, dt, EngineConfig(block_tokens=16, num_blocks=10, prefix_interval=24, prefix_cache_bytes=1 << 20), 4096)
    from mtlqwen.model.cache import ModelCache  # noqa: PLC0415

    per_block, per_slot = ModelCache.bytes_per_block(c, 16, dt), ModelCache.bytes_per_slot(c, dt)
    assert (plan.num_blocks, plan.prefix_bytes, plan.prefix_entry_bytes) == (10, 1 << 20, per_slot + per_block)
    plan = plan_memory(c, dt, EngineConfig(block_tokens=16, kv_bytes=7 * per_block + 1, prefix_interval=32), 4096)
    assert (plan.num_blocks, plan.prefix_entry_bytes) == (7, per_slot)  # 32 tokens are whole blocks: no tail copy
    assert plan_memory(c, dt, EngineConfig(num_blocks=3, prefix_interval=0), 4096).prefix_bytes == 0


def test_device_sized_pool_leaves_the_snapshot_share_out_before_the_full_context_cap(model, monkeypatch):
    """A device-sized default pool: the prefix snapshots' budget comes out of the device's KV budget, not out
    of the pool the full-context cap leaves (a small model on a big GPU keeps every block it can use:
    the demo pair on the H200 once got 1 block and could not serve a 39-token prompt)."""
    from mtlqwen.model.cache import ModelCache  # noqa: PLC0415
    from mtlqwen.runtime import memory  # noqa: PLC0415

    c, dt = model.config, model.dtype
    per_block, per_slot = ModelCache.bytes_per_block(c, 16, dt), ModelCache.bytes_per_slot(c, dt)
    cap = 2 * (4096 // 16)  # 2 slots of full context
    monkeypatch.setattr(memory.mx, "get_active_memory", lambda: 0)
    big = 1 << 40  # far more than the cap needs, and than the snapshots' 1 GiB
    monkeypatch.setattr(memory, "device_memory", lambda: (big, None))
    plan = plan_memory(c, dt, EngineConfig(block_tokens=16, slots=2, prefix_interval=32), 4096)
    assert (plan.num_blocks, plan.prefix_bytes) == (cap, memory.DEFAULT_CACHE_BYTES)
    # memory-bound: the snapshots' budget is taken out of the device budget, then the cap applies
    total = int((200 * per_block / memory.GPU_KV_SHARE + 3 * per_slot) / memory.GPU_MEMORY_FRACTION) + 64
    monkeypatch.setattr(memory, "device_memory", lambda: (total, None))
    avail = int((total * memory.GPU_MEMORY_FRACTION - 3 * per_slot) * memory.GPU_KV_SHARE)
    plan = plan_memory(c, dt, EngineConfig(block_tokens=16, slots=2, prefix_interval=32,
                                           prefix_cache_bytes=50 * per_block), 4096)
    assert avail // per_block == 200 and plan.num_blocks == (avail - 50 * per_block) // per_block == 150
    off = plan_memory(c, dt, EngineConfig(block_tokens=16, slots=2, prefix_interval=0), 4096)
    assert off.num_blocks == 200  # no prefix cache: nothing left out


def test_step_budget_default_grows_with_the_slots_times_the_draft_length():
    """step_tokens None: 128, or slots x (drafts + 1) when that is more (every slot verifies its drafts in one
    step); a given step_tokens is kept."""
    assert EngineConfig().step_budget() == 128 and EngineConfig(slots=32).step_budget(0) == 128
    assert EngineConfig(slots=8).step_budget(15) == 128 and EngineConfig(slots=32).step_budget(15) == 512
    assert EngineConfig(slots=32).step_budget(3) == 128 and EngineConfig(slots=40).step_budget(3) == 160
    assert EngineConfig(slots=32, step_tokens=64).step_budget(15) == 64
    assert EngineConfig(slots=200).prefill_budget == 1024 and EngineConfig(slots=2000).prefill_budget == 2000
