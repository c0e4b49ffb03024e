"""Architecture registry: HF `architectures[0]` -> the module holding its table.

Modules are named as strings ("module" or "module:ATTRIBUTE") and imported
only on lookup, so adding a family costs nothing until a checkpoint of that
family is converted. The attribute (default `FAMILY`) is a
`toolchain.archs.common.Family`.
"""

from __future__ import annotations

import importlib

from toolchain.archs.common import Family
from toolchain.archs.params import ArchParams, normalize_params
from toolchain.errors import ToolchainError

# HF architecture string -> "module[:attribute]". Every family reuses the Llama
# table shape (llama.llama_rows) with its own switches and config normalisation.
# Adding one here means adding a tiny checkpoint maker to tests/test_archs.py too.
_REGISTRY: dict[str, str] = {
    "DeepseekV3ForCausalLM": "toolchain.archs.deepseek_v3",
    "Gemma2ForCausalLM": "toolchain.archs.gemma",
    "Gemma3ForCausalLM": "toolchain.archs.gemma3",
    "GptOssForCausalLM": "toolchain.archs.gpt_oss",
    "LlamaForCausalLM": "toolchain.archs.llama",
    "Llama4ForCausalLM": "toolchain.archs.llama4",
    "Llama4ForConditionalGeneration": "toolchain.archs.llama4:CONDITIONAL_FAMILY",
    "MistralForCausalLM": "toolchain.archs.mistral",
    "MixtralForCausalLM": "toolchain.archs.mixtral",
    "Phi3ForCausalLM": "toolchain.archs.phi3",
    "Qwen2ForCausalLM": "toolchain.archs.qwen:QWEN2",
    "Qwen2MoeForCausalLM": "toolchain.archs.qwen_moe:QWEN2_MOE",
    "Qwen3ForCausalLM": "toolchain.archs.qwen:QWEN3",
    "Qwen3MoeForCausalLM": "toolchain.archs.qwen_moe:QWEN3_MOE",
}

# TensorRT-LLM checkpoint `architecture` names that are no HF name, -> the family whose decoder MODEL_MAP builds for
# them (tensorrt_llm/models/__init__.py, read_file id 820782731: 'QWenForCausalLM': QWenForCausalLM, as for every
# Qwen HF name). ModelOpt's exporter writes QWenForCausalLM for every Qwen type; the converter writes the HF name.
CHECKPOINT_ALIASES: dict[str, str] = {"QWenForCausalLM": "Qwen2ForCausalLM"}

__all__ = ["ArchParams", "Family", "supported", "get_family", "family_for_config", "load_params",
           "checkpoint_architectures", "family_for_checkpoint"]


def supported() -> list[str]:
    """HF architecture names the converter accepts, sorted."""
    return sorted(_REGISTRY)


def checkpoint_architectures() -> list[str]:
    """TensorRT-LLM checkpoint `architecture` names a family's decoder builds (HF names and aliases), sorted."""
    return sorted([*_REGISTRY, *CHECKPOINT_ALIASES])


def family_for_checkpoint(architecture: str) -> Family:
    """The family whose decoder builds a TensorRT-LLM checkpoint of `architecture` (its config.json's)."""
    return get_family(CHECKPOINT_ALIASES.get(architecture, architecture))


def get_family(architecture: str) -> Family:
    """The family table registered for an HF architecture string."""
    entry = _REGISTRY.get(architecture)
    if entry is None:
        raise ToolchainError(
            f"unsupported architecture '{architecture}'",
            f"supported: {', '.join(supported())}",
        )
    module_path, _, attribute = entry.partition(":")
    family = getattr(importlib.import_module(module_path), attribute or "FAMILY")
    if architecture not in family.architectures:  # a registry typo, not a user error
        raise RuntimeError(f"{entry} does not list {architecture}")
    return family


def family_for_config(hf_config: dict, origin: str = "config.json") -> Family:
    """Look up the family from an HF config dict's `architectures[0]`."""
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ToolchainError(
            f"{origin} has no 'architectures' list",
            f"add e.g. \"architectures\": [\"LlamaForCausalLM\"]; supported: {', '.join(supported())}",
        )
    return get_family(archs[0])


def load_params(hf_config: dict, origin: str = "config.json") -> tuple[Family, ArchParams]:
    """Family and normalised parameters for an HF config dict."""
    family = family_for_config(hf_config, origin)
    return family, normalize_params(hf_config, family, origin)
