"""The DFlash drafter (dflash.md §1) in PyTorch for training, with the published checkpoint's tensor names
(its state_dict is the drafter's model.safetensors, §2.2), and the block objective.

Training packs many blocks per sequence into one pass: for a window of T tokens with target taps, blocks
n = 0..N-1 sit at anchors P_n, each [x_{P_n}, MASK x (B - 1)] at positions P_n .. P_n + B - 1. A block's
queries see the context rows of positions < P_n (what is committed when x_{P_n} is the anchor, §3.3) and
every slot of their own block (no mask inside the block, §1.5); slot j predicts the token AT P_n + j (§1.7).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Qwen3's plain x̂ · w (weights near 1, not Qwen3.5's 1 + w), computed in fp32."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half over the whole head. x [B, H, S, D], pos [B, S] (absolute positions)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ph = pos.float()[:, None, :, None] * inv  # [B, 1, S, D/2]
    cos, sin = ph.cos(), ph.sin()
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, float(c["rope_theta"])
        self.q_proj, self.o_proj = nn.Linear(H, nh * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        self.k_proj, self.v_proj = nn.Linear(H, nkv * hd, bias=False), nn.Linear(H, nkv * hd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(hd, c["rms_norm_eps"]), RMSNorm(hd, c["rms_norm_eps"])

    def _heads(self, x, n):  # [B, S, n*hd] -> [B, n, S, hd]
        return x.view(x.shape[0], x.shape[1], n, self.hd).transpose(1, 2)

    def forward(self, h, ctx, pos_blk, pos_ctx, mask):
        """h [B, S, H] block stream, ctx [B, T, H] fused taps, mask [B, 1, S, T + S] (True = attend)."""
        q = rope(self.q_norm(self._heads(self.q_proj(h), self.nh)), pos_blk, self.theta)
        kb = rope(self.k_norm(self._heads(self.k_proj(h), self.nkv)), pos_blk, self.theta)
        kc = rope(self.k_norm(self._heads(self.k_proj(ctx), self.nkv)), pos_ctx, self.theta)
        k = torch.cat([kc, kb], 2)
        v = torch.cat([self._heads(self.v_proj(ctx), self.nkv), self._heads(self.v_proj(h), self.nkv)], 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.hd**-0.5)
        return self.o_proj(a.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H = c["hidden_size"]
        self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.self_attn, self.mlp = Attention(c), MLP(H, c["intermediate_size"])

    def forward(self, x, ctx, pos_blk, pos_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, pos_blk, pos_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """fc over the concatenated taps, hidden_norm, Qwen3 layers with KV injection, final norm. The
    target's embedding and head are passed in (frozen), never owned."""

    def __init__(self, c: dict):
        super().__init__()
        H, k = c["hidden_size"], len(c["dflash_config"]["target_layer_ids"])
        self.config = c
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c["rms_norm_eps"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, taps, x_blk, pos_blk, mask):
        """taps [B, T, k*H] (positions 0..T-1), x_blk [B, S, H] embedded blocks -> final-normed [B, S, H]."""
        ctx = self.hidden_norm(self.fc(taps))
        pos_ctx = torch.arange(taps.shape[1], device=taps.device).expand(taps.shape[0], -1)
        x = x_blk
        for layer in self.layers:
            x = layer(x, ctx, pos_blk, pos_ctx, mask)
        return self.norm(x)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int):
    """tokens [B, T], anchors [B, N] (1 <= P <= T - block) -> block ids [B, N*block], positions
    [B, N*block], attention mask [B, 1, N*block, T + N*block] and target positions' tokens [B, N, block-1]."""
    Bsz, T = tokens.shape
    N = anchors.shape[1]
    offs = torch.arange(block, device=tokens.device)
    pos = anchors[:, :, None] + offs  # [B, N, block]
    ids = torch.full_like(pos, mask_id)
    ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    labels = torch.gather(tokens, 1, pos[:, :, 1:].reshape(Bsz, -1)).view(Bsz, N, block - 1)
    ctx_ok = torch.arange(T, device=tokens.device)[None, None, :] < anchors[:, :, None]  # [B, N, T]
    ctx_ok = ctx_ok[:, :, None, :].expand(Bsz, N, block, T).reshape(Bsz, N * block, T)
    blk = torch.arange(N, device=tokens.device).repeat_interleave(block)
    own = (blk[:, None] == blk[None, :]).expand(Bsz, -1, -1)  # [B, S, S]: each block sees itself only
    mask = torch.cat([ctx_ok, own], -1)[:, None]
    return ids.view(Bsz, -1), pos.view(Bsz, -1), mask, labels


def sample_anchors(Bsz: int, T: int, block: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct anchors per sequence in [1, T - block], sorted. [B, n] int64."""
    hi = T - block  # inclusive
    if hi < 1:
        raise ValueError(f"sequence length {T} leaves no anchor for block size {block}")
    n = min(n, hi)
    return torch.stack([torch.randperm(hi, generator=gen)[:n].sort().values + 1 for _ in range(Bsz)])


def block_loss(draft_logits, target_logits, labels, decay_gamma: float, hard_weight: float):
    """draft_logits / target_logits [B, N, block-1, V] (target's at the same positions), labels [B, N, block-1].
    Returns (loss, stats): per-slot weighted soft CE to the target plus hard CE to the data token, and the
    mean accepted length under greedy verification along the data path (a proxy of τ)."""
    nslot = draft_logits.shape[2]
    w = torch.exp(-torch.arange(nslot, device=draft_logits.device, dtype=torch.float32) / decay_gamma)
    w = w / w.sum()
    logq = F.log_softmax(draft_logits.float(), -1)
    p = F.softmax(target_logits.float(), -1)
    soft = -(p * logq).sum(-1)  # [B, N, slots]
    hard = F.nll_loss(logq.flatten(0, 2), labels.flatten(), reduction="none").view_as(soft)
    per_slot = (1 - hard_weight) * soft + hard_weight * hard
    loss = (per_slot.mean((0, 1)) * w).sum()
    with torch.no_grad():
        t_arg = target_logits.argmax(-1)
        # a draft counts while it equals the target's greedy token AND the data path is the greedy path
        ok = (draft_logits.argmax(-1) == t_arg) & (t_arg == labels)
        accepted = torch.cumprod(ok.int(), -1).sum(-1).float()  # leading matches per block
        stats = {"tau_proxy": float(1 + accepted.mean()), "slot1_match": float((draft_logits[:, :, 0].argmax(-1)
                 == t_arg[:, :, 0]).float().mean()), "soft_ce": float(soft.mean()), "hard_ce": float(hard.mean())}
    return loss, stats


def count_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())

