"""An engine directory's config.json as trtllm-build wrote it, and the flags it records.

TensorRT-LLM 1.2 `Engine.save` writes {"version", "pretrained_config", "build_config"} (tensorrt_llm/builder.py:
EngineConfig.to_dict, BuildConfig.to_dict with its plugin_config and lora_config); `recorded_flags` reads back
the trtllm-build flags of engine/trtllm.py's table that the file records, in the form build_flags gives them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain.errors import ToolchainError
from toolchain.versions import TRTLLM_LINE, TRTLLM_VERSION, in_line

# tensorrt_llm/models/modeling_utils.py SpeculativeDecodingMode (an IntFlag, written by json as its int) ->
# trtllm-build's --speculative_decoding_mode; the name is accepted too (UNVERIFIED which one 1.2 writes).
SPECULATIVE_MODES: dict[Any, str | None] = {
    1: None, 2: "draft_tokens_external", 4: "medusa", 8: "lookahead_decoding", 16: "explicit_draft_tokens",
    32: "eagle",
    "NONE": None, "DRAFT_TOKENS_EXTERNAL": "draft_tokens_external", "MEDUSA": "medusa",
    "LOOKAHEAD_DECODING": "lookahead_decoding", "EXPLICIT_DRAFT_TOKENS": "explicit_draft_tokens", "EAGLE": "eagle",
}
# Flags build_flags writes that config.json does not record (so the round trip cannot compare them).
NOT_RECORDED = {"--use_fused_mlp": "trtllm-build applies it to the network; config.json keeps no trace of it",
                "--log_level": "a build-time log setting"}


@dataclass(frozen=True)
class Engine:
    path: Path  # config.json
    version: str
    pretrained: dict[str, Any]
    build: dict[str, Any]

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def plugin(self) -> dict[str, Any]:
        return self.build.get("plugin_config") or {}

    @property
    def mapping(self) -> dict[str, Any]:
        return self.pretrained.get("mapping") or {}

    @property
    def quantization(self) -> dict[str, Any]:
        return self.pretrained.get("quantization") or {}

    @property
    def speculative_mode(self) -> str | None:
        raw = self.build.get("speculative_decoding_mode", 1)
        if raw not in SPECULATIVE_MODES:
            raise ToolchainError(f"{self.path}: build_config.speculative_decoding_mode {raw!r} is not one "
                                 "TensorRT-LLM 1.2 writes", "rebuild the engine with trtllm-build 1.2")
        return SPECULATIVE_MODES[raw]

    def field(self, dotted: str) -> Any:
        node: Any = {"pretrained_config": self.pretrained, "build_config": self.build}
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return node


def read_engine(engine_dir: Path | str, *, role: str = "engine") -> Engine:
    """config.json of `engine_dir`, refused in one line when absent, not JSON, or from another release line."""
    path = Path(engine_dir) / "config.json"
    if not path.is_file():
        raise ToolchainError(f"{role} directory {engine_dir} has no config.json",
                             "pass the trtllm-build output directory (--engine DIR)")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as err:
        raise ToolchainError(f"{path} is not JSON ({err})", "pass the config.json trtllm-build wrote") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("build_config"), dict) \
            or not isinstance(cfg.get("pretrained_config"), dict):
        raise ToolchainError(f"{path} has no build_config and pretrained_config: not an engine's config.json",
                             "pass the trtllm-build output directory, not a checkpoint")
    version = cfg.get("version")
    if not in_line(version):
        raise ToolchainError(f"{path}: field 'version' is {version!r}, an engine of another TensorRT-LLM than the "
                             f"{TRTLLM_LINE} line this toolchain pins ({TRTLLM_VERSION})",
                             f"rebuild the engine with trtllm-build {TRTLLM_VERSION} (engines load only in the "
                             "release that built them)")
    return Engine(path, str(version), cfg["pretrained_config"], cfg["build_config"])


def _en(value: Any) -> str:
    return "enable" if value else "disable"


def _plugin(value: Any) -> str:
    return "disable" if value in (None, False, "disable") else str(value)


def recorded_flags(engine: Engine) -> dict[str, object]:
    """The trtllm-build flags config.json records, every one written out (absent or off included)."""
    b, p = engine.build, engine.plugin
    kv = b.get("kv_cache_type", "PAGED")
    flags: dict[str, object] = {
        "--gemm_plugin": _plugin(p.get("gemm_plugin")),
        "--gpt_attention_plugin": _plugin(p.get("gpt_attention_plugin")),
        "--remove_input_padding": _en(p.get("remove_input_padding", True)),
        "--kv_cache_type": str(kv).lower().removeprefix("kvcachetype."),
        "--tokens_per_block": p.get("tokens_per_block"),
        "--context_fmha": _en(p.get("context_fmha", True)),
        "--use_paged_context_fmha": _en(p.get("use_paged_context_fmha")),
        "--multiple_profiles": _en(p.get("multiple_profiles")),
        "--reduce_fusion": _en(p.get("reduce_fusion")),
        "--lora_plugin": _plugin(p.get("lora_plugin")),
        "--gather_context_logits": bool(b.get("gather_context_logits")),
        "--gather_generation_logits": bool(b.get("gather_generation_logits")),
        "--speculative_decoding_mode": engine.speculative_mode,
        "--max_draft_len": int(b.get("max_draft_len") or 0),
    }
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width",
                "opt_num_tokens"):
        flags[f"--{key}"] = b.get(key)
    lora = b.get("lora_config") or {}
    if flags["--lora_plugin"] != "disable":
        flags["--max_lora_rank"] = lora.get("max_lora_rank")
        flags["--lora_target_modules"] = tuple(sorted(lora.get("lora_target_modules") or ()))
    return flags


def default_opt_num_tokens(max_num_tokens: int, max_batch_size: int, max_beam_width: int) -> int:
    """BuildConfig's opt_num_tokens when --opt_num_tokens is not given: min(max_num_tokens, max_batch_size x
    max_beam_width) (tensorrt_llm/builder.py; UNVERIFIED at 1.2.1 itself)."""
    return min(max_num_tokens, max_batch_size * max_beam_width)
