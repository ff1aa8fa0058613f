"""Server metrics in the Prometheus text format (vLLM's names under an `mtlqwen:` prefix).

Counters and histograms are updated by the engine thread as deltas are delivered; gauges (requests
running/waiting, KV blocks, prefix-cache and speculative counters) come from the engine's stats()
snapshot. One lock guards everything because /metrics is rendered on the asyncio thread.
"""

from __future__ import annotations

import math
import threading

# Latency buckets in seconds (vLLM-like spread: sub-millisecond decode steps to minute-long requests).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

PREFIX = "mtlqwen:"
# Refusal statuses always listed (at 0 until one happens), so a dashboard's series exist from the start.
REFUSAL_STATUSES = ("400", "401", "404", "408", "413", "429", "503")

# Engine stats keys that may carry a value, first match wins: the prefix cache and speculative
# decoding report under these names when present; absent keys read as 0.
PREFIX_HIT_KEYS = ("prefix_hit_tokens", "prefix_cache_hit_tokens", "cached_tokens")
PREFIX_QUERY_KEYS = ("prefix_query_tokens", "prefix_cache_query_tokens", "prefix_queries")
SPEC_DRAFT_KEYS = ("spec_draft_tokens", "draft_tokens", "num_draft_tokens")
SPEC_ACCEPT_KEYS = ("spec_accepted_tokens", "accepted_tokens", "num_accepted_tokens")


