"""Speculative decoding (DFlash drafter + target verification) on a tiny random Qwen3.5 and a tiny random
drafter in the published layout (CPU): greedy outputs equal plain decoding whatever the acceptance,
candidate and replayed GDN states commit exactly, drafter context tracks kv_valid; the knobs. Sampling:
test_spec_sampling.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_checkpoints import write_tiny_drafter
from engine_checks import (assert_drafter_context, assert_idle, assert_reference, greedy, in_flight_verifications,
                           on_cpu, run_arrivals, run_checking_drafter_context)
from hf_checkpoints import random_token_ids
from mtlqwen import SeqLayout
from mtlqwen.model.dflash import DrafterCache, load_drafter
from mtlqwen.model.cache import ModelCache
from mtlqwen.model.qwen35 import VERIFY_COMMITS
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool
from mtlqwen.runtime import speculative
from mtlqwen.runtime.speculative import REPLAY_MIN_ROWS, commit_mode_for, resolve_n_draft

@pytest.fixture(scope="module")
def draft_dir(ckpt, tmp_path_factory):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2, block_size=16)


@pytest.fixture(scope="module")
def drafter(draft_dir, model):
    return load_drafter(draft_dir, model)


@pytest.fixture(params=VERIFY_COMMITS)
def verify_commit(request):
    """Runs the test once per commit mode of verified GDN states."""
    return request.param


class Oracle:
    """A proposer that knows each request's plain greedy continuation (`ref`: prompt -> full tokens) and
    proposes it, each draft replaced by a wrong token with probability `noise` (0: full acceptance)."""

    def __init__(self, ref, noise: float = 0.0, seed: int = 0, vocab: int = 512):
        """ref: (prompt, full tokens) pairs; requests that share a prompt share its longest continuation
        (a shorter one, from a smaller max_tokens, would leave the longer request without proposals)."""
        self.ref: dict = {}
        for p, full in ref.items() if isinstance(ref, dict) else ref:
            if len(full) > len(self.ref.get(tuple(p), ())):
                self.ref[tuple(p)] = full
        self.noise, self.rng, self.vocab = noise, np.random.default_rng(seed), vocab

    def __call__(self, seqs, layout, n):
        rows = []
        for s in seqs:
            full = self.ref[tuple(s.seq.tokens[: s.seq.prompt_len])]
            r = list(full[s.start + 1 : s.start + 1 + n])
            r += [int(self.rng.integers(self.vocab)) for _ in range(n - len(r))]
            rows.append([int(self.rng.integers(self.vocab)) if self.rng.random() < self.noise else t for t in r])
        return mx.array(rows, dtype=mx.int32), None


def plain_outputs(model, prompts, sps, **kw):
    return Engine(model, prefix_interval=0, **kw).generate(prompts, sps)


# ------------------------------------------------------------------------------- model: candidate states
# The commit tests' case: slot 1 holds a 21-token prompt and verifies an anchor + 4 drafts, alone or beside
# slot 2's 30-token prefill chunk (mixed). Each step is evaluated, as the engine does (design.md, "In-place
# writes": on CUDA a pool written in place must not be read in the same evaluation).
BT, VER = 16, [7, 9, 11, 13, 15]
PROMPT, OTHER = random_token_ids(21, 512, seed=1), random_token_ids(30, 512, seed=2)


def prefilled(model) -> ModelCache:
    c = model.make_cache(8, 3, BT)
    model.hidden(mx.array(PROMPT, dtype=mx.int32), SeqLayout([0, 21], [0], [[3, 4]], [1], BT), c)
    mx.eval(c.arrays())
    return c


def verification(mixed: bool) -> tuple[SeqLayout, list[int]]:
    if mixed:
        return SeqLayout([0, 30, 35], [0, 21], [[0, 1], [3, 4]], [2, 1], BT, verify=[False, True]), OTHER + VER
    return SeqLayout([0, 5], [21], [[3, 4]], [1], BT, verify=[True]), VER


def plain_run(model, k: int) -> tuple[ModelCache, mx.array]:
    """Slot 1 after a plain forward over the anchor + k drafts: (its cache, the logits)."""
    ref = prefilled(model)
    logits = model.forward(mx.array(VER[: k + 1], dtype=mx.int32), SeqLayout([0, k + 1], [21], [[3, 4]], [1], BT), ref)
    mx.eval(logits, ref.arrays())
    return ref, logits


@pytest.mark.parametrize("k", [0, 2, 4])
def test_commit_candidates_equals_plain_run_exactly(model, verify_commit, k):
    """A batch of a prefill chunk + a verification of anchor + 4 drafts; after committing k accepted drafts
    (candidate states or a replay) the slot's conv and recurrent states equal a plain run over anchor + k
    drafts, bit for bit, and the other sequence's state and every logit row are those of plain runs."""
    c = prefilled(model)
    lay, toks = verification(mixed=True)
    with pytest.raises(ValueError, match="forward_verifying"):  # a plain forward cannot stash the states
        model.forward(mx.array(toks, dtype=mx.int32), lay, model.make_cache(8, 3, BT))
    logits, taps, stash = model.forward_verifying(mx.array(toks, dtype=mx.int32), lay, c, verify_commit=verify_commit)
    assert taps is None and stash.mode == verify_commit and sorted(stash.layers) == list(range(len(model.gdn_mixers)))
    assert stash.layout.query_start_loc == [0, 5] and stash.layout.state_rows == [1]  # the verifying sequence alone
    mx.eval(logits, c.arrays())
    model.commit_candidates(c, stash, [k])
    mx.eval(c.arrays())
    ref, ref_logits = plain_run(model, k)
    alone = model.make_cache(8, 3, BT)
    alone_logits = model.forward(mx.array(OTHER, dtype=mx.int32), SeqLayout([0, 30], [0], [[0, 1]], [2], BT), alone)
    for pools, ref_pools, alone_pools in ((c.conv_states, ref.conv_states, alone.conv_states),
                                          (c.rec_states, ref.rec_states, alone.rec_states)):
        for p, r, a in zip(pools, ref_pools, alone_pools):
            assert np.array_equal(np.array(p[1]), np.array(r[1]))
            assert np.array_equal(np.array(p[2]), np.array(a[2]))
    assert np.array_equal(np.array(logits[30 : 31 + k]), np.array(ref_logits))
    assert np.array_equal(np.array(logits[:30]), np.array(alone_logits))
    assert stash.committed
    with pytest.raises(RuntimeError, match="committed already"):
        model.commit_candidates(c, stash, [k])


