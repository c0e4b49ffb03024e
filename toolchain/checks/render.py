"""The plan as a dict (for --json) and as text: per-rank table, verdict, commands, checks."""

from __future__ import annotations

from toolchain.dynamo.roles import role_of, role_spec, split_of, split_performance
from toolchain.errors import ToolchainError
from toolchain.gpus import GIB, Gpu
from toolchain.plan.perf import bar_text, performance_dict
from toolchain.archs.layout import layout_problems
from toolchain.plan.lora import Pool, RankLora
from toolchain.plan.plan import plan_memory
from toolchain.slo import judged_on, predicted_value, thresholds
from toolchain.checks.lora import size_text
from toolchain.checks.registry import FAIL, CheckResult, Context, build_context


def _size(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


def report_dict(ctx: Context, results: list[CheckResult]) -> dict:
    """Everything the planner found; the CLI adds build and launch commands."""
    spec, model = ctx.spec, ctx.model
    memory = ctx.memory
    if memory is None and model is not None and ctx.device is None and \
            not layout_problems(model.params, spec.parallelism.layout):
        # No GPU named: weights and KV bytes per token are still known, capacities are not.
        memory = plan_memory(spec, model, ctx.quant, Gpu("no GPU named", 0.0, None), suggest=False)
    ranks = []
    for r in memory.ranks if memory else []:
        ranks.append({
            "rank": r.rank, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank, "layers": list(r.layers),
            "weights_bytes": r.weights_bytes, "checkpoint_bytes": r.checkpoint_bytes,
            "kv_bytes_per_token": r.kv_bytes_per_token,
            "kv_tokens_capacity": r.kv_tokens_capacity if ctx.memory else None,
            "activation_bytes_estimate": r.activation_bytes, "workspace_bytes_estimate": r.workspace_bytes,
            "cuda_graph_bytes_estimate": r.cuda_graph_bytes,
            "draft_bytes": r.draft_bytes, "free_bytes": r.free_bytes if ctx.memory else None,
            "kv_pool_bytes": r.kv_pool_bytes if ctx.memory else None,
            **({"lora": lora_dict(r.lora)} if r.lora is not None else {}),
        })
    failed = [r.id for r in results if r.status == FAIL]
    fits = bool(ctx.memory and ctx.memory.fits)
    dev = ctx.device
    perf = performance_dict(spec, model, ctx.quant, dev, ctx.memory, ctx.draft)
    if spec.dynamo.disaggregated and perf.get("predicted") and dev is not None and dev.kind == "gpu":
        perf = split_dict(spec)  # Dynamo's split (the CPU engine has none: dynamo.checks refuses it there)
    return {
        "name": spec.name, "target": spec.target,
        "architecture": model.params.architecture if model else None,
        "parallelism": {"tp": spec.parallelism.tp, "pp": spec.parallelism.pp,
                        "world_size": spec.parallelism.world_size},
        "device": {"name": dev.name, "memory_gib": round(dev.memory_gib, 2), "sm": dev.sm, "kind": dev.kind}
        if dev else None,
        "weight_format": ctx.quant.describe(dev.sm if dev else None), "quantization": ctx.quant.weight_method,
        "weight_dtype": memory.weight_dtype if memory else None, "kv_cache_dtype": memory.kv_dtype if memory else None,
        "ranks": ranks,
        "sequence_tokens": memory.sequence_tokens if memory else None,
        "kv_tokens_capacity": ctx.memory.kv_tokens_capacity if ctx.memory else None,
        "concurrency": ctx.memory.concurrency if ctx.memory else None,
        "draft_kv_tokens_capacity": ctx.memory.draft_kv_tokens_capacity if ctx.memory else None,
        "fits": fits,
        "verdict": ctx.memory.verdict() if ctx.memory else "unknown: no GPU to plan against (see gpu.known)",
        "suggestions": ctx.memory.suggestions if ctx.memory else [],
        "estimates": ("activation_bytes_estimate, workspace_bytes_estimate and cuda_graph_bytes_estimate are estimates "
                      "(TensorRT-LLM docs/source/legacy/reference/memory.md gives no formula)"),
        "eos": ctx.eos.as_dict() if ctx.eos else None,
        "performance": perf,
        "slo": slo_dict(spec, perf),
        "checks": [r.as_dict() for r in results],
        "failed_checks": failed,
        "ok": fits and not failed,
    }


def split_dict(spec) -> dict:
    """A disaggregated spec's prediction (target llmapi under Dynamo): each role planned as its own spec, then
    the split (plan/perf/disagg.py), what `toolchain tune` ranked it by; or why there is none."""
    roles = {}
    for name, workers in (("prefill", spec.dynamo.prefill_workers), ("decode", spec.dynamo.decode_workers)):
        try:
            rspec = role_spec(spec, name)
            ctx = build_context(rspec, "plan")
        except ToolchainError as err:
            return {"predicted": False, "note": f"disaggregated: {err.message}"}
        if ctx.model is None or ctx.device is None or ctx.memory is None or not ctx.memory.fits:
            return {"predicted": False, "note": f"disaggregated: the {name} workers do not fit (plan {rspec.name} "
                                                "with the role's settings to see why)"}
        roles[name] = role_of(rspec, ctx.model, ctx.quant, ctx.device, ctx.memory, workers, ctx.draft)
        device = ctx.device
    try:
        return split_performance(spec, split_of(spec, roles["prefill"], roles["decode"]), device)
    except ToolchainError as err:
        return {"predicted": False, "note": f"disaggregated: {err.message}"}


def lora_dict(c: RankLora) -> dict:
    """One rank's LoRA caches (plan/lora.py): the page geometry, each pool and the adapters' bytes."""
    def pool(p: Pool | None) -> dict | None:
        return None if p is None else {"bytes": p.nbytes, "slots": p.slots, "pages": p.pages,
                                       "max_size_adapters": p.adapters, "holds_one": p.enough, "sized_by": p.budget}
    g = c.geometry
    return {"dtype": c.dtype, "page_width": g.page_width, "slots_per_page": g.slots_per_page,
            "max_adapter_size": g.max_adapter_size, "max_adapter_bytes": c.max_adapter_bytes,
            "host_cache": pool(c.host), "device_cache": pool(c.device),
            "device_budget_after_kv_bytes": c.after_kv_bytes if c.device is not None else None,
            "adapter_bytes": dict(c.adapter_bytes)}


def _lora_lines(ranks: list[dict]) -> list[str]:
    """The LoRA caches of each rank, one line each."""
    lines = []
    for r in ranks:
        c = r.get("lora")
        if c is None:
            continue
        pools = [f"host {size_text(c['host_cache']['bytes'])} holds {c['host_cache']['max_size_adapters']}"]
        if c["device_cache"] is not None:
            pools.append(f"device {size_text(c['device_cache']['bytes'])} holds {c['device_cache']['max_size_adapters']}")
        each = ", ".join(f"{n} {size_text(b)}" for n, b in c["adapter_bytes"].items())
        lines.append(f"  rank {r['rank']}: {', '.join(pools)} max-size adapters (rank {c['max_adapter_size']}, "
                     f"{size_text(c['max_adapter_bytes'])}, {c['dtype']})" + (f"; adapters {each}" if each else ""))
    if lines:
        device = any(r.get("lora", {}).get("device_cache") for r in ranks)
        lines.insert(0, "LoRA caches per rank" + (" (the device cache out of what the KV cache leaves):" if device else ":"))
    return lines


def slo_dict(spec, perf: dict) -> dict:
    """The spec's SLO judged on the prediction: each bound the model predicts a counterpart of, with the predicted
    mean it is judged on (`judged_on` says which percentiles a mean stands for), and the bounds it cannot judge."""
    ths = thresholds(spec.validation.slo)
    if not ths or not perf.get("predicted"):
        return {}
    out: dict = {"thresholds": {}, "not_predicted": [], "judged_on": judged_on(ths)}
    for t in ths:
        value = predicted_value(t, perf["ttft_ms"], perf["tpot_ms"], perf["workload"]["output_tokens"])
        if value is None:
            out["not_predicted"].append(t.name)
        else:
            out["thresholds"][t.name] = {"limit": t.value, "predicted_mean": round(value, 3), "met": value <= t.value}
    return out


def _slo_lines(slo: dict | None) -> list[str]:
    """One line: each predicted bound, the mean it was judged on and whether it holds, and what that judged."""
    if not slo or not (slo["thresholds"] or slo["not_predicted"]):
        return []
    parts = [f"{name} <= {v['limit']:g} judged on the predicted mean {v['predicted_mean']:,.2f} ms: "
             f"{'met' if v['met'] else 'MISSED'}" for name, v in slo["thresholds"].items()]
    if slo["not_predicted"]:
        parts.append(f"not predicted: {', '.join(slo['not_predicted'])}")
    if slo["judged_on"]:
        parts.append("the model predicts means, no percentiles")
    return [f"  slo: {'; '.join(parts)}"]


def _performance_lines(perf: dict | None) -> list[str]:
    """The short performance block: the maximum throughput, and latency at the workload's concurrency."""
    if not perf:
        return []
    if not perf["predicted"]:
        return [f"performance: {perf['note']}"]
    wl = perf["workload"]
    cost = (f"; ${perf['usd_per_million_output_tokens']:.3f} per million output tokens"
            if perf["usd_per_million_output_tokens"] is not None else "")
    unit = "rank" if perf["basis"].startswith("host profile") else "GPU"  # the CPU engine's ranks share this host
    bar = perf.get("error_bar")
    lines = [f"performance ({perf['basis']}):",
             f"  max {perf['max_output_tokens_per_s']:,.0f} output tokens/s{' ' + bar_text(bar) if bar else ''} "
             f"({perf['per_gpu_output_tokens_per_s']:,.0f} "
             f"per {unit}) at batch {perf['batch_size_at_max']} of {perf['batch_limit']} "
             f"({perf['batch_limited_by']}), ISL {wl['input_tokens']} / OSL {wl['output_tokens']}{cost}",
             f"  at concurrency {perf['concurrency']}: mean TTFT {perf['ttft_ms']:,.1f} ms, mean TPOT {perf['tpot_ms']:.2f} ms; "
             f"context {perf['bound']['context']}-bound, generation {perf['bound']['generation']}-bound"]
    if bar:
        lines.append(f"  error bar ±{bar['pct']:.1f}% (the model's median throughput error on the nearest known cells): "
                     f"{bar['nearest']}")
    elif unit == "GPU" and "error_bar" in perf:
        lines.append("  error bar: none (no published or measured cell near this GPU, format, size and TP)")
    split = perf.get("disaggregated")
    if split:
        pre, dec = split["prefill"], split["decode"]
        lines.append(f"  disaggregated: {pre['workers']} prefill x tp {pre['tp']} ({pre['seq_per_s']:,.1f} prompts/s), "
                     f"{dec['workers']} decode x tp {dec['tp']} ({dec['seq_per_s']:,.1f} requests/s at batch "
                     f"{dec['batch_at_max']} each); KV transfer {split['kv_transfer_ms']:.2f} ms over {split['link']}; "
                     f"{split['bottleneck']}-bound")
    lines += [f"  note: {n}" for n in perf["notes"]]
    return lines


def render_text(report: dict) -> str:
    out = []
    dev = report["device"]
    where = f"{dev['name']} ({dev['memory_gib']:.1f} GiB" + (f", SM {dev['sm']})" if dev["sm"] else ")") \
        if dev else "no GPU named"
    par = report["parallelism"]
    out.append(f"plan {report['name']}: {report['architecture']}, target {report['target']}, "
               f"tp {par['tp']} x pp {par['pp']} on {where}")
    out.append(f"weights {report['weight_format']} ({report['weight_dtype']} elsewhere), "
               f"KV cache {report['kv_cache_dtype']}")
    out.append("")
    head = ("rank", "tp", "pp", "layers", "weights", "act+logits*", "workspace*", "free for KV", "KV B/token",
            "KV tokens")
    rows = [head]
    for r in report["ranks"]:
        layers = f"{r['layers'][0]}-{r['layers'][1]}" if r["layers"][1] >= r["layers"][0] else "-"
        act = r["activation_bytes_estimate"] + r["draft_bytes"] + r["cuda_graph_bytes_estimate"]
        rows.append((str(r["rank"]), str(r["tp_rank"]), str(r["pp_rank"]), layers, _size(r["weights_bytes"]),
                     _size(act) + (" +draft" if r["draft_bytes"] else "")
                     + (" +graphs" if r["cuda_graph_bytes_estimate"] else ""), _size(r["workspace_bytes_estimate"]),
                     _size(r["free_bytes"]) if r["free_bytes"] is not None else "?", f"{r['kv_bytes_per_token']:,}",
                     f"{r['kv_tokens_capacity']:,}" if r["kv_tokens_capacity"] is not None else "?"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        out.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=False)).rstrip())
    out.append("* estimates: activations of the build profile plus logits buffers (+graphs: the LLM-API path's CUDA-graph "
               "pool); CUDA context and workspaces")
    if report["concurrency"] is not None:
        out.append(f"longest sequence ({report['sequence_tokens']} KV tokens): {report['concurrency']} fit at once "
                   f"in {report['kv_tokens_capacity']:,} KV tokens per rank")
    out.append(f"verdict: {report['verdict']}")
    out.extend(_lora_lines(report["ranks"]))
    out.extend(_performance_lines(report.get("performance")))
    out.extend(_slo_lines(report.get("slo")))
    if report.get("eos"):
        e = report["eos"]
        out.append(f"end ids: end_id {e['end_id']}, stop ids {e['stop_ids']}, pad_id {e['pad_id']} ({e['source']})")
    out.append("")
    if report.get("build_note"):
        out.append(f"build: {report['build_note']}")
    else:
        out.append("build:" if report.get("build_commands") else "build: toolchain build-engine (target cpu, no trtllm-build)")
    for cmd in report.get("build_commands", []):
        out.append(f"  {cmd}")
    if report.get("launch_command"):
        out.append("launch:")
        out.append(f"  {report['launch_command']}")
    if report.get("openai_command"):
        out.append("OpenAI server:")
        out.append(f"  {report['openai_command']}")
    out.append("")
    out.append("checks:")
    width = max((len(c["id"]) for c in report["checks"]), default=0)
    for c in report["checks"]:
        out.append(f"  {c['status'].upper():<4}  {c['id']:<{width}}  {c['message']}")
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in ("pass", "warn", "fail", "skip")}
    out.append(f"  {counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed, "
               f"{counts['skip']} skipped")
    return "\n".join(out)
