"""Disaggregated serving: our prediction (plan/perf/disagg.py) beside AIConfigurator 0.12.0's own disaggregated
estimate, on configurations it has kernel data for (Llama-3.1 8B / 70B, FP8 weights and KV cache, h100_sxm /
h200_sxm, TensorRT-LLM 1.3.0rc20 data), for the same inputs: the same config.json (build/configs), ISL/OSL, and
per role tp, batch and workers.

AIConfigurator runs in its own venv (plan/crosscheck.py ensure_venv: benchmarks/.venv/aiconfigurator, made on
first use) as `aiconfigurator cli estimate --estimate-mode disagg`, its report parsed by crosscheck.parse. Ours is
the split as `toolchain tune` predicts it: each role planned as its own spec (dynamo/roles.py), prefill workers at
AIConfigurator's batch (max_batch_size = its prefill batch, max_num_tokens ceil((isl + 500) / 32) x 32 as its
generator rule sets it), decode workers at its decode batch, at its concurrency (decode batch x decode workers).

Ratios are ours / AIConfigurator's. The models differ on purpose in three places, so expect:
- TTFT: AIConfigurator multiplies the prefill step by 1.8 whatever the load (picking.py
  _AUTOSCALE_TTFT_CORRECTION_FACTOR) and has no KV transfer (inference_session.py: "TODO, should consider kvcache
  model in future"); ours adds the transfer and the fixed handshake and an M/D/1 queue at the offered rate. The
  `aic_conventions` block applies its 1.8 to our prefill alone, without transfer, to isolate the step costs.
- throughput: AIConfigurator derates the prefill side by 0.9 and the decode side by 0.92 (rate matching); ours
  takes min(P x prefill, D x decode) as is, and in closed loop at the concurrency TTFT + (osl - 1) x TPOT bounds it.
- TPOT: both a generation-only step at the decode batch; what differs is the step cost itself (ours: a roofline
  x fitted efficiencies; AIConfigurator: measured kernels), which is what issue 39's kernel layer addresses.

    python benchmarks/disagg_crosscheck.py [--json PATH] [--venv DIR]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402
from toolchain.checks.preflight import build_context  # noqa: E402
from toolchain.dynamo.roles import role_of, role_spec  # noqa: E402
from toolchain.errors import ToolchainError  # noqa: E402
from toolchain.plan import crosscheck  # noqa: E402
from toolchain.plan.perf.disagg import Split, decode_seq_per_s, predict_disagg, prefill_worker  # noqa: E402
from toolchain.spec import load_spec  # noqa: E402

BASE = REPO / "build" / "llama3-8b-llmapi-h100.yaml"
CONFIGS = REPO / "build" / "configs"
GPUS = {"h100_sxm": "H100 80GB", "h200_sxm": "H200 141GB"}
# name, config directory, AIConfigurator system, isl, osl, prefill (tp, batch, workers), decode (tp, batch, workers)
CASES = [
    ("llama-3.1-8b h100 1024/1024 p1xTP1 d2xTP1", "llama-3-8b-instruct", "h100_sxm", 1024, 1024, (1, 1, 1),
     (1, 64, 2)),
    ("llama-3.1-8b h200 8192/512 p3xTP1 d1xTP2", "llama-3-8b-instruct", "h200_sxm", 8192, 512, (1, 1, 3),
     (2, 128, 1)),
    ("llama-3.1-70b h200 4000/500 p2xTP2 d1xTP4", "llama-3.1-70b-instruct", "h200_sxm", 4000, 500, (2, 1, 2),
     (4, 64, 1)),
    ("llama-3.1-70b h100 2048/256 p1xTP4 d1xTP4", "llama-3.1-70b-instruct", "h100_sxm", 2048, 256, (4, 1, 1),
     (4, 32, 1)),
]
TTFT_FACTOR, PREFILL_DERATE, DECODE_DERATE = 1.8, 0.9, 0.92  # AIConfigurator 0.12.0 picking.py


def ours(config: str, system: str, isl: int, osl: int, prefill: tuple, decode: tuple) -> dict:
    (ptp, pbs, pw), (dtp, dbs, dw) = prefill, decode
    block = 32
    prompt_tokens = math.ceil((isl + 500) / block) * block  # AIConfigurator's generator rule for prefill
    spec = load_spec(BASE, [
        "llmapi.options={}", "speculative.mode=none", f"model.checkpoint={CONFIGS / config}",
        f"gpu.name={GPUS[system]}", "quantization.method=fp8", "quantization.kv_cache=fp8",
        "serving.kv_cache_free_gpu_mem_fraction=0.9", f"build.tokens_per_block={block}",
        f"limits.max_input_len={isl}", f"limits.max_seq_len={isl + osl + 1}",
        f"limits.max_num_tokens={max(prompt_tokens, dbs)}", f"parallelism.tp={dtp}",
        f"validation.workload.input_tokens={isl}", f"validation.workload.output_tokens={osl}",
        "dynamo.disaggregated=true", f"dynamo.prefill_workers={pw}", f"dynamo.decode_workers={dw}",
        f"dynamo.prefill.tp={ptp}", f"dynamo.prefill.max_batch_size={pbs}",
        f"dynamo.prefill.max_num_tokens={prompt_tokens}", f"dynamo.decode.tp={dtp}",
        f"dynamo.decode.max_batch_size={dbs}"])
    roles = {}
    for name, workers in (("prefill", pw), ("decode", dw)):
        rspec = role_spec(spec, name)
        ctx = build_context(rspec, "plan")
        roles[name] = role_of(rspec, ctx.model, ctx.quant, ctx.device, ctx.memory, workers)
    same_node = pw * ptp + dw * dtp <= spec.gpu.per_node
    split = Split(roles["prefill"], roles["decode"], isl, osl, spec.build.chunked_context, block, same_node)
    concurrency = dbs * dw
    perf = predict_disagg(split, concurrency)
    pre = prefill_worker(split)
    gpus = split.gpus
    prefill_rate, decode_rate = pw * pre.seq_per_s(), dw * decode_seq_per_s(split, dbs)
    return {
        "ttft_ms": perf["ttft_ms"], "tpot_ms": perf["tpot_ms"],
        "tokens_per_s_per_gpu": round(perf["output_tokens_per_s"] / gpus, 1),
        "capacity_tokens_per_s_per_gpu": round(min(prefill_rate, decode_rate) * osl / gpus, 1),
        "prefill_compute_ms": perf["disaggregated"]["prefill"]["compute_ms"],
        "prefill_queue_ms": perf["disaggregated"]["prefill"]["queue_ms"],
        "fixed_ms": roles["prefill"].dep.eff.ttft_ms,  # the fitted per-request cost TTFT carries (Efficiency.ttft_ms)
        "kv_transfer_ms": perf["disaggregated"]["kv_transfer_ms"], "link": perf["disaggregated"]["link"],
        "same_node": same_node, "bottleneck": perf["disaggregated"]["bottleneck"],
        "decode_batch_limit": perf["disaggregated"]["decode"]["batch_limit"],
        "aic_conventions": {  # our step costs under AIConfigurator's factors and without the transfer
            "ttft_ms": round(TTFT_FACTOR * pre.alone_s * 1e3, 2),
            "tokens_per_s_per_gpu": round(min(PREFILL_DERATE * prefill_rate, DECODE_DERATE * decode_rate) * osl
                                          / gpus, 1)},
    }


def aic(exe: Path, config: str, system: str, isl: int, osl: int, prefill: tuple, decode: tuple) -> dict:
    cmd = crosscheck.disagg_command(CONFIGS / config, system, isl, osl, prefill, decode, "fp8", "fp8", exe)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=crosscheck.RUN_TIMEOUT_S)
    if done.returncode != 0:
        last = ((done.stderr or "").strip().splitlines() or ["no output"])[-1]
        raise ToolchainError(f"aiconfigurator failed: {last}", f"run it by hand: {' '.join(map(str, cmd))}")
    est = crosscheck.parse(done.stdout)
    return {"ttft_ms": est.ttft_ms, "tpot_ms": est.tpot_ms, "tokens_per_s_per_gpu": est.per_gpu_output_tokens_per_s,
            "concurrency": est.concurrency, "data": est.label}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--venv", type=Path, default=crosscheck.VENV, help="AIConfigurator's venv (made on first use)")
    args = ap.parse_args()
    exe = crosscheck.ensure_venv(args.venv)
    rows = []
    for name, config, system, isl, osl, prefill, decode in CASES:
        print(f"==> {name}", file=sys.stderr, flush=True)
        a, o = aic(exe, config, system, isl, osl, prefill, decode), ours(config, system, isl, osl, prefill, decode)
        conv = o["aic_conventions"]
        rows.append({"case": name, "isl": isl, "osl": osl, "prefill_tp_bs_workers": list(prefill),
                     "decode_tp_bs_workers": list(decode), "aiconfigurator": a, "ours": o,
                     "ratio_ours_over_aic": {
                         "ttft": ratio(o["ttft_ms"], a["ttft_ms"]), "tpot": ratio(o["tpot_ms"], a["tpot_ms"]),
                         "tokens_per_s_per_gpu": ratio(o["tokens_per_s_per_gpu"], a["tokens_per_s_per_gpu"]),
                         "capacity_tokens_per_s_per_gpu": ratio(o["capacity_tokens_per_s_per_gpu"],
                                                                a["tokens_per_s_per_gpu"])},
                     "ratio_under_aic_conventions": {
                         "ttft": ratio(conv["ttft_ms"], a["ttft_ms"]),
                         "tokens_per_s_per_gpu": ratio(conv["tokens_per_s_per_gpu"], a["tokens_per_s_per_gpu"])}})
    print_and_write({"tool": "benchmarks/disagg_crosscheck.py", "cases": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
