"""trtllm-serve's Prometheus families (`/prometheus/metrics`), fed by the CPU engine.

Names, label names and histogram buckets are TensorRT-LLM's MetricsCollector
(`tensorrt_llm/metrics/collector.py`): every family carries `model_name` and
`engine_type`, the success counter adds `finished_reason`. The 1.2 collector
has the request latencies, the success counter and the two KV-cache gauges;
the token counters and the running/waiting gauges carry the names later
releases of the same collector give them. Each app has its own
CollectorRegistry, so two apps in one process never share or clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from toolchain.openai.service import Generation

PREFIX = "trtllm_"
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]


class ServerMetrics:
    def __init__(self, model_name: str, engine_type: str = "cpu"):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": engine_type}
        names = list(self.labels)
        reg = self.registry

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=reg).labels(**self.labels)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, names, registry=reg).labels(**self.labels)

        self.success = Counter(PREFIX + "request_success_total", "Count of successfully processed requests.",
                               names + ["finished_reason"], registry=reg)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TPOT_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens_total", "Cumulative number of prompt tokens processed.",
                                     names, registry=reg).labels(**self.labels)
        self.generation_tokens = Counter(PREFIX + "generation_tokens_total",
                                         "Cumulative number of generation tokens produced.", names,
                                         registry=reg).labels(**self.labels)
        self.running = gauge("num_requests_running", "Number of active requests")
        self.waiting = gauge("num_requests_waiting", "Number of queued requests")
        self.hit_rate = gauge("kv_cache_hit_rate", "KV cache hit rate")
        self.utilization = gauge("kv_cache_utilization", "KV cache utilization")

    def request_done(self, gen: Generation, finish_reason: str) -> None:
        """A request that completed (not cancelled, not failed), as upstream logs only those."""
        self.success.labels(**self.labels, finished_reason=finish_reason).inc()
        end_ns = gen.last_token_ns or gen.arrival_ns
        self.e2e.observe(max(0, end_ns - gen.arrival_ns) / 1e9)
        if gen.first_token_ns:
            self.ttft.observe((gen.first_token_ns - gen.arrival_ns) / 1e9)
        if len(gen.output) > 1:
            self.tpot.observe((gen.last_token_ns - gen.first_token_ns) / 1e9 / (len(gen.output) - 1))
        if gen.stats.first_scheduled_ns:
            self.queue_time.observe(max(0, gen.stats.first_scheduled_ns - gen.arrival_ns) / 1e9)
        self.prompt_tokens.inc(len(gen.prompt_ids))
        self.generation_tokens.inc(len(gen.output))

    def iteration(self, record: dict) -> None:
        """One iteration stats record (the engine's thread), as upstream's log_iteration_stats reads it."""
        self.running.set(record["numActiveRequests"])
        self.waiting.set(record["numQueuedRequests"])
        kv = record["kvCacheStats"]
        self.hit_rate.set(kv["cacheHitRate"])
        if kv["maxNumBlocks"]:
            self.utilization.set(kv["usedNumBlocks"] / kv["maxNumBlocks"])

    def idle(self, kv) -> None:
        """Nothing in flight: no step will run to refresh the gauges, so set them here."""
        self.running.set(0)
        self.waiting.set(0)
        if kv.num_blocks:
            self.utilization.set(kv.used_blocks / kv.num_blocks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