@pytest.mark.parametrize("mixed", [False, True])
def test_commit_writes_the_verified_conv_rows(model, verify_commit, mixed):
    """The commit on any back-end (the CUDA pick kernel writes the pools in place): after k accepted drafts
    the slot's conv rows are the last K-1 of (its old rows, the verification's raw rows 0..k), exactly (a
    copy); its recurrent state is the plain run's (exact on the CPU; on a GPU the verification's kernels
    differ from the decode kernels, within 1e-3)."""
    exact = on_cpu()
    lay, toks = verification(mixed)
    for k in range(len(VER)):
        c = prefilled(model)
        old = [np.array(p[1]) for p in c.conv_states]
        logits, _, stash = model.forward_verifying(mx.array(toks, dtype=mx.int32), lay, c, verify_commit=verify_commit)
        mx.eval(logits, c.arrays(), [part.raw for part in stash.layers.values()])
        raw = {i: np.array(part.raw) for i, part in stash.layers.items()}
        assert all(r.shape == (len(VER), old[i].shape[1]) for i, r in raw.items())
        model.commit_candidates(c, stash, [k])
        mx.eval(c.arrays())
        ref, _ = plain_run(model, k)
        for i in raw:
            want = np.concatenate([old[i], raw[i][: k + 1]])[-old[i].shape[0]:]
            assert np.array_equal(np.array(c.conv_states[i][1]), want), (k, i)
            got, plain = np.array(c.rec_states[i][1]), np.array(ref.rec_states[i][1])
            assert np.array_equal(got, plain) if exact else np.abs(got - plain).max() <= 1e-3 * max(1.0, np.abs(plain).max())


