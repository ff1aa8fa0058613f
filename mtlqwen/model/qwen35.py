"""The Qwen3.5 text decoder as an MLX graph over a packed batch.

A forward consumes the new tokens of several sequences concatenated ([T] ids), a `SeqLayout` that
says where each sequence's tokens, cached length, KV blocks and GDN state slot are, and a `ModelCache`.
Chunked prefill, decode and multi-token verification are all this one call.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..kernels import (
    LinearParams,
    RopeTables,
    SeqLayout,
    add_rms_norm,
    attention_prep,
    causal_conv1d,
    gated_delta_packed,
    gated_delta_packed_candidates,
    gated_delta_packed_candidates_normed,
    gated_delta_packed_normed,
    gated_head_norm,
    gdn_in_proj_conv,
    linear,
    linear_add_rms_norm,
    linear_multi,
    moe_experts,
    moe_experts_add_rms_norm,
    moe_router_route,
    paged_attention_gated,
    rms_norm,
    swiglu_linear,
    write_kv,
)
from ..kernels.selection import SELECT
from .cache import GDNStash, ModelCache, VerifyStash
from .config import Qwen35Config
from .gdn_taps import has_taps, tapped_gdn
from .sharding import Shard, embed_vocab, gather_vocab
from .verify import VERIFY_COMMITS, VerifySplit, commit_candidates, pick_candidates


def _lin(w: dict[str, mx.array], name: str, config) -> LinearParams:
    """A LinearParams from the weight dict; quantized when `<name>.scales` exists (mlx-lm's rule).
    `config` is any config with `quantization` / `quant_overrides` (target or drafter)."""
    weight = w[f"{name}.weight"]
    if f"{name}.scales" not in w:
        return LinearParams(weight)
    spec = config.quant_overrides.get(name, config.quantization)
    return LinearParams(weight, w[f"{name}.scales"], w[f"{name}.biases"], spec.bits, spec.group_size)


def _eval_points(layout: SeqLayout, rows: int, n: int) -> frozenset[int]:
    """Layer counts after which an eager forward of n layers evaluates what it built so far (mx.async_eval):
    every SELECT "prefill_eval_layers" layers; with "prefill_eval_first" also after that many layers, so the
    device starts while the host builds the rest of the first group; with "prefill_eval_tail" the last group
    halved down to one layer (8 + 8 + 8 + 4 + 2 + 1 + 1 for 32 layers), since the step ends when the device
    finishes the group the host built last. Empty when off, below "prefill_eval_min_rows", or in an
    mx.compile trace (a traced layout), where nothing can be evaluated."""
    every = SELECT["prefill_eval_layers"]
    if every <= 0 or layout.traced or rows < SELECT["prefill_eval_min_rows"]:
        return frozenset()
    first = {SELECT["prefill_eval_first"]} - {0}
    if not SELECT["prefill_eval_tail"]:
        return frozenset(p for p in first.union(range(every, n, every)) if 0 < p < n)
    points, k = [], 0
    while n - k > every:
        k += every
        points.append(k)
    while n - k > 1:  # the last group halved: the host builds it while the device runs the one before
        k += (n - k) // 2
        points.append(k)
    return frozenset(p for p in first.union(points) if 0 < p < n)


class GDNMixer:
    """Gated DeltaNet mixer (§2): projections, conv + SiLU, gated delta rule, gated RMSNorm; returns out_proj's
    input [T, value_dim] (the decoder layer runs out_proj fused with the residual add and the next norm)."""

    def __init__(self, w, prefix: str, c: Qwen35Config, state_index: int):
        self.c, self.idx = c, state_index
        self.in_proj_qkv = _lin(w, f"{prefix}.in_proj_qkv", c)
        self.in_proj_z = _lin(w, f"{prefix}.in_proj_z", c)
        self.in_proj_b = _lin(w, f"{prefix}.in_proj_b", c)
        self.in_proj_a = _lin(w, f"{prefix}.in_proj_a", c)
        self.conv_w = w[f"{prefix}.conv1d.weight"]  # [conv_dim, K]
        self.A_log, self.dt_bias = w[f"{prefix}.A_log"], w[f"{prefix}.dt_bias"]
        self.norm_w = w[f"{prefix}.norm.weight"]
        self.out_proj = _lin(w, f"{prefix}.out_proj", c)
        self.heads = (c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim)

    def __call__(self, x: mx.array, layout: SeqLayout, cache: ModelCache, stash: VerifyStash | None = None):
        """-> o_proj's input [T, value_dim]. stash: where a batch holding verifications puts this layer's
        part (forward_verifying's)."""
        c, T = self.c, x.shape[0]
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        projs = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        verifying = layout.verify is not None and any(layout.verify)
        if has_taps(layout) or verifying:
            # one launch for the four projections of x at decode sizes; mixed [T, conv_dim]: q | k | v
            # channels; z [T, value_dim]; b, a [T, Hv]
            mixed, z, b, a = linear_multi(x, projs)
            if has_taps(layout):  # a prefill chunk across snapshot boundaries: the delta rule in pieces
                if verifying:
                    raise ValueError("a batch with verifications takes no state taps (the scheduler cuts its chunks)")
                return tapped_gdn(self, mixed, z, a, b, layout, cache)
            return self._mix_verifying(mixed, z, a, b, layout, cache, stash)
        conv_pool, rec_pool = cache.conv_states[self.idx], cache.rec_states[self.idx]
        # the projections and the conv (one launch at decode rows where qmv_conv_epilogue allows): y [T,
        # conv_dim] the conv output the delta rule reads
        (y, z, b, a), conv_new = gdn_in_proj_conv(x, projs, self.conv_w, conv_pool, layout)
        # the delta rule and the gated RMSNorm (one launch where gdn_fused_norm allows): o [T, value_dim]
        o, rec_new = gated_delta_packed_normed(y, z, self.norm_w, c.rms_norm_eps, a, b, self.A_log, self.dt_bias,
                                               rec_pool, layout, (Hk, dk, Hv, dv), write_state=True)
        # A pool a kernel wrote in place (None above) is the same MLX array with new contents, and MLX orders
        # kernels only through data. So the cache gets a handle that depends on an output of the writing
        # launch (y, o: the kernel has run when they exist; `mx.depends` shares the pool's buffer, no copy):
        # every later reader -- this step's prefix-cache captures, commit_candidates, the next step's
        # kernels, the engine's evaluation of cache.arrays() -- then follows the write, and evaluating the
        # cache runs the write even in a step whose hidden states nobody reads (mid-prompt chunks).
        rows = layout.array("state_rows")
        if conv_new is None and rec_new is None:  # one Depends node for both (a graph node costs host time)
            cache.conv_states[self.idx], cache.rec_states[self.idx] = mx.depends([conv_pool, rec_pool], [y, o])
        else:
            if conv_new is None:
                cache.conv_states[self.idx] = mx.depends(conv_pool, y)
            else:
                conv_pool[rows] = conv_new
            if rec_new is None:
                cache.rec_states[self.idx] = mx.depends(rec_pool, o)
            else:
                rec_pool[rows] = rec_new
        return o

    def _mix_verifying(self, mixed, z, a, b, layout: SeqLayout, cache: ModelCache, stash: VerifyStash) -> mx.array:
        """The conv, delta rule and gated RMSNorm of a batch holding verifications -> [T, value_dim]. Plain
        sequences commit their new state; verifying ones leave the pools alone and put (rec, raw verify rows
        [Tv, C]) in `stash` for `Qwen35Model.commit_candidates`, where rec is all states [Tv, Hv, dv, dk]
        ("candidates") or the verify rows' (y, a, b) ("replay"); the commit reads their old conv rows from
        the pool. Every sequence verifying (the steady state): the norm inside the delta rule's launch."""
        sp = VerifySplit.of(layout)
        conv_pool, rec_pool = cache.conv_states[self.idx], cache.rec_states[self.idx]
        y, conv_new = causal_conv1d(mixed, self.conv_w, conv_pool, layout)  # every row's conv output is final
        heads, eps = self.heads, self.c.rms_norm_eps
        stash.layout = sp.verify
        if sp.all:  # y [T, 2*Hk*dk + Hv*dv]: the kernels read q | k | v where they lie; mixed: the raw rows
            if stash.mode == "replay":  # outputs only; the states come from the replay at commit
                o, _ = gated_delta_packed_normed(y, z, self.norm_w, eps, a, b, self.A_log, self.dt_bias, rec_pool,
                                                 sp.verify, heads)
                rec = (y, a, b)
            else:
                o, _, rec = gated_delta_packed_candidates_normed(y, z, self.norm_w, eps, a, b, self.A_log,
                                                                 self.dt_bias, rec_pool, sp.verify, heads)
            stash.layers[self.idx] = GDNStash(rec, mixed)  # the old conv rows stay in the pool until the commit
            return o
        vr = sp.verify_rows
        ins, raw = (y[vr], a[vr], b[vr]), mixed[vr]  # the verify rows' conv outputs, a, b; their conv inputs
        if stash.mode == "replay":
            o_v, _ = gated_delta_packed(*ins, self.A_log, self.dt_bias, rec_pool, sp.verify, heads)
            rec = ins
        else:
            o_v, _, rec = gated_delta_packed_candidates(*ins, self.A_log, self.dt_bias, rec_pool, sp.verify, heads)
        stash.layers[self.idx] = GDNStash(rec, raw)
        pr = sp.plain_rows
        o_p, rec_p = gated_delta_packed(y[pr], a[pr], b[pr], self.A_log, self.dt_bias, rec_pool, sp.plain, heads)
        conv_pool[sp.plain_slots] = conv_new[sp.plain_seqs]
        rec_pool[sp.plain_slots] = rec_p
        return gated_head_norm(mx.concatenate([o_p, o_v])[sp.inverse], z, self.norm_w, eps, heads)  # o [T, Hv, dv]


class AttentionMixer:
    """Gated full attention (§3): per-head q|gate, (1+w) q/k norms, partial RoPE, paged GQA, sigmoid gate;
    returns o_proj's input [T, nH * hd] (`out_proj` is the checkpoint's o_proj)."""

    def __init__(self, w, prefix: str, c: Qwen35Config, kv_index: int, rope: RopeTables):
        self.c, self.idx, self.rope = c, kv_index, rope
        self.q_proj = _lin(w, f"{prefix}.q_proj", c)
        self.k_proj = _lin(w, f"{prefix}.k_proj", c)
        self.v_proj = _lin(w, f"{prefix}.v_proj", c)
        self.out_proj = _lin(w, f"{prefix}.o_proj", c)
        self.q_norm, self.k_norm = w[f"{prefix}.q_norm.weight"], w[f"{prefix}.k_norm.weight"]

    def __call__(self, x: mx.array, layout: SeqLayout, cache: ModelCache) -> mx.array:
        c, T = self.c, x.shape[0]
        nH, nKV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg, k, v = linear_multi(x, [self.q_proj, self.k_proj, self.v_proj])
        qg = qg.reshape(T, nH, 2 * hd)  # per head: query then gate (attention reads the gate half in place)
        k, v = k.reshape(T, nKV, hd), v.reshape(T, nKV, hd)
        pos = layout.array("positions")
        kp, vp = cache.k_pools[self.idx], cache.v_pools[self.idx]
        # q / k norm + RoPE and, on GPUs, the in-place KV write (no pool copy): one launch where it runs
        q, k, written = attention_prep(qg, k, v, self.q_norm, self.k_norm, c.rms_norm_eps, pos, self.rope, hd,
                                       kp, vp, layout)
        if written is None:
            kp, vp = write_kv(kp, vp, k, v, layout)
            cache.k_pools[self.idx], cache.v_pools[self.idx] = kp, vp
        else:  # the cache's handles follow the write (as GDNMixer's): evaluating the cache runs it, even
            # in a mid-prompt step whose hidden states nobody reads
            cache.k_pools[self.idx], cache.v_pools[self.idx] = mx.depends([kp, vp], written)
        o = paged_attention_gated(q, kp, vp, layout, 1.0 / math.sqrt(hd), qg, after=written)
        return o.reshape(T, nH * hd)


class DenseMLP:
    def __init__(self, w, prefix: str, c: Qwen35Config):
        self.gate_proj = _lin(w, f"{prefix}.gate_proj", c)
        self.up_proj = _lin(w, f"{prefix}.up_proj", c)
        self.down_proj = _lin(w, f"{prefix}.down_proj", c)

    def __call__(self, x: mx.array) -> mx.array:
        return linear(swiglu_linear(x, self.gate_proj, self.up_proj), self.down_proj)

    def add_norm(self, x: mx.array, h: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h + mlp(x), rms_norm(h + mlp(x)) * w), down_proj carrying the add and the norm."""
        return linear_add_rms_norm(swiglu_linear(x, self.gate_proj, self.up_proj), self.down_proj, h, w, eps)


class MoEBlock:
    """fp32 softmax router, top-k renormalised, SwiGLU experts, sigmoid-gated shared expert (§4)."""

    def __init__(self, w, prefix: str, c: Qwen35Config):
        self.k = c.num_experts_per_tok
        self.router = _lin(w, f"{prefix}.gate", c)
        self.gate_proj = _lin(w, f"{prefix}.switch_mlp.gate_proj", c)
        self.up_proj = _lin(w, f"{prefix}.switch_mlp.up_proj", c)
        self.down_proj = _lin(w, f"{prefix}.switch_mlp.down_proj", c)
        self.shared = DenseMLP(w, f"{prefix}.shared_expert", c)
        self.shared_gate = _lin(w, f"{prefix}.shared_expert_gate", c)

    def _routed(self, x: mx.array):
        # the router, the shared expert's gate and the routing: one launch at decode sizes. Qwen3.5 MoE
        # configs have no norm_topk_prob: the top-k weights are always renormalised (§1.2)
        inds, weights = moe_router_route(x, self.router, self.shared_gate, self.k, True)  # [T, k], [T, k + 1] fp32
        sh = self.shared
        return (x, self.gate_proj, self.up_proj, self.down_proj, inds, weights,
                (sh.gate_proj, sh.up_proj, sh.down_proj))

    def __call__(self, x: mx.array) -> mx.array:
        return moe_experts(*self._routed(x))

    def add_norm(self, x: mx.array, h: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """(h + moe(x), rms_norm(h + moe(x)) * w): at decode sizes the experts' down launch carries it."""
        return moe_experts_add_rms_norm(*self._routed(x), h, w, eps)


class DecoderLayer:
    """Pre-norm block. The residual adds are fused with the projection before them and the norm after
    them (out_proj + add + post-attention norm; down_proj + add + the next layer's input norm), so a layer
    takes and returns (h, normed h)."""

    def __init__(self, w, i: int, c: Qwen35Config, mixer, group=None):
        p = f"model.layers.{i}"
        self.group = group  # tensor parallel: the blocks return partial sums, all-reduced here
        self.kind = c.layer_types[i]
        self.input_norm = w[f"{p}.input_layernorm.weight"]
        self.post_norm = w[f"{p}.post_attention_layernorm.weight"]
        self.mixer = mixer
        self.mlp = MoEBlock(w, f"{p}.mlp", c) if c.is_moe else DenseMLP(w, f"{p}.mlp", c)
        self.eps = c.rms_norm_eps

    def __call__(self, h, x, layout: SeqLayout, cache: ModelCache, next_norm: mx.array, stash=None):
        """h: residual stream [T, H]; x: input_layernorm(h). Returns (new h, next_norm(new h)).
        stash: a verifying forward's, filled by the GDN layers (attention needs no undo: kv_valid)."""
        o = self.mixer(x, layout, cache, stash) if self.kind == "linear_attention" else self.mixer(x, layout, cache)
        if self.group is not None:  # one all_sum per mixer and per MLP; the fused add+norm cannot carry it
            g = self.group
            h, x = add_rms_norm(h, mx.distributed.all_sum(linear(o, self.mixer.out_proj), group=g),
                                self.post_norm, self.eps)
            return add_rms_norm(h, mx.distributed.all_sum(self.mlp(x), group=g), next_norm, self.eps)
        h, x = linear_add_rms_norm(o, self.mixer.out_proj, h, self.post_norm, self.eps)
        return self.mlp.add_norm(x, h, next_norm, self.eps)


class Qwen35Model:
    """The decoder. `weights` uses mtlqwen's internal names (`model.layers.N....`, `lm_head`), with the
    mlx-lm conventions: (1+w) folded into zero-centred norms, conv weight [C, K].

    A batch with verifying sequences (SeqLayout.verify) runs through `forward_verifying`, which returns the
    VerifyStash that `commit_candidates` applies; the plain forwards refuse such a batch.
    verify_commit (one of VERIFY_COMMITS, an argument of forward_verifying): what the stash holds for
    `commit_candidates`. "candidates" writes the state after every verified token,
    (n_draft + 1) states of traffic per layer and sequence; "replay" keeps only the verify rows' inputs and
    reruns anchor + accepted drafts from the pre-step state at commit (a second, shorter delta-rule pass)."""

    def __init__(self, config: Qwen35Config, weights: dict[str, mx.array], group=None, full_config=None):
        """group: an mx.distributed group of size > 1 for tensor parallelism, with `config` and `weights`
        this rank's shard (sharding.py) and `full_config` the checkpoint's; None: one process."""
        self.config, self.weights = config, weights
        self.group, self.full_config = group, full_config or config
        self.shard = Shard(group.rank(), group.size()) if group is not None else Shard(0, 1)
        c = config
        self.rope = RopeTables(c.rotary_dim, c.rope_theta)
        self.embed = _lin(weights, "model.embed_tokens", c)
        self.lm_head = self.embed if c.tie_word_embeddings else _lin(weights, "lm_head", c)
        self.final_norm = weights["model.norm.weight"]
        self.layers: list[DecoderLayer] = []
        self.gdn_mixers: list[GDNMixer] = []  # by state index: a replay needs each layer's gate parameters
        n_attn = 0
        for i, kind in enumerate(c.layer_types):
            if kind == "linear_attention":
                mixer = GDNMixer(weights, f"model.layers.{i}.linear_attn", c, len(self.gdn_mixers))
                self.gdn_mixers.append(mixer)
            else:
                mixer = AttentionMixer(weights, f"model.layers.{i}.self_attn", c, n_attn, self.rope)
                n_attn += 1
            self.layers.append(DecoderLayer(weights, i, c, mixer, group))

    @property
    def dtype(self) -> mx.Dtype:
        e = self.embed
        return e.scales.dtype if e.quantized else e.weight.dtype

    def make_cache(self, num_blocks: int, num_slots: int, block_tokens: int = 128) -> ModelCache:
        return ModelCache(self.config, num_blocks, num_slots, block_tokens, self.dtype)

    def _run(self, input_ids, layout, cache, taps: tuple[int, ...] = (), stash: VerifyStash | None = None):
        """Final-normed hidden states [T, H] and the residual stream after each layer in `taps`; a batch
        with verifying sequences fills `stash` (forward_verifying's)."""
        if stash is None and layout.verify is not None and any(layout.verify):
            raise ValueError("a batch with verifying sequences goes through forward_verifying, which returns "
                             "the stash commit_candidates needs")
        self.rope.ensure(max(kv + layout.q_len(i) for i, kv in enumerate(layout.kv_valid)))
        h = self.embed_rows(input_ids)
        x = rms_norm(h, self.layers[0].input_norm, self.config.rms_norm_eps)
        captured = []
        n = len(self.layers)
        points = _eval_points(layout, input_ids.shape[0], n)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_norm if i + 1 < n else self.final_norm
            h, x = layer(h, x, layout, cache, nxt, stash)
            if i in taps:
                captured.append(h)
            if i + 1 in points:
                mx.async_eval(h, x)  # these layers run while the host builds the next ones
        return x, captured

    def embed_rows(self, ids: mx.array) -> mx.array:
        """Embedding rows [T, H] of token ids [T] (vocab-parallel under a group)."""
        if self.group is None:
            return self.embed.rows(ids)
        return embed_vocab(self.embed, ids, self.config.vocab_size, self.shard, self.group)

    def head(self, h: mx.array) -> mx.array:
        """lm_head: hidden [R, H] -> logits [R, vocab] (gathered over the vocabulary under a group)."""
        if self.group is None:
            return linear(h, self.lm_head)
        return gather_vocab(linear(h, self.lm_head), self.config.vocab_size, self.group)

    def hidden(self, input_ids: mx.array, layout: SeqLayout, cache: ModelCache) -> mx.array:
        """input_ids [T] -> final-normed hidden states [T, H]; writes KV and GDN state into `cache`."""
        return self._run(input_ids, layout, cache)[0]

    def forward(
        self, input_ids: mx.array, layout: SeqLayout, cache: ModelCache, logits_rows: mx.array | None = None,
    ) -> mx.array:
        """Logits [len(logits_rows) or T, vocab] for the packed batch (rows: the packed positions to score)."""
        return self._with_taps(input_ids, layout, cache, (), logits_rows, None)[0]

    def forward_with_taps(
        self, input_ids: mx.array, layout: SeqLayout, cache: ModelCache, taps: tuple[int, ...],
        logits_rows: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Logits as `forward`, plus the outputs of the tap layers (DFlash's `target_layer_ids`,
        i.e. HF hidden_states[L + 1]) concatenated in tap order: [T, len(taps) * H]."""
        return self._with_taps(input_ids, layout, cache, tuple(taps), logits_rows, None)

    def forward_verifying(
        self, input_ids: mx.array, layout: SeqLayout, cache: ModelCache, taps: tuple[int, ...] = (),
        logits_rows: mx.array | None = None, verify_commit: str = "candidates",
    ) -> tuple[mx.array, mx.array | None, VerifyStash]:
        """A batch with verifying sequences (plain ones may ride along): (logits as `forward`, taps as
        `forward_with_taps` or None without taps, the VerifyStash for `commit_candidates`). Plain sequences'
        GDN states are written; verifying ones' wait for the commit."""
        if verify_commit not in VERIFY_COMMITS:
            raise ValueError(f"verify_commit must be one of {VERIFY_COMMITS}, got {verify_commit!r}")
        if layout.verify is None or not any(layout.verify):
            raise ValueError("forward_verifying needs a layout with verifying sequences (SeqLayout.verify)")
        stash = VerifyStash(verify_commit)  # the commit follows its mode
        logits, tapped = self._with_taps(input_ids, layout, cache, tuple(taps), logits_rows, stash)
        return logits, tapped, stash

    def _with_taps(self, input_ids, layout, cache, taps: tuple[int, ...], logits_rows, stash):
        order = sorted(set(taps))
        h, captured = self._run(input_ids, layout, cache, tuple(order), stash)
        by_layer = dict(zip(order, captured))
        if logits_rows is not None:
            h = h[logits_rows]
        tapped = mx.concatenate([by_layer[t] for t in taps], axis=-1) if taps else None
        return self.head(h), tapped

    def commit_candidates(self, cache: ModelCache, stash: VerifyStash, accepted: list[int] | mx.array) -> None:
        """Apply what forward_verifying returned (verify.commit_candidates): each verifying sequence keeps
        its GDN and conv state after its anchor and first accepted[j] drafts."""
        commit_candidates(self, cache, stash, accepted)

    def pick_candidates(self, cache, layers: dict[int, GDNStash], k: mx.array, starts: mx.array,
                        slots: mx.array) -> None:
        """The "candidates" commit from arrays alone (verify.pick_candidates; a compiled trace runs it)."""
        pick_candidates(self, cache, layers, k, starts, slots)

    def logits(self, token_ids) -> mx.array:
        """One sequence from an empty state, in one pass: [T, vocab]. The reference every schedule must match."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("logits() needs at least one token")
        bt = 128
        nb = -(-len(ids) // bt)
        cache = self.make_cache(num_blocks=nb, num_slots=1, block_tokens=bt)
        layout = SeqLayout([0, len(ids)], [0], [list(range(nb))], [0], bt)
        return self.forward(mx.array(ids, dtype=mx.int32), layout, cache)
