"""benchmarks/headline.json: the latest headline figures, each traceable to the run that produced it.

A figure is either measured (a number with the command, date and MLX version of its run, and the record and
raw file that hold it) or explicitly not measured yet (value null and a note saying what would measure it).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADLINE = ROOT / "benchmarks" / "headline.json"
REQUIRED = (
    "decode_b1", "decode_b8", "decode_b16", "decode_b32", "prefill_4096_default_budget",
    "prefill_4096_step1024", "spec_step_ratio_b1_nd15", "spec_step_ratio_b8_nd15", "ttft_cached_vs_cold",
)
FIELDS = ("value", "unit", "what", "command", "date", "mlx", "record", "raw")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def check_figure(name: str, f: dict) -> list[str]:
    """Every way `f` breaks the schema, as messages (empty when it is well-formed)."""
    bad = [f"{name}: missing {k!r}" for k in FIELDS if k not in f]
    if bad:
        return bad
    if f["value"] is None:
        if not str(f.get("note", "")).startswith("not measured yet: ") or len(f["note"]) < 30:
            bad.append(f"{name}: null value without a 'not measured yet: <what would measure it>' note")
        return bad
    v = f["value"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        bad.append(f"{name}: value {v!r} is not a positive number")
    if not (isinstance(f["command"], str) and "benchmarks/" in f["command"]):
        bad.append(f"{name}: command {f['command']!r} does not name a benchmark script")
    if not (isinstance(f["date"], str) and DATE.match(f["date"])):
        bad.append(f"{name}: date {f['date']!r} is not YYYY-MM-DD")
    if not (isinstance(f["mlx"], str) and VERSION.match(f["mlx"])):
        bad.append(f"{name}: mlx {f['mlx']!r} is not a version")
    for k in ("record", "raw"):
        if not (isinstance(f[k], str) and (ROOT / f[k]).is_file()):
            bad.append(f"{name}: {k} {f[k]!r} is not a file of the repo")
    if "mlx_lm" in f:
        if not isinstance(f["mlx_lm"], (int, float)) or not VERSION.match(str(f.get("mlx_lm_version", ""))):
            bad.append(f"{name}: mlx_lm needs a number and an mlx_lm_version")
    return bad


def test_headline_parses_and_every_figure_is_traceable():
    h = json.loads(HEADLINE.read_text())
    figures = h["figures"]
    assert [k for k in REQUIRED if k not in figures] == []
    problems = [p for name, f in figures.items() for p in check_figure(name, f)]
    assert problems == []


@pytest.mark.parametrize("field", FIELDS)
def test_a_figure_without_a_field_is_refused(field):
    f = json.loads(HEADLINE.read_text())["figures"]["decode_b1"]
    assert check_figure("decode_b1", f) == []
    del f[field]
    assert check_figure("decode_b1", f) == [f"decode_b1: missing {field!r}"]


@pytest.mark.parametrize("change, message", [
    ({"date": "yesterday"}, "date 'yesterday' is not YYYY-MM-DD"),
    ({"mlx": ""}, "mlx '' is not a version"),
    ({"value": "fast"}, "value 'fast' is not a positive number"),
    ({"raw": "benchmarks/results/nothing.json"}, "raw 'benchmarks/results/nothing.json' is not a file of the repo"),
    ({"value": None}, "null value without a 'not measured yet: <what would measure it>' note"),
])
def test_a_malformed_figure_is_refused(change, message):
    f = json.loads(HEADLINE.read_text())["figures"]["decode_b8"] | change
    assert check_figure("decode_b8", f) == [f"decode_b8: {message}"]