def test_commit_by_device_counts_equals_host_counts(model):
    """Two verifications of 3 and 5 tokens committed in "candidates" mode by the device array of accepted
    counts (as the launched step does), uncompiled and through CompiledDecode.commit (one trace for every
    count), leave the same pools, bit for bit, as by host counts; a replay needs host counts, and a count
    array of the wrong shape is refused."""
    from mtlqwen.model.compiled import CompiledDecode  # noqa: PLC0415

    bt = 16
    prompts = [random_token_ids(n, 512, seed=n) for n in (13, 20)]

    def verified(mode):
        c = model.make_cache(6, 2, bt)
        lay = SeqLayout([0, 13, 33], [0, 0], [[0], [2, 3]], [0, 1], bt)
        model.hidden(mx.array(prompts[0] + prompts[1], dtype=mx.int32), lay, c)
        vl = SeqLayout([0, 3, 8], [13, 20], [[0], [2, 3]], [0, 1], bt, verify=[True, True])
        _, _, stash = model.forward_verifying(mx.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=mx.int32), vl, c,
                                              verify_commit=mode)
        return c, stash

    compiled = CompiledDecode(model)
    for k in ([0, 4], [2, 1], [1, 0]):
        host, hs = verified("candidates")
        model.commit_candidates(host, hs, k)
        dev, ds = verified("candidates")
        model.commit_candidates(dev, ds, mx.array(k, dtype=mx.int32))
        comp, cs = verified("candidates")
        compiled.commit(comp, cs, mx.array(k, dtype=mx.int32))
        assert ds.committed and cs.committed
        for a, b, c in zip(host.arrays(), dev.arrays(), comp.arrays()):
            assert np.array_equal(np.array(a), np.array(b)) and np.array_equal(np.array(a), np.array(c))
    assert compiled.traces == 1
    with pytest.raises(RuntimeError, match="committed already"):
        compiled.commit(comp, cs, mx.array(k, dtype=mx.int32))
    c, stash = verified("replay")
    with pytest.raises(ValueError, match="needs the accepted counts on the host"):
        model.commit_candidates(c, stash, mx.array([0, 0], dtype=mx.int32))
    with pytest.raises(ValueError, match="picks candidates by a device array"):
        compiled.commit(c, stash, mx.array([0, 0], dtype=mx.int32))
    c, stash = verified("candidates")
    with pytest.raises(ValueError, match="expected \\(2,\\)"):
        model.commit_candidates(c, stash, mx.array([0], dtype=mx.int32))
    assert not stash.committed


# ------------------------------------------------------------------------------------- engine: greedy
def test_oracle_drafter_reaches_full_acceptance(model, drafter):
    prompts = [random_token_ids(n, 512, seed=100 + n) for n in (9, 40, 23)]
    n_draft, max_tokens = 4, 11  # 1 plain token, then 2 full steps of 5
    sp = greedy(max_tokens, ignore_eos=True)
    base = plain_outputs(model, prompts, sp, slots=3, step_tokens=32, block_tokens=16, num_blocks=30)
    eng = Engine(model, slots=3, step_tokens=32, block_tokens=16, num_blocks=30, draft=drafter, n_draft=n_draft,
                 prefix_interval=0)
    eng.spec.propose = Oracle({tuple(p): p + o.token_ids for p, o in zip(prompts, base)})
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    s = eng.stats()
    assert s["draft_tokens"] == s["accepted_tokens"] == 3 * 2 * n_draft
    assert s["mean_acceptance_length"] == n_draft + 1 and s["spec_verifications"] == 6
    assert_idle(eng)


