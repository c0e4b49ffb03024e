"""The speculative decoding modes, one row each: what `speculative.mode` means on every side.

A row names the mode's runtime names (trtllm-build's --speculative_decoding_mode, the tensorrtllm backend's
decoding_mode parameter, the LLM API's speculative_config decoding_type), the targets it runs on (read
through the target rows of toolchain/targets.py: the path a runtime name exists on, the devices whose CPU
engine runs it), what it needs from the spec and adds to the deployment, and why it cannot run elsewhere.
The checks, the spec's validators and the writers of trtllm-build flags, config.pbtxt and model.yaml read the
row instead of listing modes; what a mode does beyond that lives in its own module (checkpoint/medusa.py,
checkpoint/eagle.py, the draft engine in engine/build.py). Upstream keeps the same knowledge on each decoding
config class (TensorRT-LLM tensorrt_llm/llmapi/llm_args.py: `decoding_type` and `supports_backend`, recorded in
toolchain/upstream/facts/llmapi.json under speculative.types).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolchain.targets import CPU, ENGINE, GPU, LLMAPI, Device, Path, Target, named

Mode = Literal["none", "draft_target", "medusa", "eagle", "lookahead", "ngram", "eagle3", "mtp"]
Draft = Literal["", "draft_model", "heads"]
Adds = Literal["nothing", "draft engine", "checkpoint"]
NOTHING: Adds = "nothing"
DRAFT_ENGINE: Adds = "draft engine"
"""A second engine built from speculative.draft_model (tp 1) and the repository's tensorrt_llm_draft model."""
CHECKPOINT: Adds = "checkpoint"
"""The drafting networks (Medusa heads, EAGLE's EagleNets) converted into the target's own checkpoint."""


@dataclass(frozen=True)
class SpeculativeMode:
    name: Mode
    build_mode: str | None
    """trtllm-build --speculative_decoding_mode (tensorrt_llm/commands/build.py); None: TensorRT-LLM 1.2 engines
    do not have the mode, so the engine path (targets cpu, trtllm) refuses it."""
    decoding_mode: str | None
    """The tensorrtllm backend's decoding_mode parameter (config.pbtxt); None: the sampler's own (top_k_top_p,
    or beam_search with beams)."""
    decoding_type: str | None
    """speculative_config's decoding_type on the LLM-API path (a DecodingBaseConfig subclass whose
    supports_backend admits pytorch); None: the PyTorch backend does not have the mode (targets llmapi,
    llmapi-cpu refuse it)."""
    cpu: tuple[Path, ...]
    """The paths on which the CPU engine runs it too (targets with device cpu); elsewhere it needs GPUs."""
    draft: Draft
    """The spec field naming what drafts: a separate checkpoint (speculative.draft_model), the heads or EAGLE
    draft converted into the checkpoint (speculative.heads), or "" when the mode drafts without one."""
    adds: Adds
    """What it adds on the engine path: a draft engine and its repository model, networks in the checkpoint, or
    nothing (draft tokens from the BLS or the runtime)."""
    length_in_checkpoint: bool
    """max_draft_len 0 takes the draft length from the converted checkpoint (its tree)."""
    cpu_ranks: bool
    """The CPU engine runs it across rank processes (serving.launch mpirun on target cpu)."""
    drafts_in_target: bool
    """The target model's own multi-token-prediction layers draft (num_nextn_predict_layers in its config.json,
    as DeepSeek-V3 has): the model must have them, and their count is the draft length (MTPDecodingConfig)."""
    why_not: dict[str, str] = field(default_factory=dict)
    """Why it cannot run on a path (engine, llmapi) or on the CPU engine of the engine path (cpu)."""
    expected_acceptance: float | None = None
    """Default share of draft tokens accepted, for the performance prediction (plan/perf/) when the spec sets no
    speculative.expected_acceptance; None: no default (acceptance depends on the draft and the prompts), so the
    prediction assumes none is accepted and says so."""

    @property
    def paths(self) -> tuple[Path, ...]:
        on: tuple[tuple[Path, str | None], ...] = ((ENGINE, self.build_mode), (LLMAPI, self.decoding_type))
        return tuple(p for p, name in on if name)

    @property
    def external_drafts(self) -> bool:
        """The engine verifies draft tokens it is handed (the BLS's draft model or prompt lookup) and does not
        stream through the BLS."""
        return self.build_mode == "draft_tokens_external"

    @property
    def prompt_lookup(self) -> bool:
        """The toolchain's BLS drafts the tokens it hands the engine by prompt lookup (n-grams of the prompt and
        the text so far): external drafts with no draft engine to make them."""
        return self.external_drafts and self.adds == NOTHING

    @property
    def needs_draft_len(self) -> bool:
        """An engine-path mode whose draft length only the spec gives (speculative.max_draft_len > 0)."""
        return self.build_mode is not None and not self.length_in_checkpoint

    @property
    def runs(self) -> frozenset[tuple[Path, Device]]:
        """The (path, device) pairs it runs on: GPUs on each of its paths, the CPU engine on those of `cpu`."""
        return frozenset([(p, GPU) for p in self.paths] + [(p, CPU) for p in self.paths if p in self.cpu])

    def runs_on(self, target: Target) -> bool:
        return self.name == "none" or (target.path, target.device) in self.runs


