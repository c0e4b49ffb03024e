"""The harness's own Prometheus metrics, served while it runs (`--prometheus-port`).

Its own registry (nothing from the process's default collectors), labelled by
load level and traffic class, observed as each request completes so a
dashboard can watch a long sweep live. Token counts that need the tokenizer
are counted at completion when the exporter is on (a small cost on the loop,
which is why it is opt-in).
"""

from __future__ import annotations

from toolchain.bench import metrics as M
from toolchain.bench.records import RequestRecord

# Seconds; fine at the low end where TPOT and ITL live.
_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class Exporter:
    def __init__(self, port: int, host: str = "127.0.0.1", counter=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = reg = CollectorRegistry()
        labels = ("level", "cls")

        def hist(name, doc):
            return Histogram(name, doc, labels, buckets=_BUCKETS, registry=reg)

        self.ttft = hist("llm_ttft_seconds", "Time to first token (first response carrying a token)")
        self.tpot = hist("llm_tpot_seconds", "Time per output token after the first, per request")
        self.itl = hist("llm_itl_seconds", "Gap between consecutive token-bearing responses")
        self.e2e = hist("llm_e2e_seconds", "Send to last token")
        self.lag = hist("llm_send_lag_seconds", "Actual send time minus scheduled send time")
        self.tokens = Counter("llm_tokens_generated", "Output tokens received", labels, registry=reg)
        self.requests = Counter("llm_requests", "Requests finished, by outcome", (*labels, "outcome"), registry=reg)
        self.in_flight = Gauge("llm_requests_in_flight", "Requests sent and not finished", registry=reg)
        self.load = Gauge("llm_target_load", "Target of the running level (concurrency or req/s)", registry=reg)
        self.counter = counter
        self.server, self.thread = start_http_server(port, addr=host, registry=reg)
        self.port = self.server.server_address[1]

    def observe(self, rec: RequestRecord) -> None:
        if rec.warmup:
            return
        if self.counter is not None:
            self.counter.fill([rec])
        lv = (str(rec.level), rec.cls)
        outcome = "cancelled" if rec.cancelled else ("timeout" if rec.timed_out else
                                                     ("error" if rec.error or not rec.ok else "ok"))
        self.requests.labels(*lv, outcome).inc()
        lag = rec.send_lag_ns
        if lag is not None:
            self.lag.labels(*lv).observe(lag / 1e9)
        if outcome != "ok":
            return
        m = M.request_metrics(rec)
        self.tokens.labels(*lv).inc(m["osl"])
        for hist, key in ((self.ttft, "ttft"), (self.tpot, "tpot"), (self.e2e, "e2e")):
            if m[key] is not None:
                hist.labels(*lv).observe(m[key] / 1e3)
        for gap, _ in m["itl"]:
            self.itl.labels(*lv).observe(gap / 1e3)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