def test_garbage_drafter_accepts_about_nothing_and_changes_nothing(model, drafter):
    prompts = [random_token_ids(n, 512, seed=200 + n) for n in (17, 3, 33)]
    sp = greedy(14)
    eng = Engine(model, slots=3, step_tokens=64, block_tokens=16, num_blocks=40, draft=drafter, prefix_interval=0)
    assert eng.spec.n_draft == 15
    oracle = Oracle({}, vocab=512, seed=3)
    eng.spec.propose = lambda seqs, layout, n: (mx.array(oracle.rng.integers(0, 512, (len(seqs), n)), dtype=mx.int32), None)
    outs = eng.generate(prompts, sp)
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 14)
    base = plain_outputs(model, prompts, sp, slots=3, step_tokens=64, block_tokens=16, num_blocks=40)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    s = eng.stats()
    assert s["spec_steps"] > 0 and s["mean_acceptance_length"] < 1.2
    # and the real (random-weight) drafter, through the real drafting path
    eng = Engine(model, slots=3, step_tokens=64, block_tokens=16, num_blocks=40, draft=drafter, n_draft=3)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in base]
    assert eng.stats()["draft_tokens"] > 0


def test_state_and_drafter_context_after_partial_accepts(model, drafter, verify_commit):
    """Each step accepts a different number of drafts (0..n). Whenever a verification is launched, the
    slot's GDN state must be that of a plain token-by-token run over the committed tokens (exact): in
    "candidates" mode the launched step has picked it already (the anchor and its accepted drafts
    included), in "replay" mode it waits for the read-back; the drafter context rows must be exact for
    positions < kv_valid (= the one-shot projection of the committed tokens' taps) and zero past the
    furthest position a verification wrote (anchor + all drafts)."""
    prompt, n_draft, bt = random_token_ids(19, 512, seed=7), 4, 16
    sp = greedy(40, ignore_eos=True)
    (base,) = plain_outputs(model, [prompt], sp, slots=1, step_tokens=32, block_tokens=bt, num_blocks=8)
    full = prompt + base.token_ids
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=bt, num_blocks=8, draft=drafter, n_draft=n_draft,
                 prefix_interval=0, verify_commit=verify_commit)
    calls = []

    def partial(seqs, layout, n):
        j = len(calls) % (n + 1)  # correct drafts this step
        calls.append(j)
        (s,) = seqs
        r = full[s.start + 1 : s.start + 1 + n] + [0] * n
        return mx.array([r[:j] + [(t + 1) % 500 for t in r[j:n]]], dtype=mx.int32), None

    eng.spec.propose = partial
    eng.submit(prompt, sp)
    checked, written = 0, 0
    for ver in in_flight_verifications(eng):
        (s,) = ver.seqs
        P, seq = s.start, s.seq
        picked = verify_commit == "candidates"  # committed in the launched step, by the device's counts
        assert ver.stash.mode == verify_commit and ver.stash.committed == picked
        assert seq.tokens == full[: P + 1]
        end = P + 1 + ver.accepted.item() if picked else P  # the tokens the slot's state has seen
        # plain run: the prompt in one chunk (as the engine did), then one token per step
        ref = model.make_cache(8, 1, bt)
        table = list(range(8))
        model.hidden(mx.array(prompt, dtype=mx.int32), SeqLayout([0, len(prompt)], [0], [table], [0], bt), ref)
        for p in range(len(prompt), end):
            model.hidden(mx.array([full[p]], dtype=mx.int32), SeqLayout([0, 1], [p], [table], [0], bt), ref)
        slot = seq.slot
        for a, b in zip(eng.cache.conv_states + eng.cache.rec_states, ref.conv_states + ref.rec_states):
            assert np.array_equal(np.array(a[slot]), np.array(b[0]))
        written = max(written, P + 1 + ver.n[0])  # this step wrote the anchor's and every draft's row
        assert_drafter_context(eng, seq, P, model, drafter, zero_from=written)
        checked += 1
    assert checked >= 5 and set(calls) >= {0, 1, 2, 3, 4}
    assert eng.stats()["accepted_tokens"] > 0
    assert eng.generate([prompt], sp)[0].token_ids == base.token_ids


