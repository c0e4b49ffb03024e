"""What the planner knows about the model and its precision, from config files only.

A plan needs the HF `config.json` (normalised once by `toolchain.archs`) and,
when present, `generation_config.json`; never the weights. Problems the
converter would raise about RoPE are kept as findings for the `rope.*` checks,
and the shapes are still planned without the scaling dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from toolchain.archs import get_family, load_params
from toolchain.archs.params import ROPE_REQUIRED_KEYS, ROPE_TYPES, ArchParams, engine_dtype
from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.view import Quantization
from toolchain.targets import target_of

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class ModelInfo:
    params: ArchParams
    config_dir: Path
    hf_config: dict
    generation_config: dict | None
    rope_problems: list[tuple[str, str]] = field(default_factory=list)
    """(check id, message) for RoPE settings TensorRT-LLM 1.2 would reject."""
    hf_quant_config: dict | None = None
    """A ModelOpt export's hf_quant_config.json, which says its stored format (quant/view.py stored_format)."""

    @property
    def qkv_bias(self) -> bool:
        return self.params.attention_bias  # Qwen2's normalize sets it: HF Qwen2 always has q/k/v biases

    @property
    def dense_bias(self) -> bool:
        # The family's decoder says whether the output projection shares them (Qwen's does not: archs/qwen.py).
        return self.params.attention_bias and get_family(self.params.architecture).decoder.dense_bias


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ToolchainError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else None


def _rope_problems(cfg: dict, origin: str) -> list[tuple[str, str]]:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    if scaling is None and params and not all(isinstance(v, dict) for v in params.values()):
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if not scaling:
        return []
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default", "none"):
        return []
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        return [("rope.unknown-type", f"{origin}: rope type '{kind}' is not one TensorRT-LLM 1.2 accepts "
                                      f"({', '.join(ROPE_TYPES)}); use a checkpoint with a supported rope_scaling")]
    missing = [k for k in ROPE_REQUIRED_KEYS.get(kind, ()) if scaling.get(k) is None]
    if missing:
        return [("rope.missing-keys", f"{origin}: rope type '{kind}' lacks {', '.join(missing)}; "
                                      "add them to rope_scaling in config.json before converting")]
    return []


def _without_rope_scaling(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and not all(isinstance(v, dict) for v in params.values()):
        out["rope_parameters"] = {k: v for k, v in params.items() if k == "rope_theta"}
    return out


def load_model(config_dir: Path) -> ModelInfo:
    """Normalised parameters of the HF model in `config_dir` (only config files are read)."""
    config_dir = Path(config_dir)
    origin = str(config_dir / "config.json")
    cfg = read_json(config_dir / "config.json")
    if cfg is None:
        raise ToolchainError(f"no config.json in {config_dir}",
                             "point model.checkpoint at an HF model directory (config.json is enough to plan)")
    problems = _rope_problems(cfg, origin)
    planned = _without_rope_scaling(cfg) if problems else cfg
    _, params = load_params(planned, origin)  # refuses an unregistered architecture, listing the registered ones
    return ModelInfo(params, config_dir, cfg, read_json(config_dir / "generation_config.json"), problems,
                     read_json(config_dir / "hf_quant_config.json"))


def weight_dtype(spec, params: ArchParams) -> str:
    """The dtype unquantized weights have in the engine: convert's own rule (engine_dtype)."""
    return engine_dtype(spec.model.dtype, params.dtype, spec.target)


def kv_dtype(spec, params: ArchParams, quant: Quantization) -> str:
    if quant.kv_cache != "none":
        return quant.kv_cache
    # The CPU engine computes in float32 and keeps its cache so (engine/cpu/kv_cache.py).
    return target_of(spec).compute_dtype or weight_dtype(spec, params)


def kv_dtype_bytes(name: str) -> int:
    kv = formats.KV_CACHE.get(name)
    # Whole bytes: every KV format stores one byte per element (no FP4 KV cache row yet).
    return int(formats.STORAGE_BYTES[kv.storage]) if kv is not None and kv.storage else DTYPE_BYTES[name]
