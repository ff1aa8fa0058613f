"""What the terminal front-ends (generate, convert, chat) share: model text made safe to print,
progress bars on standard error, and Ctrl-C turned into a flag the engine loop checks between steps.
"""

from __future__ import annotations

import signal
import sys
import time

# C0 controls (except newline and tab) and DEL shown as visible symbols, C1 controls dropped: model
# text must not drive the terminal (bell, escape sequences, cursor moves).
_CONTROL = ({c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {0x7F: 0x2421}
            | {c: None for c in range(0x80, 0xA0)})


def printable(text: str) -> str:
    return text.translate(_CONTROL)


def text_stream(tokenizer, show_special: bool, keep: tuple[str, ...] = ()):
    """A streaming detokenizer for printing: special tokens (<|im_end|>, <|reserved_3|>, ...) left out
    unless `show_special`; those named in `keep` (e.g. the thinking tags a reasoning splitter needs)
    stay. A tokenizer without `special_token_ids` (the demo byte tokenizer) emits none anyway."""
    special = getattr(tokenizer, "special_token_ids", None)
    if show_special or not special:
        return tokenizer.detokenizer()
    from ..tokenizer import StreamDetokenizer  # noqa: PLC0415

    kept = {tokenizer.token_to_id(t) for t in keep}
    return StreamDetokenizer(tokenizer.token_bytes, frozenset(special) - kept)


def progress_enabled(quiet: bool) -> bool:
    """Bars only for a person watching: off with --quiet or when standard error is not a terminal."""
    return not quiet and sys.stderr.isatty()


class Bar:
    """A tqdm bar on standard error created on first use; `update(done, total)` sets its position."""

    def __init__(self, desc: str, unit: str = "B", enabled: bool = True):
        self.desc, self.unit, self.enabled = desc, unit, enabled
        self.bar = None

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm  # noqa: PLC0415

            scale = self.unit == "B"
            n_unit, total_unit = ("B", "B") if scale else ("", " " + self.unit)
            fmt = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}" + n_unit + "/{total_fmt}" + total_unit
                   + " [{elapsed}<{remaining}, {rate_fmt}]")
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=scale,
                            unit_divisor=1024 if scale else 1000, file=sys.stderr, leave=False,
                            dynamic_ncols=True, bar_format=fmt)
        self.bar.total = total
        self.bar.update(min(done, total) - self.bar.n)  # by increments, so tqdm's rate is right
        self.bar.refresh()  # callers update rarely (every 256 MiB, every 0.25 s): show each one

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Stages:
    """One bar per named stage (convert's "loading" then "writing"): progress(stage, done, total)."""

    def __init__(self, enabled: bool):
        self.enabled, self.bars = enabled, {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        for name, bar in list(self.bars.items()):
            if name != stage:
                bar.close()
                del self.bars[name]
        self.bars.setdefault(stage, Bar(stage, enabled=self.enabled)).update(done, total)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


class PromptProgress:
    """Prompt processing of one request (tokens done / total, tok/s) for a prompt longer than one
    engine step, on an engine that runs nothing else. Call `update()` after each engine step and
    `close()` at the first generated token.

    Mid-prompt chunks are launched without a host sync, so the launched count can run ahead of the
    device; every REFRESH_S the bar waits for the device (one pipeline bubble) and shows what is done."""

    REFRESH_S = 0.25

    def __init__(self, engine, prompt_tokens: int, enabled: bool):
        self.engine, self.total = engine, prompt_tokens
        self.on = enabled and prompt_tokens > engine.step_tokens
        self.base = engine.counters["prefill_tokens"]
        self.last = time.perf_counter()
        self.bar = Bar("prompt", unit="tok", enabled=self.on)

    def update(self) -> None:
        now = time.perf_counter()
        if not self.on or now - self.last < self.REFRESH_S:
            return
        import mlx.core as mx  # noqa: PLC0415

        mx.synchronize()
        self.last = time.perf_counter()
        self.bar.update(self.engine.counters["prefill_tokens"] - self.base, self.total)

    def close(self) -> None:
        self.on = False
        self.bar.close()


class Interrupt:
    """While active, the first SIGINT (Ctrl-C) only sets `hit`: the engine loop stops at the next step
    boundary, so the engine is never torn mid-step. A second one raises KeyboardInterrupt at once."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.old = signal.signal(signal.SIGINT, self._on)
        return self

    def _on(self, *_):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.old)