def test_drafter_context_through_chunked_prefill_and_prefix_hits(model, drafter):
    """A request that hits the prefix cache (an entry whose last block is partial, so its K/V, drafter
    rows included, are copied) and prefills the rest in chunks, then drafts with the real drafter: its
    drafter context equals the one-shot one whenever it verifies, and its output equals plain decoding."""
    base_prompt = random_token_ids(45, 500, seed=21)
    prompts = [base_prompt, base_prompt[:41] + random_token_ids(30, 500, seed=22)]
    sp = greedy(12, ignore_eos=True)
    plain = plain_outputs(model, prompts, sp, slots=1, step_tokens=16, block_tokens=16, num_blocks=12)
    eng = Engine(model, slots=1, step_tokens=16, block_tokens=16, num_blocks=12, draft=drafter, n_draft=3,
                 prefix_interval=20)
    (first,) = eng.generate(prompts[:1], sp)
    rid = eng.submit(prompts[1], sp)
    outs, checked = run_checking_drafter_context(eng, model, drafter)
    out = outs[rid]
    assert checked >= 3 and eng.stats()["prefix_hits"] == 1 and out.cached_tokens == 40
    assert [first.token_ids, out.token_ids] == [o.token_ids for o in plain]


@st.composite
def spec_workloads(draw):
    slots = draw(st.integers(1, 4))
    n_draft = draw(st.sampled_from([1, 3, 7, 15]))
    shared = random_token_ids(draw(st.integers(0, 40)), 500, seed=draw(st.integers(0, 99)))
    lens = draw(st.lists(st.integers(1, 40), min_size=3, max_size=8))
    reqs = [(draw(st.integers(0, 6)), shared[: draw(st.integers(0, len(shared)))] + random_token_ids(n, 500, seed=s),
             draw(st.integers(1, 24)), draw(st.booleans()))
            for n, s in zip(lens, draw(st.lists(st.integers(0, 2**20), min_size=len(lens), max_size=len(lens))))]
    return dict(
        slots=slots, n_draft=n_draft, reqs=reqs,
        step_tokens=draw(st.integers(slots * (n_draft + 1), max(64, slots * (n_draft + 1)))),
        block_tokens=draw(st.sampled_from([8, 16])),
        prefix_interval=draw(st.sampled_from([0, 16, 24])),
        noise=draw(st.sampled_from([0.0, 0.3, 1.0])),
        extra_blocks=draw(st.integers(0, 12)),
    )


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=spec_workloads())
# found by hypothesis: requests sharing one prompt with different max_tokens (the oracle must propose
# the longest continuation)
@example(w=dict(slots=1, n_draft=1, reqs=[(0, [425], 3, True), (0, [425], 1, False), (0, [425], 1, False)],
                step_tokens=2, block_tokens=8, prefix_interval=0, noise=0.0, extra_blocks=0))
def test_random_workloads_with_speculation_match_plain_decoding(model, drafter, verify_commit, w):
    """Speculating sequences share steps with prefilling ones (arrivals staggered), across block and
    prefix-interval boundaries, with preemptions under tight pools, some requests opted out; outputs
    equal plain decoding token for token except at near-ties."""
    check_workload(model, drafter, verify_commit, w)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=spec_workloads())
def test_compiled_speculative_steps_match_plain_decoding(model, drafter, verify_commit, w):
    """The same workloads with decode-with-taps and all-verify steps through `mx.compile`
    (Engine(compile_decode=True)): a trace replayed at other lengths, tables and acceptances must give
    the uncompiled plain run's tokens."""
    eng = check_workload(model, drafter, verify_commit, w, compile_decode=True, spec_pipeline=False)  # synchronous
    # steps: the host oracle proposes every draft (pipelined steps: tests/test_spec_pipeline.py)
    assert eng.spec.compiled is eng.compiled is not None


