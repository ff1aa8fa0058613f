"""A prompt's computed state in a file (mlx-lm's prompt cache files): written by one engine, loaded into another's
prefix cache, so that requests starting with that prompt prefill only what follows it.

What is saved is the prefix-cache entry for exactly the prompt's tokens (prefix_cache.py): the K/V rows of every
bundle pool (the target's attention layers, then the drafter's when one is loaded) for positions 0..L-1, and every
GDN layer's conv and recurrent state after them. Rows are stored per position, not per block, so an engine with
another block size loads the file too. Loading shares the whole blocks of an entry the prompt extends, writes the
others into fresh bundles and keeps the rest as the entry's partial block (KVManager.adopt); from then on the entry
is like any other (LRU-evicted, restored by a hit). A salted entry's file keeps its salt. save_dir / load_dir do
this for every entry no other extends: the prefix cache kept across a server's restarts.

A file holds state only the same weights reproduce, so it records what decides that and a load refuses any
difference: the model's config and dtype, a fingerprint of its weights (every parameter's name, shape, dtype and
first elements), and the drafter's (its K/V rows are in the bundles). The model's and drafter's source paths are
recorded for the error messages, not compared (`generate --prompt-cache-file` takes its default --model from the
request metadata the frontend wrote).

Format: safetensors; `tokens` int32 [L], `kv.{j}` [L, nKV, hd] per bundle pool, `state.{i}` per GDN pool (conv
states then recurrent states); metadata `format`, `version`, the identity fields, `model`, `draft`, `salt` (JSON)
and `request` (JSON: what the frontend needs to extend the prompt, e.g. its text and chat-template settings).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import mlx.core as mx
import xxhash

from .prefix_cache import bundle_pools, state_pools

FORMAT = "mtlqwen-prompt-cache"
VERSION = "1"
SUFFIX = ".safetensors"
IDENTITY = ("config", "dtype", "weights", "drafter")
_NAMES = {"config": "model config", "dtype": "dtype", "weights": "weights", "drafter": "drafter"}
_FIRST = 64  # elements of each parameter in the fingerprint


@dataclass
class SavedPrompt:
    """A prompt cache file's header: its tokens and what it was made with."""

    path: str
    tokens: list[int]
    identity: dict[str, str]
    model: str | None = None  # the source the writing engine's model was loaded from
    draft: str | None = None
    request: dict = field(default_factory=dict)
    nbytes: int = 0
    salt: str | None = None  # the cache_salt of the requests it serves


def fingerprint(module) -> str:
    """Every parameter's name, shape, dtype and first elements, hashed: two checkpoints that differ anywhere a
    fine-tune or another random draw would touch differ here."""
    h = xxhash.xxh3_64()
    params = sorted(module.weights.items())  # the checkpoint's tensors by name (Qwen35Model, Drafter)
    firsts = [a.reshape(-1)[:_FIRST].view(mx.uint8) for _, a in params]
    mx.eval(firsts)
    for (name, a), first in zip(params, firsts):
        h.update(f"{name}|{tuple(a.shape)}|{a.dtype}|".encode())
        h.update(bytes(memoryview(first)))
    return h.hexdigest()


def identity(model, drafter=None) -> dict[str, str]:
    """What a file's state depends on (see the module doc)."""
    d = "none" if drafter is None else \
        f"{drafter.config!r}|quantization={drafter.config.quantization}|weights={fingerprint(drafter)}"
    return {"config": repr(model.config), "dtype": str(model.dtype), "weights": fingerprint(model), "drafter": d}


def _file(path: str | os.PathLike, reading: bool) -> str:
    """The path MLX writes (it appends the suffix to a name without it); reading, the name as given if it exists."""
    p = os.fspath(path)
    if p.endswith(SUFFIX) or (reading and os.path.exists(p)):
        return p
    return p + SUFFIX


def save(kv, cache, path, tokens: list[int], ident: dict[str, str], model: str | None = None,
         draft: str | None = None, request: dict | None = None, salt: str | None = None) -> SavedPrompt:
    """Write the prefix-cache entry for exactly `tokens` (under that cache_salt; kv: the engine's KVManager) to
    path, through a temporary file (a file of that name is whole or absent); ValueError when the cache holds none."""
    got = kv.export(tokens, cache, salt)
    if got is None:
        raise ValueError(
            f"no prefix-cache entry holds the prompt's {len(tokens)} tokens: the prefix cache is off, or its budget "
            "(prefix_cache_bytes) is smaller than one entry")
    rows, state = got
    arrays = {"tokens": mx.array(tokens, dtype=mx.int32)}
    arrays.update({f"kv.{j}": r for j, r in enumerate(rows)})
    arrays.update({f"state.{i}": s for i, s in enumerate(state)})
    meta = {"format": FORMAT, "version": VERSION, **ident, "model": model or "", "draft": draft or "",
            "request": json.dumps(request or {}), "salt": json.dumps(salt)}
    out = _file(path, reading=False)
    part = out[: -len(SUFFIX)] + ".part" + SUFFIX
    mx.save_safetensors(part, arrays, metadata=meta)
    os.replace(part, out)
    return SavedPrompt(out, list(tokens), dict(ident), model, draft, request or {}, os.path.getsize(out), salt)


