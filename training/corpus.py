"""The training corpus: the CPython standard library's .py sources, packed into one committed file.

The corpus is built once (on the machine that has the stdlib to hand) and committed as
`data/stdlib_corpus.jsonl.xz`, so every machine that trains (the CPU here for smoke runs, the GPU for the
real run, whatever its Python) reads the same files. Records, one JSON object per line:
  {"kind": "file", "path": "json/decoder.py", "split": "train" | "heldout", "text": "..."}
  {"kind": "chat", "split": "train", "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
The chat records pair a function's docstring (user) with its source (assistant), so the model also learns
the ChatML turn format that `mtlqwen chat` sends.

Build:  python -m training.corpus build        (writes data/stdlib_corpus.jsonl.xz + data/files.tsv)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "stdlib_corpus.jsonl.xz"
FILE_LIST = HERE / "data" / "files.tsv"
HELDOUT_PERCENT = 3  # a file is held out when sha256(path) mod 100 < this: stable under added/removed files
MAX_FILE_BYTES = 400_000  # larger files are data tables (unicode, tz), not code worth learning
SKIP_DIRS = ("site-packages", "__pycache__", "lib2to3/tests/data", "test/tokenizedata", "test/encoded_modules")


def split_of(path: str) -> str:
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def stdlib_files(root: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib .py file that decodes as UTF-8, sorted by path."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(d in rel for d in SKIP_DIRS) or p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append((rel, text))
    return out


def chat_samples(path: str, text: str, max_lines: int = 40) -> list[list[dict]]:
    """Docstring -> source pairs for the top-level and method functions of one file (short ones only)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_") or node.end_lineno - node.lineno + 1 > max_lines:
            continue
        first = doc.strip().split("\n\n")[0].strip()
        if len(first) < 20:
            continue
        src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        indent = len(src) - len(src.lstrip(" "))
        src = "\n".join(line[indent:] for line in src.split("\n"))
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        user = f"Write the Python function `{node.name}` from the `{module}` module. {first}"
        out.append([{"role": "user", "content": user},
                    {"role": "assistant", "content": f"```python\n{src}\n```"}])
    return out


def build(root: Path) -> dict:
    files = stdlib_files(root)
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    n_chat = 0
    import lzma  # noqa: PLC0415

    with lzma.open(CORPUS, "wt", encoding="utf-8", preset=9) as f:
        for rel, text in files:
            split = split_of(rel)
            f.write(json.dumps({"kind": "file", "path": rel, "split": split, "text": text}) + "\n")
            if split == "train":
                for messages in chat_samples(rel, text):
                    f.write(json.dumps({"kind": "chat", "split": "train", "path": rel, "messages": messages}) + "\n")
                    n_chat += 1
    with open(FILE_LIST, "w", encoding="utf-8") as f:
        f.write(f"# CPython {sys.version.split()[0]} stdlib at {root}\n# path\tsplit\tbytes\tsha256\n")
        for rel, text in files:
            b = text.encode()
            f.write(f"{rel}\t{split_of(rel)}\t{len(b)}\t{hashlib.sha256(b).hexdigest()}\n")
    held = sum(split_of(r) == "heldout" for r, _ in files)
    return {"files": len(files), "heldout_files": held, "chat_samples": n_chat, "bytes": CORPUS.stat().st_size}


def read_corpus(path: Path = CORPUS) -> list[dict]:
    """Every record of the committed corpus, in file order."""
    try:
        import lzma  # noqa: PLC0415
    except ImportError:  # a Python built without liblzma: the xz tool reads the same file
        import subprocess  # noqa: PLC0415

        text = subprocess.run(["xz", "-dc", str(path)], check=True, capture_output=True).stdout.decode("utf-8")
        return [json.loads(line) for line in text.splitlines()]
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build", "stats"])
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="the stdlib directory to read")
    args = ap.parse_args()
    if args.command == "build":
        print(json.dumps(build(Path(args.root))))
    else:
        recs = read_corpus()
        for split in ("train", "heldout"):
            files = [r for r in recs if r["kind"] == "file" and r["split"] == split]
            print(split, len(files), "files", sum(len(r["text"]) for r in files), "chars")
        print("chat", sum(r["kind"] == "chat" for r in recs))


if __name__ == "__main__":
    main()
