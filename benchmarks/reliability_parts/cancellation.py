"""Part (b) of benchmarks/reliability.py: a cancellation storm.

Streams to tensorrt_llm cancelled at random points, by closing the client stream and by the `stop` input
with the request id; KV blocks, active requests, stub threads and RSS compared before and after.
"""

from __future__ import annotations

import contextlib
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor

from reliability_parts.common import REQUEST_TIMEOUT_S, proc_snapshot, wait_idle
from toolchain.triton.grpc_client import stream, token_request


def cancel_one(url: str, i: int, rng: random.Random, timeout: float = REQUEST_TIMEOUT_S) -> str:
    """One stream cancelled after a random number of responses, by closing the stream or with `stop`."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    rid = f"s{i}"
    prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 120))]
    after = rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 21, 40])
    how = "close" if i % 2 == 0 else "stop"
    try:
        client.async_stream_infer("tensorrt_llm", token_request(prompt, 100, end_id=([-1], "INT32")), request_id=rid,
                                  enable_empty_final_response=True)
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < after:
            try:
                result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return "hung"
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return "ended-early"
            seen += 1
        if how == "close":
            client.stop_stream(cancel_requests=True)
            return "close"
        client.async_stream_infer("tensorrt_llm", token_request([5], 1, stop=([True], "BOOL")), request_id=rid,
                                  enable_empty_final_response=True)
        finals = 0
        while finals < 2:  # the request's own end and the stop request's final response
            try:
                result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return "hung"
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
        return "stop"
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream()
        client.close()


def part_b(server, n: int) -> dict:
    """`n` streams cancelled from 8 threads after a warm-up; leaks and RSS growth measured around the storm."""
    for i in range(20):  # warm: every code path once, before the "before" snapshot
        stream(server.grpc_url, "tensorrt_llm", token_request([5 + i, 6, 7], 8, end_id=([-1], "INT32")))
        cancel_one(server.grpc_url, i, random.Random(i))
    idle0 = wait_idle(server.metrics_url)
    before = proc_snapshot(server)
    rng = random.Random(1)
    seeds = [rng.randrange(10**9) for _ in range(n)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(lambda i: cancel_one(server.grpc_url, i, random.Random(seeds[i])), range(n)))
    storm_s = time.monotonic() - t0
    idle = wait_idle(server.metrics_url, timeout=60)
    time.sleep(1.0)
    after = proc_snapshot(server)
    probe = stream(server.grpc_url, "tensorrt_llm", token_request([5, 6, 7], 3, end_id=([-1], "INT32")))
    leaked = int(idle.get("kv_used", -1) != 0) + int(idle.get("req_active", -1) != 0)
    return {
        "cancelled_streams": n,
        "outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
        "storm_seconds": round(storm_s, 1),
        "kv_or_slots_leaked": leaked,
        "kv_used_after": idle.get("kv_used"), "active_requests_after": idle.get("req_active"),
        "kv_used_before": idle0.get("kv_used"),
        "threads_leaked": (after["trt_threads"] or 0) - (before["trt_threads"] or 0),
        "rss_growth_pct": round(100.0 * (after["rss_kb"] - before["rss_kb"]) / before["rss_kb"], 2),
        "rss_kb_before_after": [before["rss_kb"], after["rss_kb"]],
        "rss_kb_by_process_before_after": [before["rss_kb_by_process"], after["rss_kb_by_process"]],
        "trt_threads_before_after": [before["trt_threads"], after["trt_threads"]],
        "serves_after": not probe.errors and len(probe.tokens()) == 3,
    }
