"""Prometheus metrics of the server, in one registry per server (so tests can run several).

Engine state (running and waiting requests, cache blocks, prefix-cache lookups, preemptions,
aborted and failed requests, speculative decoding's draft and accepted tokens with vLLM's meaning)
is read when /metrics is scraped; per-request figures (tokens, latencies) are recorded from the
engine thread after each step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from flashdsa.runtime.engine import LLMEngine
from flashdsa.runtime.sequence import RequestOutput

PREFIX = "flashdsa:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class _EngineCounters:
    """Collector turning the engine's and scheduler's cumulative counters into Prometheus counters."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        engine, scheduler = self.engine, self.engine.scheduler
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", scheduler.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", scheduler.prefix_hits),
            ("num_preemptions", "Sequences preempted (recomputed later) for lack of cache blocks", scheduler.num_preemptions),
            ("request_aborted", "Requests dropped unfinished (client gone)", engine.num_aborted),
            ("request_failed", "Requests ended by an error in their processing", engine.num_failed),
            ("spec_decode_num_draft_tokens", "Draft tokens of the MTP layer verified by the main model",
             engine.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", engine.num_accepted_tokens),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        scheduler, blocks = engine.scheduler, engine.block_manager
        Gauge(PREFIX + "num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: len(scheduler.running)
        )
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: len(scheduler.waiting)
        )
        Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of cache blocks held by requests", registry=r).set_function(
            lambda: blocks.usage
        )
        Gauge(PREFIX + "num_blocks_used", "Cache blocks held by requests", registry=r).set_function(
            lambda: blocks.num_used_blocks
        )
        Gauge(PREFIX + "num_blocks_free", "Cache blocks free for new tokens (prefix-cached ones included)",
              registry=r).set_function(lambda: blocks.num_free_blocks)
        Gauge(PREFIX + "num_blocks_total", "Cache blocks in all", registry=r).set_function(lambda: blocks.num_blocks)
        r.register(_EngineCounters(engine))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            PREFIX + "request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.ttft is not None:
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.ttft.observe(out.ttft)
            if out.itl is not None:
                self.itl.observe(out.itl)
            if out.finished and out.error is None:  # failures count in request_failed
                self.finished.labels(out.finish_reason or "unknown").inc()
                if out.e2e is not None:
                    self.e2e.observe(out.e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
