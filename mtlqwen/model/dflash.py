"""The DFlash drafter (dflash.md §1, §3) as an MLX graph over paged context K/V.

The drafter has no embedding and no head: it borrows the target's. Its per-layer context K/V are written
for committed positions only (`write_context`), into pools that share block ids with the target's KV
(`DrafterCache`), so one bundle id holds a position's target and drafter K/V (§5.1). A draft pass
(`propose`) runs [anchor, MASK x n] per sequence, all speculating sequences packed into one pass; the
block's own K/V are transient and never written.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import mlx.core as mx

from ..kernels import (
    LinearParams,
    RopeTables,
    SeqLayout,
    drafter_attention_prep,
    drafter_context_write,
    linear,
    linear_add_rms_norm,
    rms_norm,
    swiglu_linear,
)
from .cache import ModelCache
from .config import ConfigError, Qwen35Config, read_config_json
from .dflash_config import DFlashConfig, DrafterFitError, parse_dflash_config, rope_frequencies
from .loading import read_safetensors, resolve_model_path
from .quantize import parse_quantize_arg, quantize_weights, validate_quant
from .qwen35 import Qwen35Model, _lin
from .weights import CheckpointError

DRAFTER_PATTERNS = ["*.json", "*.safetensors"]


# ---------------------------------------------------------------------------------------------- checks
def drafter_shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every float tensor of a published drafter checkpoint (§2.2), with its shape."""
    H, hd, I = c.hidden_size, c.head_dim, c.intermediate_size
    q_out, kv_out = c.num_attention_heads * hd, c.num_key_value_heads * hd
    s: dict[str, tuple[int, ...]] = {"fc.weight": (H, c.num_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}"
        s.update({
            f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (q_out, H), f"{p}.self_attn.k_proj.weight": (kv_out, H),
            f"{p}.self_attn.v_proj.weight": (kv_out, H), f"{p}.self_attn.o_proj.weight": (H, q_out),
            f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H), f"{p}.mlp.down_proj.weight": (H, I),
        })
    return s