def check_workload(model, drafter, verify_commit, w, **engine_kw) -> Engine:
    bt = w["block_tokens"]
    requests = [(arr, p, greedy(mt, speculative=spec)) for arr, p, mt, spec in w["reqs"]]
    need = max(BlockPool.blocks_for(len(p) + sp.max_tokens - 1, bt) for _, p, sp in requests)
    kw = dict(slots=w["slots"], step_tokens=w["step_tokens"], block_tokens=bt, num_blocks=need + w["extra_blocks"])
    base = plain_outputs(model, [p for _, p, _ in requests], [sp for _, _, sp in requests], **kw)
    eng = Engine(model, draft=drafter, n_draft=w["n_draft"], prefix_interval=w["prefix_interval"],
                 verify_commit=verify_commit, **kw, **engine_kw)
    eng.spec.propose = Oracle([(p, p + o.token_ids) for (_, p, _), o in zip(requests, base)], w["noise"])
    outs = dict(enumerate(run_arrivals(eng, requests, max_steps=5000)))
    for (_, prompt, sp), o, b in zip(requests, outs.values(), base):
        if o.token_ids != b.token_ids:
            assert_reference(model, prompt, o, sp.max_tokens)
    s = eng.stats()
    assert s["generated_tokens"] == sum(len(outs[i].token_ids) for i in outs)
    same = all(o.token_ids == b.token_ids for o, b in zip(outs.values(), base))
    # the oracle proposes the plain run's tokens: after a near-tie divergence it proposes the wrong ones
    if w["noise"] == 0.0 and same:  # only drafts past a stop token (no continuation there) fail then
        stopped = sum(outs[i].finish_reason == "stop" for i in outs)
        assert s["accepted_tokens"] >= s["draft_tokens"] - stopped * w["n_draft"]
    assert_idle(eng)
    return eng


def test_compiled_verification_steps(model, drafter, verify_commit):
    """Two requests verifying side by side with an oracle drafter: the all-verify steps run compiled
    (trace keys carry the commit mode), one trace serves steps at growing lengths, and the tokens, the
    acceptance counts and the slots' GDN states equal the uncompiled speculative engine's."""
    prompts = [random_token_ids(n, 512, seed=n) for n in (21, 9)]
    sp = greedy(24, ignore_eos=True)
    base = plain_outputs(model, prompts, sp, slots=2, step_tokens=32, block_tokens=16, num_blocks=12)
    engines = []
    for compiled in (False, True):
        eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=12, draft=drafter, n_draft=3,
                     draft_policy="fixed",  # the GPUs' default is adaptive, with different tables compiled or not
                     prefix_interval=0, verify_commit=verify_commit, compile_decode=compiled,
                     spec_pipeline=False)  # the host oracle proposes (pipelined steps: test_spec_pipeline.py)
        eng.spec.propose = Oracle([(p, p + o.token_ids) for p, o in zip(prompts, base)], 0.0)
        outs = eng.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        engines.append(eng)
    plain, comp = engines
    keys = list(comp.compiled._fns)
    verify_keys = [k for k in keys if k[-1]]
    # anchor + 3 drafts each; shorter runs only where max_tokens caps the drafts
    assert any(k[0] == (0, 4, 8) for k in verify_keys) and all(k[-1] == verify_commit for k in verify_keys), keys
    assert len(verify_keys) < comp.stats()["spec_verifications"] // 2  # fewer traces than verifying steps: replayed
    for key in ("draft_tokens", "accepted_tokens", "spec_verifications", "spec_steps", "plain_steps", "generated_tokens"):
        assert comp.stats()[key] == plain.stats()[key], key
    for a, b in zip(plain.cache.arrays(), comp.cache.arrays()):  # same states and KV (compiled CPU code may fuse)
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-5, atol=1e-5).item()


# ------------------------------------------------------------------------------------ draft lengths
@pytest.mark.parametrize("interval, max_tokens, want", [
    # max_tokens 30 leaves 28, 12 and 4 tokens past the anchor after each step: 15, then 7 (not 12),
    # then 3 (not 4); the last token is a plain decode
    (0, 30, [15, 7, 3]),
    # 24-token snapshot interval: anchor + drafts stay short of positions 24 and 48 (kv_valid 9 -> 13
    # drafts, 17 -> 5, 21 -> 1, 23 -> none: a plain step reaches the boundary), and max_tokens 40 at the end
    (24, 40, [7, 3, 1, 15, 3, 1]),
])
def test_drafts_round_down_to_draft_lengths(model, drafter, interval, max_tokens, want):
    """With full acceptance, each verification sends the largest of 1, 3, 7, 15 that fits what the sequence
    may send (max_tokens, the next interval boundary), exactly; outputs equal plain decoding."""
    prompt = random_token_ids(9, 512, seed=61)
    sp = greedy(max_tokens, ignore_eos=True)
    kw = dict(slots=1, step_tokens=32, block_tokens=8, num_blocks=12)
    (base,) = plain_outputs(model, [prompt], sp, **kw)
    eng = Engine(model, draft=drafter, n_draft=15, prefix_interval=interval, **kw)
    eng.spec.propose = Oracle({tuple(prompt): prompt + base.token_ids})
    eng.submit(prompt, sp)
    seen = [ver.n for ver in in_flight_verifications(eng)]
    assert seen == [[n] for n in want]
    assert eng.stats()["accepted_tokens"] == sum(want)
    assert eng.generate([prompt], sp)[0].token_ids == base.token_ids
    assert_idle(eng)


