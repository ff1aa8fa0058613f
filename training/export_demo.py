"""Install a trained pair as the package's demo pair: quantize (mlx 8-bit), check, record.

  python -m training.export_demo --target RUN/checkpoint --drafter RUN/drafter [--dest mtlqwen/demo/pair]
         [--parity] [--bits 8]

Steps: (1) with --parity, the HF/PyTorch weights and mtlqwen's float load agree (target logits, drafter
draft logits; torch + transformers needed); (2) the target is written by `mtlqwen convert` and the drafter's
projections are quantized the same way; (3) the installed pair is loaded through `mtlqwen.demo` and its
held-out loss, greedy outputs with and without the drafter, and acceptance length are measured and written
to demo.json (the values tests/test_demo_pair.py checks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from .corpus import read_corpus

HELDOUT_CHARS = 6_000  # ~1.6k tokens (4 windows): pins the weights down, ~20 s on the CPU reference kernels
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(root):", "class Stack:\n    \"\"\"A LIFO stack.\"\"\"\n"]


def heldout_text() -> str:
    files = [r for r in read_corpus() if r["kind"] == "file" and r["split"] == "heldout"]
    out, n = [], 0
    for r in files:  # corpus order: sorted paths
        if n >= HELDOUT_CHARS:
            break
        out.append(f"# {r['path']}\n{r['text']}")
        n += len(out[-1])
    return "\n".join(out)[:HELDOUT_CHARS]


def quantize_drafter(src: Path, dst: Path, bits: int) -> None:
    import mlx.core as mx

    from mtlqwen.model.dflash_config import parse_dflash_config
    from mtlqwen.model.loading import read_safetensors
    from mtlqwen.model.quantize import parse_quantize_arg, quantize_weights

    raw = json.loads((src / "config.json").read_text())
    cfg = parse_dflash_config(raw)
    spec = parse_quantize_arg(f"{bits}bit")
    w = quantize_weights(read_safetensors(src), cfg, spec)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), w, metadata={"format": "mlx"})
    raw["quantization"] = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def measure(pair_path: Path, max_tokens: int) -> dict:
    """Held-out loss, and greedy generations with / without the drafter (must be equal) with τ."""
    from mtlqwen import Engine, SamplingParams
    from mtlqwen.demo import heldout_loss, load_demo_pair

    pair = load_demo_pair(pair_path)
    tok = pair.tokenizer
    loss, n = heldout_loss(pair.model, tok.encode(pair.heldout_text))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = [tok.encode(p) for p in PROMPTS]
    t0 = time.perf_counter()
    plain = Engine(pair.model, tokenizer=tok, slots=1).generate(prompts, sp)
    t_plain = time.perf_counter() - t0
    spec_engine = Engine(pair.model, tokenizer=tok, slots=1, draft=pair.drafter)
    t0 = time.perf_counter()
    spec = spec_engine.generate(prompts, sp)
    t_spec = time.perf_counter() - t0
    stats = spec_engine.spec.stats()
    return {
        "heldout_loss": loss, "heldout_tokens": n,
        "greedy_equal": [a.token_ids == b.token_ids for a, b in zip(plain, spec)],
        "samples": {p: o.text for p, o in zip(PROMPTS, plain)},
        "speculative": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()},
        "cpu_seconds": {"plain": round(t_plain, 2), "speculative": round(t_spec, 2)}, "max_tokens": max_tokens,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HF-layout target checkpoint (train_target's checkpoint/)")
    ap.add_argument("--drafter", required=True, help="drafter directory (train_drafter's drafter/)")
    ap.add_argument("--dest", default=str(Path(__file__).resolve().parents[1] / "mtlqwen" / "demo" / "pair"))
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--parity", action="store_true", help="compare with the PyTorch models first")
    ap.add_argument("--logs", nargs="*", default=[], help="training log JSONs to copy next to the pair")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    target, drafter, dest = Path(args.target), Path(args.drafter), Path(args.dest)
    parity = None
    if args.parity:
        from .parity import check_parity

        parity = check_parity(target, drafter)
        print(json.dumps({"parity": parity}), flush=True)
    if dest.exists():
        shutil.rmtree(dest)
    from mtlqwen.model.convert import convert

    convert(target, dest / "target", quantize=f"{args.bits}bit", progress=False)
    quantize_drafter(drafter, dest / "drafter", args.bits)
    (dest / "heldout.txt").write_text(heldout_text(), encoding="utf-8")
    (dest / "demo.json").write_text("{}\n")  # placeholder so the pair loads for measuring
    record = {"bits": args.bits, "parity": parity, **measure(dest, args.max_tokens)}
    for log in args.logs:
        data = json.loads(Path(log).read_text())
        record.setdefault("training", {})[Path(log).stem] = {
            k: data.get(k) for k in ("steps", "tokens_seen", "epochs", "heldout_loss", "heldout", "train_s",
                                     "params", "gpu", "torch", "transformers", "corpus_sha256", "smoke")}
    (dest / "demo.json").write_text(json.dumps(record, indent=1) + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(json.dumps({"dest": str(dest), "bytes": size, **{k: record[k] for k in
                      ("heldout_loss", "greedy_equal", "speculative")}}, indent=1))
    return record


if __name__ == "__main__":
    main()
