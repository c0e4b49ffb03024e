"""Server-side cross-check: Triton's Prometheus endpoint scraped before and after each level.

Counters (`nv_inference_*`, per model) are reported as deltas over the level;
the `nv_trt_llm_*` gauges (present with the TensorRT-LLM backend) as their
values after the level; the `nv_llm_*_token_len` histograms as deltas of sum
and count, which give the server's own output-token total to set beside the
client's. A scrape that fails leaves a note, never an error: the latency
figures do not depend on it.
"""

from __future__ import annotations

import re
import urllib.request

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
            "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
            "nv_inference_compute_infer_duration_us")


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text format -> {(name, sorted label items): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m["labels"] or "")))
        out[(m["name"], labels)] = value
    return out


def scrape(url: str | None, timeout_s: float = 3.0) -> dict | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse(resp.read().decode("utf-8", "replace"))
    except Exception:
        return None


def _model_of(labels: tuple) -> str | None:
    return dict(labels).get("model")


def delta(before: dict | None, after: dict | None, model: str) -> dict:
    """What the server says happened during a level, for `model` (and every model for the counters)."""
    if before is None or after is None:
        return {"available": False, "note": "metrics endpoint not reachable (or not given): no server cross-check"}
    per_model: dict[str, dict[str, float]] = {}
    for (name, labels), value in after.items():
        if name in COUNTERS:
            m = _model_of(labels)
            if m is None:
                continue
            d = value - before.get((name, labels), 0.0)
            per_model.setdefault(m, {})[name.removeprefix("nv_inference_")] = d
    out: dict = {"available": True, "models": per_model, "endpoint_model": model}
    mine = per_model.get(model, {})
    ok = mine.get("request_success")
    out["server_requests_success"] = ok
    out["server_requests_failure"] = mine.get("request_failure")
    trt = {}
    for (name, labels), value in after.items():
        if name.startswith("nv_trt_llm_"):
            key = name + "{" + ",".join(f"{k}={v}" for k, v in labels if k not in ("model", "version")) + "}"
            trt[key] = value
        elif name.startswith("nv_llm_") and (name.endswith("_sum") or name.endswith("_count")):
            trt[name] = value - before.get((name, labels), 0.0)
    if trt:
        out["trt_llm"] = trt
        tokens = trt.get("nv_llm_output_token_len_sum")
        if tokens is not None:
            out["server_output_tokens"] = tokens
    spec = _speculation(before, after)
    if spec:
        out["speculation"] = spec
    return out


SPEC_FAMILY = "toolchain_spec_decode_metrics"


def _speculation(before: dict, after: dict) -> dict | None:
    """Draft tokens verified and accepted during the level, from the CPU tensorrt_llm model's
    toolchain_spec_decode_metrics (Medusa decodes inside the model, so no client sees them)."""
    totals: dict[str, float] = {}
    for (name, labels), value in after.items():
        if name == SPEC_FAMILY:
            key = dict(labels).get("spec_decode_metric")
            if key in ("total_draft_tokens", "total_accepted_draft_tokens", "draft_steps"):
                totals[key] = totals.get(key, 0.0) + value - before.get((name, labels), 0.0)
    drafted = totals.get("total_draft_tokens", 0.0)
    if not drafted:
        return None
    accepted, steps = totals.get("total_accepted_draft_tokens", 0.0), totals.get("draft_steps", 0.0)
    return {"draft_tokens": int(drafted), "accepted_draft_tokens": int(accepted), "steps": int(steps),
            "acceptance_rate": accepted / drafted, "accepted_per_step": accepted / steps if steps else None}
