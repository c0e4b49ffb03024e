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
from toolchain.targets import target_of

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class QuantFormat:
    """The precision recipe as the planner sees it."""

    method: str = "none"
    kv_cache: str = "none"
    group_size: int = 128
    exclude_modules: tuple[str, ...] | None = None
    """None: TensorRT-LLM's default exclusion list (lm_head, embeddings, ...) applies."""
    stored: str | None = None
    """"awq" or "gptq": the checkpoint itself is int4 (AutoAWQ/GPTQ `quantization_config`), which convert
    imports as stored: W4A16 per group with zero points and no prequant scale (checkpoint/quantize.py)."""

    @property
    def format(self) -> formats.Format:
        """The weights' row (quant/formats.py): an imported checkpoint's own int4 format when stored."""
        return formats.weight_format(self.method, imported=self.stored is not None)

    @property
    def kv_format(self) -> formats.KvFormat:
        return formats.KV_CACHE[self.kv_cache]

    @property
    def quant_algo(self) -> str | None:
        return self.format.quant_algo

    @property
    def per_group(self) -> bool:
        return self.format.per_group

    @property
    def weight_only(self) -> bool:
        return self.format.weight_only

    @property
    def integer(self) -> bool:
        """Formats Blackwell cannot build (TensorRT-LLM tensorrt_llm/builder.py, build)."""
        return self.format.integer

    def describe(self) -> str:
        algo = self.quant_algo or "no weight quantization"
        if self.per_group:
            algo += f" g{self.group_size}"
        if self.stored:
            algo += f" (stored {self.stored.upper()} int4 with zero points, imported as is)"
        return algo


def stored_int4(hf_config: dict | None) -> tuple[str, int] | None:
    """(kind, group size) of an AutoAWQ or GPTQ checkpoint (its `quantization_config`), else None;
    convert refuses what it cannot import (quant.recipe.parse_prequantized), so plan only reads it."""
    qc = (hf_config or {}).get("quantization_config")
    if not isinstance(qc, dict):
        return None
    kind = str(qc.get("quant_method", "")).lower()
    if kind not in ("awq", "gptq"):
        return None
    return kind, int(qc.get("group_size", qc.get("q_group_size", 128)) or 128)


def quant_format(spec, hf_config: dict | None = None) -> QuantFormat:
    """The spec's `quantization` section (its method and kv_cache are the spec's Literals, validated when
    it loads). With the model's config.json (`hf_config`), a checkpoint stored as AutoAWQ/GPTQ int4 under
    `method: none` plans at the format convert imports it in, not as the float model it was quantized from."""
    q = spec.quantization
    pre = stored_int4(hf_config)
    if pre is not None and q.method == "none":
        return QuantFormat("awq", q.kv_cache, pre[1], tuple(q.exclude_modules), stored=pre[0])
    return QuantFormat(q.method, q.kv_cache, q.group_size, tuple(q.exclude_modules))


@dataclass
class ModelInfo:
    params: ArchParams
    config_dir: Path
    hf_config: dict
    generation_config: dict | None
    rope_problems: list[tuple[str, str]] = field(default_factory=list)
    """(check id, message) for RoPE settings TensorRT-LLM 1.2 would reject."""

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
    return ModelInfo(params, config_dir, cfg, read_json(config_dir / "generation_config.json"), problems)


def weight_dtype(spec, params: ArchParams) -> str:
    """The dtype unquantized weights have in the engine: convert's own rule (engine_dtype)."""
    return engine_dtype(spec.model.dtype, params.dtype, spec.target)


def kv_dtype(spec, params: ArchParams, quant: QuantFormat) -> str:
    if quant.kv_cache != "none":
        return quant.kv_cache
    # The CPU engine computes in float32 and keeps its cache so (engine/cpu/kv_cache.py).
    return target_of(spec).compute_dtype or weight_dtype(spec, params)


def kv_dtype_bytes(name: str) -> int:
    kv = formats.KV_CACHE.get(name)
    return formats.STORAGE_BYTES[kv.storage] if kv is not None and kv.storage else DTYPE_BYTES[name]