def _open(path) -> tuple[str, dict, dict]:
    p = _file(path, reading=True)
    if not os.path.exists(p):
        raise FileNotFoundError(f"no prompt cache file {os.fspath(path)!r}")
    try:
        arrays, meta = mx.load(p, format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{p!r} is not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p!r} is not an mtlqwen prompt cache (written by `mtlqwen cache-prompt`)")
    if meta.get("version") != VERSION:
        raise ValueError(f"{p!r} is a prompt cache of format version {meta.get('version')!r}; this mtlqwen reads "
                         f"version {VERSION}")
    return p, arrays, meta


def _header(p: str, arrays: dict, meta: dict) -> SavedPrompt:
    tok = arrays.get("tokens")
    if tok is None or tok.ndim != 1 or tok.size == 0:
        raise ValueError(f"{p!r} holds no prompt tokens")
    try:
        request = json.loads(meta.get("request") or "{}")
    except json.JSONDecodeError:
        raise ValueError(f"{p!r}: its request metadata is not JSON") from None
    try:
        salt = json.loads(meta.get("salt") or "null")
    except json.JSONDecodeError:
        raise ValueError(f"{p!r}: its salt metadata is not JSON") from None
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{p!r}: its salt is not a string")
    return SavedPrompt(p, tok.tolist(), {k: meta.get(k, "") for k in IDENTITY}, meta.get("model") or None,
                       meta.get("draft") or None, request, os.path.getsize(p), salt)


def read(path) -> SavedPrompt:
    """A file's header (tokens, identity, sources, request), without loading its state anywhere."""
    return _header(*_open(path))


def load(kv, cache, path, ident: dict[str, str]) -> tuple[SavedPrompt, bool]:
    """Put a file's prompt into the prefix cache (kv: the engine's KVManager; ident: the engine's identity).
    Returns (its header, whether a new entry was made: False when that prompt is cached already or its entry is
    larger than the prefix cache's budget). ValueError when the file is not for this engine."""
    p, arrays, meta = _open(path)
    saved = _header(p, arrays, meta)
    differ = [k for k in IDENTITY if saved.identity[k] != ident[k]]
    if differ:
        made = f" (it was written with --model {saved.model})" if saved.model else ""
        what = " and ".join(_NAMES[k] for k in differ)
        verb = "differ" if len(differ) > 1 or differ == ["weights"] else "differs"
        raise ValueError(f"{p!r} does not fit this engine: the {what} {verb}{made}; "
                         "a saved state only fits the same model weights, dtype and drafter")
    pools, states = bundle_pools(cache), state_pools(cache)
    L = len(saved.tokens)
    rows = [arrays.get(f"kv.{j}") for j in range(len(pools))]
    state = [arrays.get(f"state.{i}") for i in range(len(states))]
    for name, got, want in [*((f"kv.{j}", r, (L, *q.shape[2:], q.dtype)) for j, (r, q) in enumerate(zip(rows, pools))),
                            *((f"state.{i}", s, (*q.shape[1:], q.dtype)) for i, (s, q) in enumerate(zip(state, states)))]:
        if got is None or (*got.shape, got.dtype) != want:
            shown = "missing" if got is None else f"{tuple(got.shape)} {got.dtype}"
            raise ValueError(f"{p!r}: array {name} is {shown}, expected {want[:-1]} {want[-1]}")
    extra = set(arrays) - {"tokens", *(f"kv.{j}" for j in range(len(pools))), *(f"state.{i}" for i in range(len(states)))}
    if extra:
        raise ValueError(f"{p!r} holds arrays this engine has no pool for: {', '.join(sorted(extra))}")
    return saved, kv.adopt(saved.tokens, rows, state, cache, saved.salt) is not None


def save_dir(kv, cache, folder, ident: dict[str, str], model: str | None = None, draft: str | None = None) -> list[str]:
    """Every entry no other extends (PrefixCache.maximal), each a file in folder named by its key. The folder's
    other files of this engine's identity are removed (loaded earlier or since evicted: what they held is in the
    new ones or was dropped), as are unfinished ones; another model's are left. Returns the files written, least
    recently used first."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for e in (kv.prefix.maximal() if kv.prefix is not None else []):
        tokens = list(struct.unpack(f"<{e.length}i", e.tokens))
        name = os.path.join(os.fspath(folder), f"{e.key:016x}{SUFFIX}")
        written.append(save(kv, cache, name, tokens, ident, model, draft, salt=e.salt).path)
    for f in os.listdir(folder):
        path = os.path.join(os.fspath(folder), f)
        if not f.endswith(SUFFIX) or path in written:
            continue
        try:
            stale = f.endswith(".part" + SUFFIX) or read(path).identity == ident
        except ValueError:  # not a prompt cache file: not ours to remove
            stale = False
        if stale:
            os.remove(path)
    return written


def load_dir(kv, cache, folder, ident: dict[str, str]) -> tuple[int, list[str]]:
    """The folder's prompt cache files into the prefix cache, oldest first (the most recent stays the most
    recently used). Returns (entries made, one line for each file skipped and why)."""
    files = sorted((os.path.join(os.fspath(folder), f) for f in os.listdir(folder)
                    if f.endswith(SUFFIX) and not f.endswith(".part" + SUFFIX)), key=os.path.getmtime)
    made, skipped = 0, []
    for f in files:
        try:
            made += load(kv, cache, f, ident)[1]
        except ValueError as e:  # another model's, or broken: the others still load
            skipped.append(str(e))
    return made, skipped