def _logical_shape(w: dict[str, mx.array], name: str, c: DFlashConfig) -> tuple[int, ...]:
    """The float shape of a tensor, undoing 32/bits packing for quantized modules."""
    shape = tuple(w[name].shape)
    module = name[: -len(".weight")]
    if f"{module}.scales" in w:
        spec = c.quant_overrides.get(module, c.quantization)
        if spec is not None:
            return (*shape[:-1], shape[-1] * 32 // spec.bits)
    return shape


def check_fit(c: DFlashConfig, w: dict[str, mx.array], target: Qwen35Config) -> None:
    """Raise DrafterFitError naming every way the drafter does not fit `target`."""
    problems = []
    if c.hidden_size != target.hidden_size:
        problems.append(f"hidden_size: drafter {c.hidden_size} != target {target.hidden_size} (the drafter "
                        "reads the target's embedding, head and hidden states)")
    bad = [t for t in c.target_layer_ids if not 0 <= t < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} are outside the target's layers 0..{target.num_hidden_layers - 1}")
    if not 0 <= c.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {c.mask_token_id} is outside the target vocabulary (0..{target.vocab_size - 1})")
    if "fc.weight" in w:
        got, want = _logical_shape(w, "fc.weight", c), (c.hidden_size, c.num_taps * c.hidden_size)
        if got != want:
            problems.append(f"fc.weight is {list(got)} but {c.num_taps} tap layers x hidden {c.hidden_size} "
                            f"need {list(want)} (target_layer_ids {list(c.target_layer_ids)})")
    if problems:
        raise DrafterFitError("drafter does not fit the target: " + " | ".join(problems))


def check_drafter_weights(w: dict[str, mx.array], c: DFlashConfig) -> None:
    """Raise CheckpointError naming missing, unexpected or mis-shaped drafter tensors."""
    want = drafter_shapes(c)
    quant = {k[: -len(".scales")] for k in w if k.endswith(".scales")}
    allowed = set(want) | {f"{m}.{s}" for m in quant for s in ("scales", "biases")}
    missing = sorted(k for k in want if k not in w)
    extra = sorted(k for k in w if k not in allowed)
    bad = [f"{k} {list(_logical_shape(w, k, c))} (expected {list(s)})"
           for k, s in want.items() if k in w and _logical_shape(w, k, c) != s]
    problems = []
    for label, items in (("missing tensors", missing), ("unexpected tensors", extra), ("wrong shapes", bad)):
        if items:
            problems.append(f"{label} ({len(items)}): " + ", ".join(items[:12]) + (" ..." if len(items) > 12 else ""))
    if problems:
        raise CheckpointError("drafter checkpoint does not match its config.json: " + " | ".join(problems))


def _warn_if_zero_centred(w: dict[str, mx.array]) -> None:
    """Drafter norms are plain Qwen3 `x̂·w` (weights near 1, §1.4). Weights near 0 would mean a (1+w)
    checkpoint that this loader would silently mis-read; say so."""
    norms = [v for k, v in w.items() if k.endswith("norm.weight")]
    mean = float(mx.mean(mx.stack([mx.mean(mx.abs(v.astype(mx.float32))) for v in norms])))
    if mean < 0.3:
        warnings.warn(f"drafter norm weights average |w| = {mean:.3f}: they look zero-centred ((1+w) convention), "
                      "but DFlash drafters use plain x̂·w norms", stacklevel=3)


# ----------------------------------------------------------------------------------------------- cache
class DrafterCache:
    """Drafter context K/V: per drafter layer K and V pools [num_blocks, block_tokens, nKV_d, hd_d]. Same
    num_blocks / block_tokens as the target's ModelCache, so block id b names a position range in both."""

    def __init__(self, config: DFlashConfig, num_blocks: int, block_tokens: int, dtype: mx.Dtype = mx.bfloat16):
        self.config, self.num_blocks, self.block_tokens, self.dtype = config, num_blocks, block_tokens, dtype
        shape = (num_blocks, block_tokens, config.num_key_value_heads, config.head_dim)
        self.k_pools = [mx.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v_pools = [mx.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        mx.eval(self.k_pools, self.v_pools)

    @classmethod
    def like(cls, config: DFlashConfig, target_cache: ModelCache) -> DrafterCache:
        return cls(config, target_cache.num_blocks, target_cache.block_tokens, target_cache.dtype)

    @staticmethod
    def bytes_per_block(config: DFlashConfig, block_tokens: int, dtype: mx.Dtype = mx.bfloat16) -> int:
        """K + V bytes one bundle adds for the drafter (budget the pool with target + this, §5.1)."""
        return 2 * config.num_key_value_heads * config.head_dim * dtype.size * block_tokens * config.num_hidden_layers

    def reset(self) -> None:
        """Every pool back to zeros (new arrays), as ModelCache.reset."""
        for pools in (self.k_pools, self.v_pools):
            for i, p in enumerate(pools):
                pools[i] = mx.zeros(p.shape, dtype=p.dtype)
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [*self.k_pools, *self.v_pools]


# ----------------------------------------------------------------------------------------------- model
def _stack(parts: list[LinearParams]) -> LinearParams | None:
    """Row-concatenate projections that share an input (quantized ones too: groups run along the input
    dim, so rows stack freely). None when their quantization differs."""
    first = parts[0]
    if any((p.bits, p.group_size, p.quantized) != (first.bits, first.group_size, first.quantized) for p in parts):
        return None
    cat = lambda xs: mx.concatenate(xs, axis=0)  # noqa: E731
    if not first.quantized:
        return LinearParams(cat([p.weight for p in parts]))
    return LinearParams(cat([p.weight for p in parts]), cat([p.scales for p in parts]),
                        cat([p.biases for p in parts]), first.bits, first.group_size)


def _rows(p: LinearParams, start: int, stop: int) -> LinearParams:
    """Output rows start:stop of a projection: a view of the stacked weights, not a copy."""
    if not p.quantized:
        return LinearParams(p.weight[start:stop])
    return LinearParams(p.weight[start:stop], p.scales[start:stop], p.biases[start:stop], p.bits, p.group_size)


class DrafterLayer:
    """Pre-norm Qwen3 block whose attention also sees the paged context K/V (§1.4)."""

    def __init__(self, w, i: int, c: DFlashConfig, kv: LinearParams | None, k: LinearParams, v: LinearParams):
        p = f"layers.{i}"
        self.input_norm, self.post_norm = w[f"{p}.input_layernorm.weight"], w[f"{p}.post_attention_layernorm.weight"]
        self.q_proj, self.o_proj = _lin(w, f"{p}.self_attn.q_proj", c), _lin(w, f"{p}.self_attn.o_proj", c)
        # kv_proj [2 * nKV * hd, H]: k rows then v rows, one GEMM (a view into the stacked context GEMM);
        # None only when k_proj and v_proj are quantized differently, then they run apart.
        self.kv_proj, self.k_proj, self.v_proj = kv, (None if kv is not None else k), (None if kv is not None else v)
        self.kv_width = c.num_key_value_heads * c.head_dim
        self.q_norm, self.k_norm = w[f"{p}.self_attn.q_norm.weight"], w[f"{p}.self_attn.k_norm.weight"]
        self.gate_proj, self.up_proj = _lin(w, f"{p}.mlp.gate_proj", c), _lin(w, f"{p}.mlp.up_proj", c)
        self.down_proj = _lin(w, f"{p}.mlp.down_proj", c)
        self.causal, self.window = c.causal[i], c.window(i)

    def project_kv(self, h: mx.array) -> tuple[mx.array, int, mx.array, int]:
        """h [T, H] -> (k rows, k's offset, v rows, v's offset): rows [T, W] holding nKV x hd values from the
        offset (k before its norm and RoPE), one k|v GEMM's output read in place by the attention."""
        if self.kv_proj is not None:
            kv = linear(h, self.kv_proj)  # [T, 2 * nKV * hd]: k then v
            return kv, 0, kv, self.kv_width
        return linear(h, self.k_proj), 0, linear(h, self.v_proj), 0


class Drafter:
    """A loaded DFlash drafter bound to its target. Weights keep the checkpoint's names; norms are fp32."""

    def __init__(self, config: DFlashConfig, weights: dict[str, mx.array], target: Qwen35Model):
        c = self.config = config
        self.target, self.weights = target, weights
        # drafts a step when Engine(n_draft=None): None = block_size - 1; whoever measured this drafter's
        # acceptance may set fewer (the demo pair: mtlqwen.demo)
        self.default_n_draft: int | None = None
        self.eps = c.rms_norm_eps
        inv_freq, attn_factor = rope_frequencies(c)
        self.rope = RopeTables(c.head_dim, c.rope_theta)
        if c.rope_scaling is not None:
            self.rope.inv_freq = inv_freq
            self.rope._grow(self.rope.size)
        # YaRN scales cos and sin by attn_factor, i.e. every q.k by attn_factor^2: fold it into the softmax
        # scale so the stored context K stay plain rotations (and a rope kernel needs no extra factor).
        self.scale = c.head_dim**-0.5 * attn_factor**2
        self.fc = _lin(weights, "fc", c)
        self.hidden_norm, self.final_norm = weights["hidden_norm.weight"], weights["norm.weight"]
        per_layer = [_lin(weights, f"layers.{i}.self_attn.{n}_proj", c)
                     for i in range(c.num_hidden_layers) for n in ("k", "v")]
        self.ctx_kv = _stack(per_layer)  # [L * 2 * nKV * hd, H]: one GEMM writes every layer's context K/V
        kvw = 2 * c.num_key_value_heads * c.head_dim
        self.layers = []
        for i in range(c.num_hidden_layers):
            k, v = per_layer[2 * i], per_layer[2 * i + 1]
            kv = _rows(self.ctx_kv, i * kvw, (i + 1) * kvw) if self.ctx_kv is not None else _stack([k, v])
            self.layers.append(DrafterLayer(weights, i, c, kv, k, v))
        if self.ctx_kv is not None:  # the stacked copy replaces the per-layer tensors: do not hold both
            for i in range(c.num_hidden_layers):
                for n in ("k", "v"):
                    for part in ("weight", "scales", "biases"):
                        weights.pop(f"layers.{i}.self_attn.{n}_proj.{part}", None)

    # -- geometry the engine reads
    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Pass to `Qwen35Model.forward_with_taps(taps=...)`; rows come back in this order."""
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def block_size(self) -> int:
        """The trained block (anchor + block_size - 1 drafts); a smaller n_draft may be run."""
        return self.config.block_size

    def make_cache(self, target_cache: ModelCache) -> DrafterCache:
        return DrafterCache.like(self.config, target_cache)

    # -- context
    def _context_kv(self, ctx: mx.array) -> list[tuple[mx.array, int, mx.array, int]]:
        """ctx [T, H] -> per layer `DrafterLayer.project_kv`'s (k rows, offset, v rows, offset): one GEMM's
        output [T, L * 2 * nKV * hd] for every layer when the k/v projections stack."""
        if self.ctx_kv is None:
            return [L.project_kv(ctx) for L in self.layers]
        kv, w = linear(ctx, self.ctx_kv), self.layers[0].kv_width
        return [(kv, 2 * i * w, kv, (2 * i + 1) * w) for i in range(len(self.layers))]

    def write_context(self, tap_feat: mx.array, layout: SeqLayout, cache: DrafterCache) -> None:
        """Project committed positions' taps into every drafter layer's context K/V (§1.3, §1.4).

        tap_feat [T, k*H]: row t is the taps (in `tap_layers` order) of the layout's packed token t, which
        sits at position kv_valid[i] + j and is written to the same (block, offset) as the target's KV.
        Write only committed positions: prefill chunks, then anchor + accepted drafts after a verify.
        """
        T = tap_feat.shape[0]
        if T != layout.num_tokens:
            raise ValueError(f"tap_feat has {T} rows but the layout packs {layout.num_tokens} tokens")
        if T == 0:
            return
        self.rope.ensure(max(kv + layout.q_len(i) for i, kv in enumerate(layout.kv_valid)))
        self.write_rows(tap_feat, layout, cache)

    def write_rows(self, tap_feat: mx.array, layout: SeqLayout, cache: DrafterCache) -> None:
        """`write_context`'s graph, its checks and RoPE table done: reads only the layout's positions /
        write_blocks / write_offsets arrays, so a compiled trace (model/compiled_draft.py) runs it too."""
        c = self.config
        ctx = rms_norm(linear(tap_feat, self.fc), self.hidden_norm, self.eps)  # [T, H]
        pos = layout.array("positions")
        q_shape = (ctx.shape[0], c.num_attention_heads, c.head_dim)  # what the drafter's attention reads them with
        for i, (k, ko, v, vo) in enumerate(self._context_kv(ctx)):
            # on GPUs k's norm + RoPE and the write into the pools' own buffers in one launch (no pool copy),
            # the handles following the write
            cache.k_pools[i], cache.v_pools[i] = drafter_context_write(
                k, ko, v, vo, self.layers[i].k_norm, self.eps, pos, self.rope, c.head_dim, cache.k_pools[i],
                cache.v_pools[i], layout, q_shape, ctx.dtype)

    # -- drafting
    def _block_layout(self, layout: SeqLayout, n_slots: int) -> SeqLayout:
        """Each sequence's block [anchor, MASK x n] at positions P..P+n with P = its kv_valid."""
        qsl = [i * n_slots for i in range(layout.num_seqs + 1)]
        return SeqLayout(qsl, list(layout.kv_valid), layout.block_tables, list(layout.state_rows), layout.block_tokens)

    def block_inputs(self, anchors, layout: SeqLayout, n_draft: int) -> tuple[mx.array, SeqLayout]:
        """(ids [S * (n_draft + 1)] int32: each sequence's [anchor, MASK x n_draft], the blocks' layout)."""
        anchors = [int(a) for a in anchors]
        if len(anchors) != layout.num_seqs:
            raise ValueError(f"{len(anchors)} anchors for {layout.num_seqs} sequences")
        if n_draft < 1:
            raise ValueError("n_draft must be >= 1")
        ids = mx.array([t for a in anchors for t in [a] + [self.config.mask_token_id] * n_draft], dtype=mx.int32)
        return ids, self._block_layout(layout, n_draft + 1)

    def draft_hidden(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int) -> mx.array:
        """Final-normed hidden states of the draft slots 1..n_draft: [S, n_draft, H]. Only layout.kv_valid,
        block_tables, state_rows and block_tokens are read (query_start_loc is rebuilt for the blocks)."""
        ids, bl = self.block_inputs(anchors, layout, n_draft)
        self.rope.ensure(max(bl.kv_valid) + n_draft + 1)
        return self.block_hidden(ids, bl, cache)

    def block_hidden(self, ids: mx.array, bl: SeqLayout, cache: DrafterCache) -> mx.array:
        """`draft_hidden`'s graph over the blocks' ids [S * B] and layout bl (B = n_draft + 1 rows each):
        reads only bl's query_start_loc and arrays, so a compiled trace runs it too."""
        c = self.config
        S = bl.num_seqs
        T, nH, hd = ids.shape[0], c.num_attention_heads, c.head_dim
        x = self.target.embed_rows(ids)  # [S*B, H] (vocab-parallel under tensor parallelism)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        pos = bl.array("positions")
        last = len(self.layers) - 1
        h = rms_norm(x, self.layers[0].input_norm, self.eps)
        for i, L in enumerate(self.layers):
            # q and k normed and rotated, the block's K/V written and attended: one launch and the attention's on GPUs
            a = drafter_attention_prep(linear(h, L.q_proj).reshape(T, nH, hd), *L.project_kv(h), L.q_norm, L.k_norm,
                                       self.eps, pos, self.rope, hd, cache.k_pools[i], cache.v_pools[i], bl,
                                       self.scale, L.causal, L.window)
            # on GPUs the block's rows were written into the pools in place (past kv_valid): later writers of
            # these pools (the step's context write) must follow, and MLX orders kernels only through data
            cache.k_pools[i], cache.v_pools[i] = mx.depends([cache.k_pools[i], cache.v_pools[i]], [a])
            # each residual add fused with the norm after it (one launch where two were; the target's layers do
            # the same): the post-attention norm, then the next layer's input norm
            x, h = linear_add_rms_norm(a.reshape(T, nH * hd), L.o_proj, x, L.post_norm, self.eps)
            # SwiGLU: one launch with its epilogue for a quantized drafter; bf16 runs the two GEMMs and the product
            m = swiglu_linear(h, L.gate_proj, L.up_proj)
            if i < last:
                x, h = linear_add_rms_norm(m, L.down_proj, x, self.layers[i + 1].input_norm, self.eps)
            else:
                x = x + linear(m, L.down_proj)
        # slot 0 (the anchor) only conditions the block; slot j predicts the token AT position P + j (§1.7)
        return rms_norm(x.reshape(S, T // S, -1)[:, 1:], self.final_norm, self.eps)

    def head_logits(self, hidden: mx.array) -> mx.array:
        """Draft logits from draft hidden states [S, n, H] through the target's head."""
        c = self.config
        logits = self.target.head(hidden)
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = mx.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def draft_logits(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int) -> mx.array:
        """Draft logits [S, n_draft, vocab] through the target's head (q for rejection sampling)."""
        return self.head_logits(self.draft_hidden(anchors, layout, cache, n_draft))

    def propose_with_logits(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int):
        """(greedy proposals [S, n_draft] int32, draft logits [S, n_draft, vocab])."""
        logits = self.draft_logits(anchors, layout, cache, n_draft)
        return mx.argmax(logits, axis=-1).astype(mx.int32), logits

    def propose(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int) -> mx.array:
        """Greedy proposals [S, n_draft] int32 for positions P+1..P+n_draft of each sequence."""
        return self.propose_with_logits(anchors, layout, cache, n_draft)[0]


# --------------------------------------------------------------------------------------------- loading
def load_drafter_dir(model_dir: Path, target: Qwen35Model, quantize=None) -> Drafter:
    raw = read_config_json(model_dir, "a DFlash drafter directory")
    config = parse_dflash_config(raw, num_target_layers=target.config.num_hidden_layers)
    weights = read_safetensors(Path(model_dir))
    if config.quantization is not None or any(k.endswith(".scales") for k in weights):
        validate_quant(config, weights)
    check_fit(config, weights, target.config)
    check_drafter_weights(weights, config)
    _warn_if_zero_centred(weights)
    weights = {k: v.astype(mx.float32) if k.endswith("norm.weight") else v for k, v in weights.items()}
    if quantize is not None:
        if config.quantization is not None:
            raise ConfigError("this drafter checkpoint is already quantized; load it without quantize=")
        weights = quantize_weights(weights, config, parse_quantize_arg(quantize))
    mx.eval(weights)
    return Drafter(config, weights, target)


def float_weights(drafter: Drafter) -> dict[str, mx.array]:
    """The drafter's tensors under their checkpoint names (the per-layer k/v projections cut back out of
    the stacked context GEMM). A quantized drafter has none to give: ValueError."""
    if drafter.config.quantization is not None:
        raise ValueError("the drafter is quantized already: its float weights are gone")
    c, w = drafter.config, dict(drafter.weights)
    if drafter.ctx_kv is not None:
        kv = c.num_key_value_heads * c.head_dim
        for i in range(c.num_hidden_layers):
            for j, n in enumerate(("k", "v")):
                w[f"layers.{i}.self_attn.{n}_proj.weight"] = drafter.ctx_kv.weight[(2 * i + j) * kv : (2 * i + j + 1) * kv]
    return w


def quantize_drafter(drafter: Drafter, quantize) -> Drafter:
    """A new Drafter for the same target with its projections quantized ('8bit', '4bit', 4, (bits, group)
    as `load`'s quantize=); norms stay fp32. The original is left as it was."""
    config = dataclasses.replace(drafter.config, quant_overrides={})
    weights = quantize_weights(float_weights(drafter), config, parse_quantize_arg(quantize))
    mx.eval(weights)
    out = Drafter(config, weights, drafter.target)
    out.default_n_draft = drafter.default_n_draft
    if hasattr(drafter, "source"):
        out.source = drafter.source
    return out


def load_drafter(path_or_repo: str | Path, target: Qwen35Model, quantize=None) -> Drafter:
    """Load a DFlash drafter (local dir or Hugging Face repo id, published layout §2) for `target`.
    `quantize="4bit"` / `"8bit"` / `(bits, group_size)` quantizes its projections at load, like `load`."""
    drafter = load_drafter_dir(resolve_model_path(path_or_repo, DRAFTER_PATTERNS), target, quantize=quantize)
    drafter.source = str(path_or_repo)
    return drafter


__all__ = ["DFlashConfig", "Drafter", "DrafterCache", "DrafterFitError", "load_drafter", "quantize_drafter"]
