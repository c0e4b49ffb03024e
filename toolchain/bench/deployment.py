"""What was deployed, for report.json and the plot titles: a figure is only comparable with
another when both say which engine, precision, parallelism and GPU produced it."""

from __future__ import annotations

from toolchain import __version__, gpus
from toolchain.errors import ToolchainError
from toolchain.plan.model import kv_dtype, load_model, weight_dtype
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec


def _dtypes(spec: DeploymentSpec) -> tuple[str, str | None]:
    """(weight dtype, KV-cache dtype) as the engine has them; `auto` is resolved from the HF config as
    convert resolves it. Where the checkpoint is not on this host (a bench aimed at a remote server)
    the spec's own words stand."""
    quant = Quantization.of(spec.quantization)
    try:
        params = load_model(spec.model.checkpoint).params
    except ToolchainError:
        kv = quant.kv_cache if quant.kv_cache != "none" else None
        return spec.model.dtype, kv
    return weight_dtype(spec, params), kv_dtype(spec, params, quant)


def _expert_parallel(spec: DeploymentSpec) -> dict:
    """`moe_tp`/`moe_ep` as the experts were placed (archs/layout.py Layout), for a mixture-of-experts model
    only: a dense report stays as it was."""
    try:
        params = load_model(spec.model.checkpoint).params
    except ToolchainError:
        return {}
    if not params.is_moe:
        return {}
    layout = spec.parallelism.layout
    return {"moe_tp": layout.moe_tp, "moe_ep": layout.moe_ep}


def describe(spec: DeploymentSpec) -> dict:
    """The `deployment` object of report.json."""
    dtype, kv = _dtypes(spec)
    try:
        device = gpus.resolve(spec)
    except ToolchainError:  # a GPU name the table lacks: report it as the spec wrote it
        device = None
    gpu = spec.gpu.name if device is None else ("host CPU" if device.kind == "host" else device.name)
    return {
        "name": spec.name, "target": spec.target, "tp": spec.parallelism.tp, "pp": spec.parallelism.pp,
        **_expert_parallel(spec), "dtype": dtype, "quantization": spec.quantization.method, "kv_cache_dtype": kv, "gpu": gpu,
        "speculative_mode": spec.speculative.mode, "spec_hash": spec.spec_hash(), "toolchain_version": __version__,
    }


def title(deployment: dict | None) -> str:
    """One line naming the deployment: 'tiny-llama: cpu tp2 pp1 float32, kv float32, host CPU' (a MoE model's
    'tp2 moe_tp1 moe_ep2')."""
    if not isinstance(deployment, dict):
        return ""
    d = deployment
    experts = f" moe_tp{d['moe_tp']} moe_ep{d['moe_ep']}" if "moe_ep" in d else ""
    parts = [f"{d['target']} tp{d['tp']}{experts} pp{d['pp']} {d['dtype']}"]
    if d["quantization"] != "none":
        parts.append(d["quantization"])
    if d["kv_cache_dtype"]:
        parts.append(f"kv {d['kv_cache_dtype']}")
    if d["gpu"]:
        parts.append(d["gpu"])
    if d["speculative_mode"] != "none":
        parts.append(f"speculative {d['speculative_mode']}")
    return f"{d['name']}: {', '.join(parts)} (spec {d['spec_hash'][:8]})"