def first_stat(stats: dict, keys: tuple[str, ...]) -> float:
    for k in keys:
        v = stats.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return 0


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.bounds, self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{_fmt(float(b))}"}} {cum}')
        out.append(f"{name}_sum{{{labels}}} {_fmt(self.sum)}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}"'
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}  # by HTTP status: 400 / 401 / 429 ...
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.cached_tokens = 0

    # ---- updates (engine thread, except reject)
    def on_admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def on_tokens(self, n: int, now: float, arrival: float, last: float | None) -> None:
        """n new tokens at `now` for a request that arrived at `arrival` and last produced at `last`."""
        if n <= 0:
            return
        with self.lock:
            self.generation_tokens += n
            if last is None:
                self.ttft.observe(now - arrival)
                n -= 1  # the first token's latency is the TTFT; the rest of this delta shares the gap
                gap = 0.0
            else:
                gap = (now - last) / n
            for _ in range(n):
                self.itl.observe(gap)

    def on_finished(self, reason: str, now: float, arrival: float, cached_tokens: int = 0) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(now - arrival)
            self.cached_tokens += cached_tokens

    def on_rejected(self, status: int) -> None:
        with self.lock:
            self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    # ---- rendering
    def render(self, stats: dict, queued: int = 0) -> str:
        L = self.labels
        total_blocks = stats.get("total_blocks", 0) or 0
        free_blocks = stats.get("free_blocks", total_blocks) or 0
        used = max(total_blocks - free_blocks, 0)
        # Hits as the engine counts them when it reports them; else what finished requests reported.
        hits = first_stat(stats, PREFIX_HIT_KEYS) or self.cached_tokens
        gauges = [
            ("num_requests_running", "Requests in engine slots (prefilling or decoding).", stats.get("running", 0)),
            ("num_requests_waiting", "Requests waiting for a slot (engine queue plus server hand-over).",
             stats.get("waiting", 0) + queued),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", used / total_blocks if total_blocks else 0.0),
            ("kv_blocks_used", "KV block bundles in use.", used),
            ("kv_blocks_total", "KV block bundles in the pool.", total_blocks),
            ("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", stats.get("preemptions", 0)),
            ("prefix_cache_entries", "Prefix-cache entries (snapshots of a prompt prefix).", stats.get("prefix_entries", 0)),
            ("prefix_cache_bytes", "Bytes held by prefix-cache snapshots.", stats.get("prefix_bytes", 0)),
            ("prefix_cache_blocks", "KV blocks held only by the prefix cache (counted in kv_blocks_used; "
             "POST /reset_prefix_cache frees them).", stats.get("prefix_blocks", 0)),
            ("prefix_cache_turn_entries", "Prefix-cache entries at the end of a finished request (a chat's turn).",
             stats.get("prefix_turn_entries", 0)),
            ("prefix_cache_turn_bytes", "Bytes held by turn entries (part of prefix_cache_bytes).", stats.get("prefix_turn_bytes", 0)),
            ("prefix_cache_waiting", "Requests holding a slot while another computes the prefix they share.",
             stats.get("prefix_waiting", 0)),
            ("spec_decode_mean_acceptance_length", "Tokens per speculative verification (accepted drafts + 1; "
             "0 before any).", stats.get("mean_acceptance_length", 0)),
        ]
        out: list[str] = []
        for name, help_, v in gauges:
            out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name}{{{L}}} {_fmt(v)}"]
        with self.lock:
            counters = [
                ("prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                ("generation_tokens_total", "Generated tokens delivered to clients.", self.generation_tokens),
                ("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.", hits),
                ("prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache.",
                 first_stat(stats, PREFIX_QUERY_KEYS)),
                ("prefix_cache_hits_total", "Requests restored from a prefix-cache entry.", stats.get("prefix_hits", 0)),
                ("prefix_cache_turn_hits_total", "Requests restored from a turn entry.", stats.get("prefix_turn_hits", 0)),
                ("prefix_cache_evictions_total", "Prefix-cache entries evicted (budget or KV pressure).",
                 stats.get("prefix_evictions", 0)),
                ("prefix_cache_waits_total", "Requests that waited for another's snapshot of a shared prefix.",
                 stats.get("prefix_waits", 0)),
                ("prefix_cache_wait_timeouts_total", "Waits that reached their limit and computed the prefix anyway.",
                 stats.get("prefix_wait_timeouts", 0)),
                ("engine_steps_total", "Engine steps (one batched forward pass each).", stats.get("steps", 0)),
                ("spec_decode_num_draft_tokens_total", "Draft tokens proposed by speculative decoding.",
                 first_stat(stats, SPEC_DRAFT_KEYS)),
                ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted by verification.",
                 first_stat(stats, SPEC_ACCEPT_KEYS)),
                ("spec_decode_num_drafts_total", "Speculative verifications (one per sequence and step that verified).",
                 stats.get("spec_verifications", 0)),
                ("spec_decode_steps_total", "Engine steps in which some sequence verified drafts.", stats.get("spec_steps", 0)),
                ("spec_decode_plain_steps_total", "Engine steps with a drafter loaded in which nobody verified.",
                 stats.get("plain_steps", 0)),
                ("spec_decode_plain_decodes_total", "Sequences that decoded one token without drafts while a drafter "
                 "was loaded.", stats.get("plain_decodes", 0)),
            ]
            for name, help_, v in counters:
                out += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} counter", f"{PREFIX}{name}{{{L}}} {_fmt(v)}"]
            name = f"{PREFIX}request_success_total"
            out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
            for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
                out.append(f'{name}{{{L},finished_reason="{reason}"}} {self.finished.get(reason, 0)}')
            name = f"{PREFIX}request_rejected_total"
            out += [f"# HELP {name} Requests refused before running, by HTTP status.", f"# TYPE {name} counter"]
            for status in sorted(set(self.rejected) | set(REFUSAL_STATUSES)):
                out.append(f'{name}{{{L},status="{status}"}} {self.rejected.get(status, 0)}')
            for hname, help_, h in (
                ("time_to_first_token_seconds", "Time from request arrival to its first token.", self.ttft),
                ("inter_token_latency_seconds", "Time between consecutive tokens of a request.", self.itl),
                ("e2e_request_latency_seconds", "Time from request arrival to its end.", self.e2e),
            ):
                out += [f"# HELP {PREFIX}{hname} {help_}", f"# TYPE {PREFIX}{hname} histogram"]
                out += h.lines(PREFIX + hname, L)
        return "\n".join(out) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