MODES: dict[str, SpeculativeMode] = {m.name: m for m in (
    SpeculativeMode("none", None, None, None, (ENGINE, LLMAPI), "", NOTHING, False, True, False),
    SpeculativeMode("draft_target", "draft_tokens_external", None, "DraftTarget", (ENGINE,), "draft_model",
                    DRAFT_ENGINE, False, False, False),
    SpeculativeMode("ngram", "draft_tokens_external", None, "NGram", (ENGINE,), "", NOTHING, False, True, False),
    SpeculativeMode("medusa", "medusa", "medusa", None, (ENGINE,), "heads", CHECKPOINT, True, False, False, {
        LLMAPI: "Medusa heads run only in TensorRT engines (the PyTorch backend has no Medusa)"}),
    SpeculativeMode("eagle", "eagle", "eagle", None, (), "heads", CHECKPOINT, True, False, False, {
        LLMAPI: "EAGLE-1/2 drafts run only in TensorRT engines; the PyTorch backend runs EAGLE-3 checkpoints",
        CPU: "the CPU engine does not run EAGLE's draft networks (TensorRT-LLM runs them inside the engine)"}),
    SpeculativeMode("lookahead", "lookahead_decoding", "lookahead", None, (), "", NOTHING, False, True, False, {
        LLMAPI: "lookahead decoding runs only in the engine runtime",
        CPU: "the CPU engine has no lookahead decoding (TensorRT-LLM runs it in its C++ runtime)"}),
    # TensorRT-LLM 1.2 engines draft with EAGLE-1/2, not EAGLE-3, and have no MTP.
    SpeculativeMode("eagle3", None, None, "Eagle", (), "draft_model", NOTHING, False, True, False, {
        ENGINE: "EAGLE-3 drafts run on the PyTorch backend only (speculative_config decoding_type Eagle)"}),
    # The LLM API's CPU stand-in runs mtp with the model's first MTP layer (engine/cpu/mtp.py).
    SpeculativeMode("mtp", None, None, "MTP", (LLMAPI,), "", NOTHING, False, True, True, {
        ENGINE: "multi-token prediction runs on the PyTorch backend only (MTPDecodingConfig)"}),
)}


def target_draft_layers(mode: str) -> int:
    """The model's own MTP layers a mode loads beside it: one for mtp (the checkpoint's first; the CPU engine drafts
    one token a step with it, checkpoint/mtp.py and engine/cpu/mtp.py), none for the other modes."""
    return 1 if MODES[mode].drafts_in_target else 0


def mode_of(name: str) -> SpeculativeMode:
    """The row of a speculative.mode (the spec's Literal admits only these names)."""
    return MODES[name]


def refusal(mode: str, target: Target) -> str | None:
    """Why `mode` cannot run on `target`, as the one-line error the checks report; None where it runs."""
    row = MODES[mode]
    if row.runs_on(target):
        return None
    if target.path not in row.paths:
        if target.path == ENGINE:
            hint = f"use target {named(LLMAPI, GPU)}"
        else:
            both = " or ".join(m.name for m in MODES.values() if len(m.paths) == 2)  # draft_target, ngram
            hint = f"use target {named(ENGINE, GPU)}, or speculative.mode {both}"
        return f"speculative.mode={mode} cannot run on target {target.name}: {row.why_not[target.path]}; {hint}"
    if target.path == ENGINE:
        # The modes this CPU engine runs without a second checkpoint to convert (ngram, medusa).
        alone = " or ".join(m.name for m in MODES.values() if ENGINE in m.cpu and m.name != "none"
                            and m.draft != "draft_model")
        return (f"speculative.mode={mode} cannot run on target {target.name}: {row.why_not[CPU]}; use target "
                f"{named(ENGINE, GPU)}, or speculative.mode {alone} on {target.name}")
    return (f"speculative.mode={mode} is not run by the CPU stand-in of the LLM API yet; use target "
            f"{named(ENGINE, CPU)} (the engine path runs it through the BLS) or target {named(LLMAPI, GPU)} on a "
            "GPU host")

