"""The MLX graph against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (float32, CPU), and
every way of feeding a sequence (chunked prefill, decode, packed batches) against the one-shot forward."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_checkpoints as H
import mlx.core as mx
import mtlqwen
from mtlqwen import SeqLayout
from mtlqwen.model.convert import convert

T_PARITY = 210  # past the 64-token chunk of the reference scan and its recurrence threshold

VARIANTS = {
    "dense-r3": dict(moe=False, tied=False, r=3),
    "dense-tied-r1": dict(moe=False, tied=True, r=1),
    "moe-r3": dict(moe=True, tied=False, r=3),
    "moe-tied-r2": dict(moe=True, tied=True, r=2),
}


def rel_err(out, ref) -> float:
    return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=list(VARIANTS))
def official(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    H.write_tiny_checkpoint(d, seed=7, **VARIANTS[request.param])
    return d


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    H.write_tiny_checkpoint(d, moe=False, tied=False, r=3, seed=3)
    return d


@pytest.fixture(scope="module")
def dense_model(dense_dir):
    return mtlqwen.load(dense_dir)


def test_official_layout_matches_transformers(official):
    ids = H.random_token_ids(T_PARITY, 512, seed=11)
    ref = H.hf_reference_logits(official, ids)
    assert rel_err(mtlqwen.load(official).logits(ids), ref) <= 1e-3


def test_converted_layout_matches_transformers(official, tmp_path):
    ids = H.random_token_ids(T_PARITY, 512, seed=12)
    ref = H.hf_reference_logits(official, ids)
    out = convert(official, tmp_path / "mlx", progress=False)
    # the converted files use mlx-lm's conventions: +1 folded into norms, conv [C, K, 1]
    names = set(mx.load(str(next(out.glob("*.safetensors")))).keys())
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert rel_err(mtlqwen.load(out).logits(ids), ref) <= 1e-3


def test_text_only_layout_matches_transformers(tmp_path):
    d = H.write_tiny_text_only_checkpoint(tmp_path / "t", moe=False, r=2, seed=5)
    ids = H.random_token_ids(T_PARITY, 512, seed=13)
    assert rel_err(mtlqwen.load(d).logits(ids), H.hf_reference_logits(d, ids)) <= 1e-3


def test_per_expert_moe_keys_match_transformers(tmp_path):
    d = H.write_tiny_checkpoint(tmp_path / "pe", moe=True, r=3, seed=9, fused_experts=False)
    ids = H.random_token_ids(100, 512, seed=14)
    assert rel_err(mtlqwen.load(d).logits(ids), H.hf_reference_logits(d, ids)) <= 1e-3


def test_bf16_checkpoint_keeps_gates_and_norms_fp32(tmp_path):
    d = H.write_tiny_checkpoint(tmp_path / "bf", moe=False, r=3, seed=4, dtype="bfloat16")
    m = mtlqwen.load(d)
    assert m.dtype == mx.bfloat16
    w = m.weights
    assert w["model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert w["model.layers.0.linear_attn.dt_bias"].dtype == mx.float32
    assert w["model.layers.0.input_layernorm.weight"].dtype == mx.float32
    logits = np.asarray(m.logits(H.random_token_ids(40, 512, seed=1)).astype(mx.float32))
    assert np.isfinite(logits).all()


def _run_schedule(model, seqs: list[list[int]], chunks: list[list[int]], block_tokens: int):
    """Feed each sequence in the given chunk sizes, all sequences packed into every step.
    Returns per sequence the logits of all its positions, concatenated in order."""
    n = len(seqs)
    nb_per = [-(-len(s) // block_tokens) for s in seqs]
    cache = model.make_cache(num_blocks=sum(nb_per) + 1, num_slots=n + 1, block_tokens=block_tokens)
    # scatter the sequences' blocks and slots so ids are not trivially 0..k
    tables, nxt = [], 1
    for nb in nb_per:
        tables.append(list(range(nxt, nxt + nb))[::-1])
        nxt += nb
    slots = list(range(1, n + 1))[::-1]
    done = [0] * n
    out = [[] for _ in range(n)]
    step = 0
    while any(done[i] < len(seqs[i]) for i in range(n)):
        live = [i for i in range(n) if done[i] < len(seqs[i])]
        ids, qsl, kv = [], [0], []
        for i in live:
            c = min(chunks[i][step % len(chunks[i])], len(seqs[i]) - done[i])
            ids += seqs[i][done[i] : done[i] + c]
            qsl.append(qsl[-1] + c)
            kv.append(done[i])
        layout = SeqLayout(qsl, kv, [tables[i] for i in live], [slots[i] for i in live], block_tokens)
        logits = np.asarray(model.forward(mx.array(ids, dtype=mx.int32), layout, cache))
        for j, i in enumerate(live):
            out[i].append(logits[qsl[j] : qsl[j + 1]])
            done[i] += qsl[j + 1] - qsl[j]
        step += 1
    return [np.concatenate(o) for o in out]


def test_prefill_then_decode_matches_one_shot(dense_model):
    ids = H.random_token_ids(150, 512, seed=21)
    ref = np.asarray(dense_model.logits(ids))
    (got,) = _run_schedule(dense_model, [ids], [[100, *([1] * 50)]], 32)  # prefill 100, then decode
    assert rel_err(got, ref) <= 1e-3


def test_gdn_kernel_switches_leave_cpu_results_unchanged(dense_model, monkeypatch):
    """GDNMixer's plain path with the in-place conv state, the fused GDN norm and in-place GDN states
    switched on or off: on the CPU the ops fall back to the same references, so a packed prefill + decode
    schedule gives the same logits bit for bit."""
    from mtlqwen.kernels.selection import SELECT  # noqa: PLC0415

    seqs = [H.random_token_ids(L, 512, seed=L) for L in (37, 5, 70)]
    runs = []
    for on in (0, 1):
        for flag in ("conv_state_inplace", "gdn_fused_norm", "gdn_state_inplace"):
            monkeypatch.setitem(SELECT, flag, on)
        runs.append(_run_schedule(dense_model, seqs, [[20, 1], [2, 1], [33, 1]], 16))
    for off, on in zip(*runs):
        assert np.array_equal(off, on)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_chunked_and_packed_match_one_shot(dense_model, data):
    n = data.draw(st.integers(1, 4), label="sequences")
    block_tokens = data.draw(st.sampled_from([16, 32, 128]), label="block_tokens")
    seqs, chunks = [], []
    for i in range(n):
        L = data.draw(st.integers(1, 140), label=f"len{i}")
        seqs.append(H.random_token_ids(L, 512, seed=data.draw(st.integers(0, 10**6))))
        chunks.append(data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=4), label=f"chunks{i}"))
    got = _run_schedule(dense_model, seqs, chunks, block_tokens)
    for s, g in zip(seqs, got):
        assert rel_err(g, np.asarray(dense_model.logits(s))) <= 1e-3


def test_moe_packed_batch_matches_one_shot(tmp_path):
    m = mtlqwen.load(H.write_tiny_checkpoint(tmp_path / "moe", moe=True, r=2, seed=8))
    seqs = [H.random_token_ids(L, 512, seed=L) for L in (90, 7, 33)]
    got = _run_schedule(m, seqs, [[40, 3], [2], [33]], 16)
    for s, g in zip(seqs, got):
        assert rel_err(g, np.asarray(m.logits(s))) <= 1e-3


def test_tap_layers_equal_transformers_hidden_states(dense_dir, dense_model):
    """DFlash taps: the residual stream after layer L is HF's output_hidden_states[L + 1]."""
    import torch  # noqa: PLC0415

    ids = H.random_token_ids(70, 512, seed=2)
    hf = H.load_hf_model(dense_dir)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    cache = dense_model.make_cache(num_blocks=1, num_slots=1)
    layout = SeqLayout([0, len(ids)], [0], [[0]], [0], 128)
    taps = (1, 3, 6)
    _, got = dense_model.forward_with_taps(mx.array(ids, dtype=mx.int32), layout, cache, taps)
    want = np.concatenate([states[t + 1][0].numpy() for t in taps], axis=-1)
    assert rel_err(got, want) <= 1e-4
