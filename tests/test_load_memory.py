"""Loading reads safetensors lazily: peak memory stays near the size of the weights kept."""

from __future__ import annotations

import hf_checkpoints as H
import mlx.core as mx
import mtlqwen


def _peak_load(path, **kw):
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model = mtlqwen.load(path, **kw)
    return model, mx.get_peak_memory() - base


def test_load_peak_near_weight_size(tmp_path):
    # a larger vocabulary so the embedding and head dominate, as in real checkpoints
    d = H.write_tiny_checkpoint(tmp_path / "m", moe=False, r=3, seed=1, vocab_size=8192)
    model, peak = _peak_load(d)
    kept = sum(v.nbytes for v in model.weights.values())
    assert peak <= 1.1 * kept + (1 << 20), (peak, kept)  # no second full copy (vision/MTP never read)


def test_quantize_at_load_frees_float_tensors(tmp_path):
    d = H.write_tiny_checkpoint(tmp_path / "m", moe=False, r=3, seed=1, vocab_size=8192)
    model, peak = _peak_load(d, quantize="4bit")
    kept = sum(v.nbytes for v in model.weights.values())
    largest_float = 8192 * 128 * 4
    assert peak <= kept + 2 * largest_float + (1 << 20), (peak, kept)