def test_draft_lengths_of_an_engine_n_draft_off_the_buckets(model, drafter):
    """n_draft 5 counts as a length of its own: a sequence that may send 4 sends 3, one that may send 5+ sends 5."""
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=8, draft=drafter, n_draft=5,
                 prefix_interval=0)
    assert eng.spec.lengths == (1, 3, 5)
    prompt = random_token_ids(9, 512, seed=62)
    sp = greedy(12, ignore_eos=True)
    (base,) = plain_outputs(model, [prompt], sp, slots=1, step_tokens=32, block_tokens=16, num_blocks=8)
    eng.spec.propose = Oracle({tuple(prompt): prompt + base.token_ids})
    eng.submit(prompt, sp)
    # 1 token generated: 5 drafts (6 tokens); 7 generated: 4 may go, 3 do (4 tokens); 11: a plain decode
    assert [ver.n for ver in in_flight_verifications(eng)] == [[5], [3]]
    assert_idle(eng)


# ------------------------------------------------------------------------------------------- knobs
def test_knobs_opt_out_stats_and_memory(model, drafter, draft_dir):
    assert resolve_n_draft(16, None, 8, 128) == 15
    assert resolve_n_draft(16, None, 8, 64) == 7  # capped: 8 slots x 8 tokens fill the step
    assert resolve_n_draft(16, 4, 8, 128) == 4
    # a drafter's own default (the demo pair's 3), capped like the block's; a given value wins
    assert resolve_n_draft(16, None, 8, 128, default=3) == 3
    assert resolve_n_draft(16, None, 8, 24, default=7) == 2
    assert resolve_n_draft(16, 5, 8, 128, default=3) == 5
    for bad in (0, 16, 2.0, True):
        with pytest.raises(ValueError, match="n_draft"):
            resolve_n_draft(16, bad, 8, 128)
    with pytest.raises(ValueError, match="exceeds step_tokens"):
        resolve_n_draft(16, 15, 8, 64)
    # no step_tokens given: the drafter's length, uncapped; the engine's step budget grows to fit it
    assert resolve_n_draft(16, None, 32, None) == 15 and resolve_n_draft(16, None, 32, None, default=7) == 7
    big = Engine(model, slots=12, block_tokens=16, num_blocks=30, draft=drafter, prefix_interval=0)
    assert big.spec.n_draft == 15 and big.step_tokens == 12 * 16 and big.scheduler.step_tokens == 192
    small = Engine(model, slots=12, step_tokens=64, block_tokens=16, num_blocks=30, draft=drafter, prefix_interval=0)
    assert small.spec.n_draft == 4 and small.step_tokens == 64
    assert Engine(model, slots=12, block_tokens=16, num_blocks=30).step_tokens == 128  # no drafter: the default
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(model, num_blocks=8, n_draft=3)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")
    # the pool budget counts the drafter's K/V per bundle
    per = ModelCache.bytes_per_block(model.config, 16, model.dtype) + DrafterCache.bytes_per_block(drafter.config, 16, model.dtype)
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, kv_bytes=20 * per + 1, draft=str(draft_dir), prefix_interval=0)
    assert eng.num_blocks == 20 and eng.spec.n_draft == 15
    # opting out: no drafts, and the request keeps the pipelined plain path
    prompt = random_token_ids(12, 512, seed=5)
    (out,) = eng.generate([prompt], greedy(6, speculative=False))
    assert_reference(model, prompt, out, 6)
    s = eng.stats()
    assert s["draft_tokens"] == s["accepted_tokens"] == s["spec_steps"] == s["spec_verifications"] == 0
    assert s["mean_acceptance_length"] == 0 and s["plain_decodes"] == 5  # 6 tokens: the first from the prefill
    (out,) = eng.generate([prompt], greedy(6))
    assert_reference(model, prompt, out, 6)
    s = eng.stats()
    v = s["spec_verifications"]
    assert s["spec_steps"] > 0 and s["mean_acceptance_length"] == (s["accepted_tokens"] + v) / v
    # padded steps: the dummy sequence never verifies and never disturbs the others
    prompts = [prompt, random_token_ids(29, 512, seed=6)]
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=12, pad_buckets=True, draft=drafter, n_draft=5)
    outs = eng.generate(prompts, greedy(9))
    assert eng.stats()["padding_tokens"] > 0 and eng.stats()["spec_steps"] > 0
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 9)


