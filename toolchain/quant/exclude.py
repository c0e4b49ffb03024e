"""How TensorRT-LLM reads a checkpoint's `quantization.exclude_modules`, and what a mixture-of-experts
checkpoint's list must name.

Two readers, both from toolchain/upstream/facts/checkpoint_config.json:
- quantize_layers (tensorrt_llm/quantization/quantize.py) matches the list against *module* names and turns
  every ColumnLinear/RowLinear it does not match into the format's quantized layer; only when the list is None
  does it use its default (`*lm_head`, `*router`, `*vocab_embedding`, ..., `*shared_expert_gate`). A list given,
  even an empty one, replaces the default whole.
- for W8A16/W4A16, trtllm-build's weight_only_quantize_dict (tensorrt_llm/models/convert_utils.py) quantizes
  every fp weight whose *tensor* name contains 'qkv.weight', 'dense.weight', 'fc.weight', 'proj.weight' or
  'gate.weight' and matches none of the list; when the list is None it excludes '*shared_expert_gate.weight'.

A mixture of experts has two linears upstream keeps unquantized only through the default: the router
(MixtureOfExperts.router, a float32 RowLinear, tensorrt_llm/layers/moe.py) and Qwen2-MoE's shared_expert_gate
(a [1, H] RowLinear in SharedMoE). A list that does not name them makes quantize_layers declare a quantized row
linear there whose scales the checkpoint never holds (the build's load then fails: "Required but not provided
tensors", PretrainedModel.load in tensorrt_llm/models/modeling_utils.py), and under W8A16/W4A16 the build also
quantizes the gate's weight ('gate.weight' is a substring of 'shared_expert_gate.weight'). So a MoE checkpoint's
list names both the modules and, for the gate, its weight tensor (`moe_exclusions`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from toolchain.upstream import facts

_FACTS = facts("checkpoint_config")
DEFAULT: tuple[str, ...] = tuple(_FACTS["default_exclude_modules"]["patterns"])
"""quantize_layers' module globs when exclude_modules is None."""
_BUILD = _FACTS["weight_only_build"]
BUILD_QUANTIZED: tuple[str, ...] = tuple(_BUILD["quant_weights"])
"""Substrings of the tensor names weight_only_quantize_dict quantizes."""
BUILD_DEFAULT: tuple[str, ...] = tuple(_BUILD["default_exclude"])
"""Its tensor globs when exclude_modules is None."""
BUILD_SCALE: str = _BUILD["scale_suffix"]
"""What it adds beside each weight it quantizes (and what WeightOnlyQuant*Linear declares)."""

ROUTER = "mlp.router"
SHARED_GATE = "mlp.shared_expert_gate"
ROUTER_EXCLUDE = ("*router",)
SHARED_GATE_EXCLUDE = ("*shared_expert_gate", "*shared_expert_gate.weight")


def module_patterns(listed: Sequence[str] | None) -> tuple[str, ...]:
    """The globs quantize_layers applies: the list as given, or the default when there is none."""
    return DEFAULT if listed is None else tuple(listed)


def module_quantized(module: str, listed: Sequence[str] | None) -> bool:
    """Whether quantize_layers quantizes `module` (a TensorRT-LLM module name) under this list."""
    return not any(fnmatch.fnmatchcase(module, p) for p in module_patterns(listed))


def build_quantizes(weight: str, listed: Sequence[str] | None) -> bool:
    """Whether W8A16/W4A16's weight_only_quantize_dict turns fp tensor `weight` into int8 plus a
    per_channel_scale under this list."""
    patterns = BUILD_DEFAULT if listed is None else tuple(listed)
    return any(s in weight for s in BUILD_QUANTIZED) and not any(fnmatch.fnmatchcase(weight, p) for p in patterns)


def moe_modules(shared_expert: bool) -> tuple[str, ...]:
    """A MoE layer's linears that stay unquantized (suffixes after `transformer.layers.N.`)."""
    return (ROUTER, SHARED_GATE) if shared_expert else (ROUTER,)


def moe_exclusions(shared_expert: bool) -> list[str]:
    """What a MoE checkpoint's own exclude_modules adds so the router (and the shared expert's gate) stay
    unquantized as the default list keeps them: the module globs, and the gate's tensor glob for the build."""
    return [*ROUTER_EXCLUDE, *(SHARED_GATE_EXCLUDE if shared_expert else ())]


def left_quantized(listed: Sequence[str] | None, layers: int, shared_expert: bool, weight_only: bool) -> list[str]:
    """The router / shared_expert_gate names (modules, and for W8A16/W4A16 their weight tensors) this list leaves
    to quantization, over `layers` decoder layers; empty when the list keeps every one unquantized."""
    out = []
    for i in range(layers):
        for suffix in moe_modules(shared_expert):
            module = f"transformer.layers.{i}.{suffix}"
            if module_quantized(module, listed):
                out.append(module)
            if weight_only and build_quantizes(f"{module}.weight", listed):
                out.append(f"{module}.weight")
    return out
