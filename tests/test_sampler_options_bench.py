"""benchmarks/sampler_options_bench.py on the CPU (its numbers mean nothing here): every option's row runs, and
each counts the same tokens as the row without options, so the rates compare like with like."""

from __future__ import annotations

import importlib.util
import json

from frontend_fixtures import REPO, write_tiny_chat_checkpoint


def test_every_option_runs_as_long_as_none(tmp_path, monkeypatch):
    ckpt = write_tiny_chat_checkpoint(tmp_path / "ckpt")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("sampler_options_bench", REPO / "benchmarks" / "sampler_options_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--model", str(ckpt), "--seqs", "2", "--prompt-len", "24", "--gen", "10", "--tokenizer",
                       str(ckpt), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["option"] for r in rows] == list(bench.OPTIONS)
    assert {r["tokens"] for r in rows} == {2 * 9}  # each request decodes its 9 tokens after its first