def test_verify_commit_knob(model, drafter, monkeypatch):
    """Unknown modes are refused by the engine and by a verifying forward; a given mode is used by every
    verification of that engine; without one the engine picks per step from its verify rows (replay from
    REPLAY_MIN_ROWS = sequences x (drafts + 1))."""
    assert REPLAY_MIN_ROWS == 65
    assert [commit_mode_for(n) for n in (1, 8, 15)] == ["candidates"] * 3  # one sequence: 16 rows at most
    assert [commit_mode_for(n, s) for n, s in ((7, 8), (15, 4), (3, 16), (15, 8), (3, 17), (7, 32))] == \
        ["candidates"] * 3 + ["replay"] * 3
    monkeypatch.setattr(speculative, "REPLAY_MIN_ROWS", 10)  # one sequence of 9+ drafts replays below
    with pytest.raises(ValueError, match="verify_commit must be one of"):
        Engine(model, num_blocks=8, draft=drafter, verify_commit="rerun")
    with pytest.raises(ValueError, match="verify_commit needs a drafter"):
        Engine(model, num_blocks=8, verify_commit="replay")
    c = model.make_cache(4, 2, 16)
    lay = SeqLayout([0, 3], [0], [[0]], [0], 16, verify=[True])
    for bad in ("Replay", "", None):
        with pytest.raises(ValueError, match="verify_commit must be one of"):
            model.forward_verifying(mx.array([1, 2, 3], dtype=mx.int32), lay, c, verify_commit=bad)
    prompt = random_token_ids(9, 512, seed=3)
    for given, n_draft in (("replay", 2), ("candidates", 12), (None, 2), (None, 10)):
        eng = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=8, draft=drafter,
                     n_draft=n_draft, prefix_interval=0, verify_commit=given)
        eng.submit(prompt, greedy(n_draft + 6, ignore_eos=True))  # drafts shrink near max_tokens
        seen = []  # (mode of the stash in flight, that verification's drafts)
        while eng.has_work():
            eng.step()
            if eng._inflight is not None and eng._inflight.spec is not None:
                seen.append((eng._inflight.spec.stash.mode, max(eng._inflight.spec.n)))
        want = [(given or commit_mode_for(n), n) for _, n in seen]
        assert seen and seen == want, (given, n_draft, seen)
        if given is None and n_draft == 10:  # long runs replay (11 rows), the short last ones do not
            assert {m for m, _ in seen} == {"replay", "candidates"}, seen


def test_server_passes_draft_to_the_engine(draft_dir, ckpt):
    import argparse  # noqa: PLC0415

    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    args = argparse.Namespace(draft=str(draft_dir), prefix_interval=None, slots=2, step_tokens=32, prefill_step_tokens=None, block_tokens=16,
                              num_blocks=20, max_model_len=None)
    kw = _engine_kwargs(args)
    assert kw["draft"] == str(draft_dir)
    eng = Engine(str(ckpt), **kw)
    assert eng.spec is not None and eng.spec.drafter.source == str(draft_dir)
