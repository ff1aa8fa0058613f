"""The compiled decode step (model/compiled.py) on CPU: mx.compile over the reference ops. A trace is
replayed with other slots, lengths and block tables than the ones it was traced with, so any value
baked into it would show up as a wrong token here."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtlqwen.model.compiled import CompiledDecode
from mtlqwen.runtime import Engine

from engine_checks import assert_idle, assert_reference, greedy, run_arrivals
from hf_checkpoints import random_token_ids


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=2, max_size=7),
    arrivals=st.lists(st.integers(0, 30), min_size=7, max_size=7),
    slots=st.integers(1, 4),
    block_tokens=st.sampled_from([16, 32]),
)
def test_compiled_decode_matches_each_request_alone(model, lens, arrivals, slots, block_tokens):
    reqs = [(arrivals[i], random_token_ids(n, 512, seed=n + i), greedy(12 + i)) for i, n in enumerate(lens)]
    eng = Engine(model, slots=slots, step_tokens=64, block_tokens=block_tokens, num_blocks=256,
                 compile_decode=True, prefix_interval=0)
    outs = run_arrivals(eng, reqs)
    for (_, prompt, sp), out in zip(reqs, outs):
        assert_reference(model, prompt, out, sp.max_tokens)
    assert_idle(eng)
    # traces are keyed by shape class only: far fewer than the decode steps that used them
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
    assert 1 <= eng.compiled.traces < decode_tokens


def test_one_trace_serves_growing_sequences_until_a_bucket_changes(model):
    """Batch-1 decode from 20 to 60 tokens with 16-token blocks: the block-table width bucket goes
    2 -> 4 (at 33 tokens) and the attention bound stays at 256, so exactly two traces."""
    eng = Engine(model, slots=1, step_tokens=64, block_tokens=16, num_blocks=16, compile_decode=True,
                 prefix_interval=0)
    prompt = random_token_ids(20, 512, seed=3)
    out = eng.generate([prompt], greedy(40, ignore_eos=True))[0]
    assert_reference(model, prompt, out, 40)
    assert eng.compiled.traces == 2
    # (tokens per sequence as query_start_loc, table width, length bucket, RoPE size, block, logits rows,
    #  taps, commit mode)
    r = eng.model.rope.size
    assert list(eng.compiled._fns) == [((0, 1), 2, 256, r, 16, 1, None, None), ((0, 1), 4, 256, r, 16, 1, None, None)]


def test_eligible_only_for_one_token_per_sequence():
    from mtlqwen.kernels import SeqLayout

    assert CompiledDecode.eligible(SeqLayout([0, 1, 2], [5, 9], [[0], [1]], [0, 1]))
    assert not CompiledDecode.eligible(SeqLayout([0, 1, 3], [5, 9], [[0], [1]], [0, 1]))  # a 2-token chunk
    verify = SeqLayout([0, 1, 2], [5, 9], [[0], [1]], [0, 1])
    verify.verify = [True, False]
    assert not CompiledDecode.eligible(verify)


def test_verifications_go_through_verifying_and_only_they(model):
    """A verifying batch never runs through a path that would drop its stash, and `verifying` refuses
    batches in which not every sequence verifies; all refused before any trace is built."""
    import mlx.core as mx  # noqa: PLC0415
    import pytest  # noqa: PLC0415

    from mtlqwen.kernels import SeqLayout  # noqa: PLC0415

    comp, cache, rows = CompiledDecode(model), model.make_cache(4, 2, 16), mx.array([0, 1], dtype=mx.int32)
    ids = mx.array([1, 2], dtype=mx.int32)
    both = SeqLayout([0, 1, 2], [3, 3], [[0], [1]], [0, 1], 16, verify=[True, True])
    mixed = SeqLayout([0, 1, 2], [3, 3], [[0], [1]], [0, 1], 16, verify=[True, False])
    plain = SeqLayout([0, 1, 2], [3, 3], [[0], [1]], [0, 1], 16)
    with pytest.raises(ValueError, match="CompiledDecode.verifying runs the batches with verifying sequences"):
        comp.with_taps(ids, both, cache, (1,), rows)
    for lay in (mixed, plain):
        with pytest.raises(ValueError, match="every sequence verifies"):
            comp.verifying(ids, lay, cache, (1,), rows, "candidates")
    with pytest.raises(ValueError, match="forward_verifying"):
        model.forward_with_taps(ids, both, cache, (1,), rows)
    with pytest.raises(ValueError, match="needs a layout with verifying sequences"):
        model.forward_verifying(ids, plain, cache, (1,), rows)
    with pytest.raises(TypeError, match="VerifyStash"):
        model.commit_candidates(cache, None, [0, 0])
    assert comp.traces == 0


def test_default_is_off_on_the_cpu_references(model):
    assert Engine(model, slots=1, num_blocks=4).compiled is None


def test_compiled_decode_with_the_prefix_cache(model):
    """Compiled decode steps next to prefix-cache captures (evaluated after the step) and restores: the
    second request reuses the first one's 64-token prefix and both match the single-sequence reference."""
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=64, compile_decode=True,
                 prefix_interval=32)
    shared = random_token_ids(70, 512, seed=11)
    first = eng.generate([shared], greedy(10, ignore_eos=True))[0]
    second_prompt = shared[:66] + random_token_ids(5, 512, seed=12)
    second = eng.generate([second_prompt], greedy(10, ignore_eos=True))[0]
    assert_reference(model, shared, first, 10)
    assert_reference(model, second_prompt, second, 10)
    assert second.cached_tokens == 64 and eng.compiled.traces >= 1
    assert_idle(eng)
