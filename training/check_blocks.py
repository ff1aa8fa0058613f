"""Self-check of the packed training objective: every block drafted in one packed pass (dflash_torch.
block_inputs' mask) equals that block drafted alone over its own committed context, as the engine
drafts it; and each block's labels are the tokens at P+1 .. P+B-1. Run by device_train.sh --smoke."""

from __future__ import annotations

import torch

from .dflash_torch import DFlashDrafter, block_inputs
from .pair_config import MASK, drafter_config, target_text_config


def main() -> None:
    torch.manual_seed(0)
    cfg = drafter_config(target_text_config(100, smoke=True), smoke=True)
    m = DFlashDrafter(cfg).eval()
    T, B, H = 40, cfg["dflash_config"]["block_size"], cfg["hidden_size"]
    k = len(cfg["dflash_config"]["target_layer_ids"])
    taps, toks, emb = torch.randn(2, T, k * H), torch.randint(0, 100, (2, T)), torch.nn.Embedding(100, H)
    anchors = torch.tensor([[3, 10, 25], [1, 17, 30]])  # overlapping and adjacent blocks
    ids, pos, mask, labels = block_inputs(toks, anchors, B, MASK)
    worst = 0.0
    with torch.no_grad():
        packed = m(taps, emb(ids), pos, mask).view(2, 3, B, H)
        for b in range(2):
            for n in range(3):
                P = int(anchors[b, n])
                blk = torch.tensor([[int(toks[b, P])] + [MASK] * (B - 1)])
                alone = m(taps[b : b + 1, :P], emb(blk), torch.arange(P, P + B)[None],
                          torch.ones(1, 1, B, P + B, dtype=torch.bool))[0]
                worst = max(worst, float((alone - packed[b, n]).abs().max()))
                if not torch.equal(labels[b, n], toks[b, P + 1 : P + B]):
                    raise SystemExit(f"block labels wrong at sequence {b}, anchor {P}")
    if worst > 1e-5:
        raise SystemExit(f"packed blocks differ from blocks drafted alone by {worst:.3g}")
    print(f"packed blocks == blocks alone (max diff {worst:.2g}); labels at P+1..P+B-1")


if __name__ == "__main__":
    main()
