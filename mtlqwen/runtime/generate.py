"""The convenience front-ends of the Engine: generate() and stream() over a list of prompts, driving
step() until their requests finish (deltas of other requests are kept for the caller's step())."""

from __future__ import annotations

import time
from typing import Any, Iterator

from .outputs import Delta, Output


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
    )


class Generation:
    """Mixed into Engine: needs submit(), _advance() (one step's deltas), _held and counters."""

    def _run(self, prompts, sampling) -> Iterator[tuple[int, Delta]]:
        """(prompt index, delta) for these prompts until all finish; a request failing validation
        yields one "error" delta on its own. Deltas of other requests are kept for step()."""
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
            per = list(sampling)
        else:
            per = [sampling] * len(prompts)
        mine: dict[Any, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, per)):
            try:
                mine[self.submit(prompt, sp)] = i
            except (ValueError, TypeError) as e:
                n = len(prompt) if isinstance(prompt, (list, tuple)) else 0
                out = Output(None, n, [], "", "error", str(e))
                yield i, Delta(None, [], "", True, "error", str(e), out)
        while mine:
            for d in self._advance():
                i = mine.get(d.request_id)
                if i is None:
                    self._held.append(d)
                    continue
                if d.finished:
                    del mine[d.request_id]
                yield i, d

    def stream(self, prompts, sampling=None) -> Iterator[Delta]:
        """Yield the deltas of these prompts' requests as they are produced."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        for _, d in self._run(prompts, sampling):
            yield d

    def generate(self, prompts, sampling=None, progress: bool = False) -> list[Output]:
        """Run prompts (strings or token-id lists; one SamplingParams for all or one each) to completion;
        Outputs in prompt order."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(prompts), unit="req", desc="generate")
        outputs: list[Output | None] = [None] * len(prompts)
        gen0, t0 = self.counters["generated_tokens"], time.perf_counter()
        for i, d in self._run(prompts, sampling):
            if not d.finished:
                continue
            outputs[i] = d.output
            if bar is not None:
                bar.update(1)
                rate = (self.counters["generated_tokens"] - gen0) / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} tok/s")
        if bar is not None:
            bar.close()
        return outputs
