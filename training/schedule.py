"""Learning rate over a wall-clock budget: linear warm-up by steps, then cosine by the larger of the
step fraction and the time fraction, so a run of unknown speed still anneals fully before its deadline."""

from __future__ import annotations

import math
import time


class BudgetSchedule:
    def __init__(self, lr: float, warmup_steps: int, max_steps: int, budget_s: float, min_lr_ratio: float):
        self.lr, self.warmup, self.max_steps, self.budget = lr, warmup_steps, max_steps, budget_s
        self.min_ratio = min_lr_ratio
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def progress(self, step: int) -> float:
        return max(step / self.max_steps, self.elapsed() / self.budget)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        p = min(self.progress(step), 1.0)
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
