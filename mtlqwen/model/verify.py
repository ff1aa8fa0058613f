"""A verification's model side: how a batch with verifying sequences splits for the GDN layers, and the
commit that keeps each verifying sequence's GDN and conv state after its accepted drafts ("candidates":
pick the stored state; "replay": rerun the accepted rows). Qwen35Model.forward_verifying stashes what the
commit reads (cache.VerifyStash); Qwen35Model.commit_candidates / pick_candidates call these."""

from __future__ import annotations

import itertools

import mlx.core as mx

from ..kernels import SeqLayout, gated_delta_packed
from ..kernels.gdn.commit import pick_inplace
from .cache import GDNStash, ModelCache, VerifyStash

# How verified sequences get their GDN state (a verifying forward's verify_commit): "candidates" keeps the
# state after every verified token and picks one; "replay" keeps the inputs and reruns the accepted tokens.
VERIFY_COMMITS = ("candidates", "replay")


class VerifySplit:
    """A batch with verifying sequences, split once per layout (every GDN layer reuses it): the plain
    sequences run `gated_delta_packed` and commit their state at once; the verifying ones run
    `gated_delta_packed_candidates` (or plain `gated_delta_packed` when replaying), so prefill and decode rows
    never pay for per-token states."""

    def __init__(self, layout: SeqLayout):
        ver = [i for i, v in enumerate(layout.verify) if v]
        plain = [i for i, v in enumerate(layout.verify) if not v]
        # every sequence verifying (the steady state): the batch is its own verify layout, no row gathers
        self.all = not plain
        if self.all:
            self.verify, self.plain = layout, None
            return
        self.verify, vrows = layout.subset(ver)
        self.verify_rows = mx.array(vrows, dtype=mx.int32)
        self.plain, prows = layout.subset(plain) if plain else (None, [])
        if plain:
            self.plain_rows = mx.array(prows, dtype=mx.int32)
            self.plain_seqs = mx.array(plain, dtype=mx.int32)
            self.plain_slots = mx.array(self.plain.state_rows, dtype=mx.int32)
        inverse = [0] * layout.num_tokens  # packed row -> its row in [plain rows ; verify rows]
        for j, r in enumerate(prows + vrows):
            inverse[r] = j
        self.inverse = mx.array(inverse, dtype=mx.int32)

    @staticmethod
    def of(layout: SeqLayout) -> VerifySplit:
        return layout.derived("verify_split", lambda: VerifySplit(layout))


def commit_candidates(model, cache: ModelCache, stash: VerifyStash, accepted: list[int] | mx.array) -> None:
    """Apply what forward_verifying returned: verifying sequence j (in layout order) keeps the GDN
    state after its anchor and first accepted[j] drafts; its conv state becomes the last K-1 raw rows
    up to that token. Rejected tokens' K/V need no undo: the runtime does not count them in kv_valid.
    accepted: host counts, or in "candidates" mode the device array [S] int32 the verification computed
    (then the pick is part of the step's graph and nothing waits for the host; its range is verify()'s)."""
    if not isinstance(stash, VerifyStash) or stash.layout is None:
        raise TypeError(f"commit_candidates needs the VerifyStash of a verifying forward, got {stash!r:.80}")
    if stash.committed:
        raise RuntimeError("this verification was committed already")
    lay, mode = stash.layout, stash.mode
    on_device = isinstance(accepted, mx.array)
    if on_device:
        if mode != "candidates":
            raise ValueError("a replay commit reruns accepted + 1 rows: it needs the accepted counts on the host")
        if accepted.shape != (lay.num_seqs,):
            raise ValueError(f"accepted has shape {accepted.shape}, expected ({lay.num_seqs},)")
    elif len(accepted) != lay.num_seqs or any(not 0 <= k < lay.q_len(j) for j, k in enumerate(accepted)):
        raise ValueError(f"accepted {accepted} does not fit verifications of {[lay.q_len(j) for j in range(lay.num_seqs)]} tokens")
    qsl = lay.query_start_loc
    slots = mx.array(lay.state_rows, dtype=mx.int32)
    stash.committed = True
    if mode == "replay":
        # sequence j reruns its first accepted[j] + 1 verify rows from the state its slot still holds
        rows = mx.array([qsl[j] + r for j, k in enumerate(accepted) for r in range(k + 1)], dtype=mx.int32)
        rl = SeqLayout(list(itertools.accumulate((k + 1 for k in accepted), initial=0)), list(lay.kv_valid),
                       lay.block_tables, lay.state_rows, lay.block_tokens)
    k = accepted if on_device else mx.array(accepted, dtype=mx.int32)
    starts = mx.array(qsl[:-1], dtype=mx.int32)
    if mode != "replay":
        pick_candidates(model, cache, stash.layers, k, starts, slots)
        return
    win = conv_window(model.config, k, starts)
    for idx, part in stash.layers.items():
        m = model.gdn_mixers[idx]
        _, new = gated_delta_packed(*(t[rows] for t in part.rec), m.A_log, m.dt_bias, cache.rec_states[idx], rl,
                                    m.heads)
        cache.rec_states[idx][slots] = new
        _commit_conv(cache, idx, part, win, slots)


def pick_candidates(model, cache: ModelCache, layers: dict[int, GDNStash], k: mx.array, starts: mx.array,
                    slots: mx.array) -> None:
    """The "candidates" commit's graph from arrays alone (a compiled trace runs it too): slot slots[j]
    takes the state after row starts[j] + k[j] of every layer's candidates. k, starts, slots: [S] int32."""
    win = last = None  # built once for every layer, and only if some layer needs them (a node costs host time)
    for idx, part in layers.items():
        rec, conv = cache.rec_states[idx], cache.conv_states[idx]
        done = pick_inplace(rec, conv, part.rec, part.raw, k, starts, slots)
        if done is not None:  # written into the pools' buffers: their handles follow the write
            cache.rec_states[idx], cache.conv_states[idx] = mx.depends([rec, conv], [done])
            continue
        if win is None:
            win = conv_window(model.config, k, starts)
            last = starts + k  # each sequence's kept candidate row
        rec[slots] = part.rec[last]  # rec: all states [Tv, Hv, dv, dk]
        _commit_conv(cache, idx, part, win, slots)


def _commit_conv(cache, idx: int, part: GDNStash, win: mx.array, slots: mx.array) -> None:
    pool = cache.conv_states[idx]
    old = pool[slots]  # [S, K-1, C]: the verifying slots' rows as they were before the verification
    S, K1 = old.shape[:2]
    flat = mx.concatenate([old.reshape(S * K1, -1), part.raw.astype(old.dtype)])
    pool[slots] = flat[win].reshape(S, K1, -1)


def conv_window(config, k: mx.array, starts: mx.array) -> mx.array:
    """Rows of [all old conv rows (S x (K-1)) ; all raw verify rows] that hold each sequence's last K-1
    conv inputs after its anchor + k[j] drafts: window row t = k[j] + 1 + r (r < K-1) of [old ; raw_j]
    -> [S * (K-1)] int32, built on the device from k [S] and each verification's first row `starts`."""
    S, K1 = k.shape[0], config.linear_conv_kernel_dim - 1
    t = k[:, None] + 1 + mx.arange(K1, dtype=mx.int32)[None, :]  # [S, K-1]
    old = mx.arange(S, dtype=mx.int32)[:, None] * K1 + t
    return mx.where(t < K1, old, S * K1 + starts[:, None] + t - K1).reshape(-1)
