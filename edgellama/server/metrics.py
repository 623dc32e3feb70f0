"""GET /metrics (serve --metrics): the engine's counters in Prometheus' text format,
under llama-server's metric names, so dashboards made for llama-server read this one.

Counters (EngineCounters) are kept by the engine thread as requests move (engine.py
calls on_prompt, on_release, on_pass); the gauges are read at scrape time from the
engine's slots and queue. The prometheus-client library writes the text, from a
CollectorRegistry of the app's own (not the library's global one: two apps in one
process, as in the tests, each report their own engine).

As llama-server: prompt_tokens_seconds and predicted_tokens_seconds are the throughput
since the previous scrape (tokens over the requests' own prompt and generation time;
0 when none finished in between), so each scrape starts a new period;
n_busy_slots_per_decode is busy slots per model pass since the start. Names that
llama-server has no equivalent for are under edgellama: (slot occupancy, the queue's
bound). kv_cache_tokens and kv_cache_usage_ratio are llama-server's older gauges, still
read by dashboards.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Prometheus' text format 0.0.4, as llama-server labels it: what every scraper reads (the
# library's own default became 1.0.0, which older Prometheus servers do not know)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

if TYPE_CHECKING:
    from .engine import Engine
    from .job import Job


@dataclass
class EngineCounters:
    """What the engine has done since it started, and since the last scrape (the
    bucket). Written by the engine thread, read by a scrape: one lock."""
    prompt_tokens: int = 0          # prompt tokens read (not those a slot's cache held)
    prompt_cached: int = 0          # prompt tokens a slot's cache already held
    prompt_seconds: float = 0.0     # from a request's admission to its first decode step
    predicted_tokens: int = 0       # tokens generated (usage's completion_tokens)
    predicted_seconds: float = 0.0  # from a request's first decode step to its end
    passes: int = 0                 # model passes: prompt chunks and decode steps
    busy_slots: int = 0             # busy slots summed over the passes
    tokens_max: int = 0             # the most tokens a slot's cache held after a request
    drafted: int = 0                # speculative decoding: tokens proposed, kept
    accepted: int = 0
    requests: int = 0               # requests that had a slot and left it
    bucket: list[float] = field(default_factory=lambda: [0, 0.0, 0, 0.0])
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on_prompt(self, job: Job, now: float) -> None:
        """The job's prompt is read: its first decode step starts now."""
        seconds = now - job.t_admitted
        with self.lock:
            self.prompt_tokens += len(job.ids) - job.reused
            self.prompt_cached += job.reused
            self.prompt_seconds += seconds
            self.bucket[0] += len(job.ids) - job.reused
            self.bucket[1] += seconds
        job.t_generating = now

    def on_release(self, job: Job, cached: int, now: float) -> None:
        """The job left its slot (finished, failed or cancelled); `cached`: the tokens
        its slot's cache holds."""
        with self.lock:
            self.requests += 1
            self.tokens_max = max(self.tokens_max, cached)
            self.drafted += job.drafted
            self.accepted += job.accepted
            if job.t_generating is not None:
                seconds = now - job.t_generating
                self.predicted_tokens += job.count
                self.predicted_seconds += seconds
                self.bucket[2] += job.count
                self.bucket[3] += seconds

    def on_pass(self, busy: int) -> None:
        with self.lock:
            self.passes += 1
            self.busy_slots += busy

    def snapshot(self) -> tuple[dict, list[float]]:
        """The counters, and the bucket since the last snapshot (emptied)."""
        with self.lock:
            values = {k: v for k, v in vars(self).items() if k not in ("bucket", "lock")}
            bucket, self.bucket = self.bucket, [0, 0.0, 0, 0.0]
        return values, bucket


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


class _EngineCollector:
    """A prometheus-client collector over one engine, read at each scrape."""

    def __init__(self, engine: Engine, ctx: int):
        self.engine, self.ctx = engine, ctx

    def collect(self) -> Iterator[Metric]:
        c, (b_prompt, b_prompt_s, b_pred, b_pred_s) = self.engine.counters.snapshot()
        status, slots = self.engine.status(), self.engine.slot_status()
        cached = sum(slots["cached_tokens"])

        def counter(name, doc, value, prefix="llamacpp"):
            return CounterMetricFamily(f"{prefix}:{name}", doc, value=value)

        def gauge(name, doc, value, prefix="llamacpp"):
            return GaugeMetricFamily(f"{prefix}:{name}", doc, value=value)

        yield counter("prompt_tokens_total", "Number of prompt tokens processed.",
                      c["prompt_tokens"])
        yield counter("prompt_tokens_cached_total", "Number of prompt tokens reused from a "
                      "slot's cache.", c["prompt_cached"])
        yield counter("prompt_seconds_total", "Prompt process time", c["prompt_seconds"])
        yield counter("tokens_predicted_total", "Number of generation tokens processed.",
                      c["predicted_tokens"])
        yield counter("tokens_predicted_seconds_total", "Predict process time",
                      c["predicted_seconds"])
        yield counter("n_decode_total", "Total number of model passes (prompt chunks and "
                      "decode steps).", c["passes"])
        yield counter("spec_decode_num_draft_tokens_total", "Speculative decoding: draft "
                      "tokens proposed.", c["drafted"])
        yield counter("spec_decode_num_accepted_tokens_total", "Speculative decoding: draft "
                      "tokens accepted.", c["accepted"])
        yield counter("requests_total", "Number of requests that took a slot and ended "
                      "(finished, failed or cancelled).", c["requests"], "edgellama")
        # llama-server types it a counter, but it is a high-water mark, and a counter's
        # name must end in _total
        yield gauge("n_tokens_max", "Largest observed n_tokens.", c["tokens_max"])
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    _rate(b_prompt, b_prompt_s))
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                    _rate(b_pred, b_pred_s))
        yield gauge("requests_processing", "Number of requests processing.",
                    status["running"])
        yield gauge("requests_deferred", "Number of requests deferred.", status["waiting"])
        yield gauge("n_busy_slots_per_decode", "Average number of busy slots per model pass",
                    c["busy_slots"] / max(c["passes"], 1))
        yield gauge("kv_cache_tokens", "KV-cache tokens.", cached)
        yield gauge("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                    cached / (slots["parallel"] * self.ctx))
        yield gauge("slots_total", "Number of slots (--parallel).", slots["parallel"],
                    "edgellama")
        yield gauge("slots_busy", "Number of slots running a request.", slots["busy"],
                    "edgellama")
        yield gauge("queue_capacity", "Requests that may wait for a slot (--queue).",
                    status["capacity"], "edgellama")


class Metrics:
    """The /metrics text of one engine."""

    def __init__(self, engine: Engine, ctx: int):
        self.registry = CollectorRegistry(auto_describe=False)   # no scrape at register:
        self.registry.register(_EngineCollector(engine, ctx))    # a scrape empties the bucket
        self.started = int(time.time())

    def text(self) -> bytes:
        return generate_latest(self.registry)
