"""The mx.distributed group of a tensor-parallel run: starting it, checking that every rank loads the
same checkpoint, and broadcasting rank 0's host data (prompts, requests) so every rank runs the same
schedule.

Processes are started the way MLX programs are (`mlx.launch --backend ring -n 2 ...`, a hostfile, or
MPI / NCCL / JACCL); `mx.distributed.init` reads what the launcher set in the environment.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from .sharding import ShardError


def tensor_parallel_group(backend: str = "any"):
    """The launched group for --tensor-parallel; a clear error when this process was started alone."""
    if not mx.distributed.is_available():
        raise ShardError("--tensor-parallel: this MLX build has no distributed back-end")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise ShardError(f"--tensor-parallel: no distributed group could be started ({e}); launch with "
                         "e.g. `mlx.launch --backend ring -n 2 -- mtlqwen ...`") from None
    if group.size() < 2:
        raise ShardError("--tensor-parallel needs at least 2 ranks, but this group has 1: launch with "
                         "e.g. `mlx.launch --backend ring -n 2 -- mtlqwen ...`")
    return group


SAMPLE_BLOCKS = 16


def checkpoint_fingerprint(model_dir: Path, extra: str = "") -> bytes:
    """32 bytes naming a checkpoint: config.json, the headers (names, dtypes, shapes, offsets) of its
    safetensors files and SAMPLE_BLOCKS evenly spaced 4 KiB blocks of each file's data (files that differ
    only in values, e.g. another seed or fine-tune, then differ). Cheap for a 400 GB checkpoint."""
    h = hashlib.sha256(extra.encode())
    for name in ("config.json",):
        p = model_dir / name
        if p.is_file():
            h.update(p.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(f.name.encode() + fh.read(min(n, 1 << 26)))
            size = f.stat().st_size
            for i in range(SAMPLE_BLOCKS):
                fh.seek(8 + n + (size - 8 - n) * i // SAMPLE_BLOCKS)
                h.update(fh.read(4096))
    return h.digest()


def check_same_checkpoint(fingerprint: bytes, group) -> None:
    """Every rank must load the same checkpoint (same files, same quantization): all_gather the
    fingerprints and refuse on any difference, naming the ranks that differ from rank 0."""
    mine = mx.array(list(fingerprint), dtype=mx.uint8)
    everyone = mx.distributed.all_gather(mine, group=group).reshape(group.size(), -1).tolist()
    differ = [r for r, fp in enumerate(everyone) if fp != everyone[0]]
    if differ:
        raise ShardError(f"ranks {differ} load a different checkpoint than rank 0 (config or tensor headers "
                         "differ): every rank needs the same files")


def broadcast_bytes(data: bytes | None, group, root: int = 0) -> bytes:
    """Rank `root`'s bytes on every rank (others pass None): the length, then the bytes, each an all_sum
    of the root's values with zeros."""
    is_root = group.rank() == root
    n = mx.array([len(data) if is_root else 0], dtype=mx.int64)
    n = int(mx.distributed.all_sum(n, group=group).item())
    if n == 0:
        return b""
    buf = mx.array(np.frombuffer(data, dtype=np.uint8)) if is_root else mx.zeros((n,), dtype=mx.uint8)
    out = mx.distributed.all_sum(buf, group=group)
    return np.array(out).tobytes()


def broadcast_json(obj, group, root: int = 0):
    """A JSON-serialisable value of rank `root` on every rank."""
    data = json.dumps(obj).encode() if group.rank() == root else None
    return json.loads(broadcast_bytes(data, group, root).decode())


def agreed_seed(group) -> int:
    """A random 63-bit seed drawn on rank 0 and shared: the engines' per-request seeds then agree."""
    import random  # noqa: PLC0415

    data = str(random.SystemRandom().getrandbits(63)).encode() if group.rank() == 0 else None
    return int(broadcast_bytes(data, group).decode())
