"""Medusa heads into a `MedusaForCausalLM` checkpoint.

The heads directory is the Hugging Face layout Medusa's trainer writes (and
`toolchain medusa-heads`): `config.json` with `medusa_num_heads` and
`medusa_num_layers`, and `medusa_lm_head.safetensors` holding `{h}.{l}.linear.weight`,
`{h}.{l}.linear.bias` and `{h}.{num_layers}.weight`. TensorRT-LLM's module tree
names them `medusa_heads.{h}.medusa_layers.{l}.linear.*` and `medusa_heads.{h}.lm_head.weight`;
every linear is column-parallel (split on dim 0) and each head's lm_head is padded to
the model's padded vocabulary like the base lm_head (tensorrt_llm/models/medusa/model.py).
The names, split rule and config keys are upstream facts (`toolchain/upstream/facts/medusa.json`).

Only safetensors are read: a pickled `medusa_lm_head.pt` would run code on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolchain.checkpoint import sharding
from toolchain.checkpoint.hf_reader import read_header, read_json_object, refuse_pickles
from toolchain.checkpoint.layout import TORCH_DTYPES, PlannedTensor
from toolchain.checkpoint.quantize import ALWAYS_EXCLUDED
from toolchain.errors import ToolchainError
from toolchain.upstream import facts
from toolchain.draft_tree import parse_choices, tree_problem

WEIGHTS = "medusa_lm_head.safetensors"


def _upstream() -> dict:
    return facts("medusa")


@dataclass
class MedusaHeads:
    directory: Path
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    choices: list[list[int]] | None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_params(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes.values())

    def source_names(self) -> list[tuple[str, str]]:
        """(heads-file key, TensorRT-LLM name) for every tensor, in upstream's order."""
        names = _upstream()["names"]
        out = []
        for h in range(self.num_heads):
            for layer in range(self.num_layers):
                for part in ("weight", "bias"):
                    out.append((names["hf_linear"].format(h=h, l=layer, part=part),
                                names["trt_linear"].format(h=h, l=layer, part=part)))
            out.append((names["hf_lm_head"].format(h=h, L=self.num_layers),
                        names["trt_lm_head"].format(h=h)))
        return out


def read_heads(directory: Path | str, *, hidden_size: int | None = None, vocab_size: int | None = None) -> MedusaHeads:
    """Open and check a heads directory against the target's hidden and vocab sizes; reads headers only."""
    d = Path(directory)
    where = f"speculative.heads {d}"
    if not d.is_dir():
        raise ToolchainError(f"{where} is not a directory", "train heads with `toolchain medusa-heads TARGET OUT`; for the "
                             "embedded default, `make medusa-heads`")
    weights = d / WEIGHTS
    if not weights.is_file():
        refuse_pickles(d, where, WEIGHTS)  # medusa_lm_head.pt, as Medusa's trainer saves it, and the like
        raise ToolchainError(f"{where} has no {WEIGHTS}", "train heads with `toolchain medusa-heads TARGET OUT`")
    config = read_json_object(d / "config.json", where, "it must give medusa_num_heads and medusa_num_layers")
    keys = _upstream()["hf_config_keys"]
    # Medusa's trainer writes medusa_num_heads; TensorRT-LLM's MedusaConfig reads num_medusa_heads.
    num_heads = config.get(keys["num_heads_trainer"], config.get(keys["num_heads"]))
    num_layers = config.get(keys["num_layers"], 1)
    if not isinstance(num_heads, int) or num_heads < 1 or not isinstance(num_layers, int) or num_layers < 1:
        raise ToolchainError(f"{where}/config.json needs {keys['num_heads_trainer']} >= 1 and {keys['num_layers']} >= 1",
                             "write the heads with `toolchain medusa-heads`")
    # The project's bounded header reader, not safe_open: a lying or huge header fails here in one line
    # naming the file, before write_heads opens it for the data.
    shapes = {name: info.shape for name, info in read_header(weights).items()}
    heads = MedusaHeads(d, num_heads, num_layers, 0, 0, config.get("medusa_choices"))
    missing = [k for k, _ in heads.source_names() if k not in shapes]
    if missing:
        raise ToolchainError(f"{where}: {WEIGHTS} lacks {missing[0]} ({len(missing)} missing for {num_heads} heads "
                             f"of {num_layers} layer(s))", f"set {keys['num_heads_trainer']} in config.json to the heads stored")
    h = shapes[heads.source_names()[0][0]][1]
    v = shapes[heads.source_names()[num_layers * 2][0]][0]
    heads.hidden_size, heads.vocab_size = h, v
    if hidden_size is not None and h != hidden_size:
        raise ToolchainError(f"{where}: heads take hidden size {h} but the target's hidden_size is {hidden_size}",
                             "train heads for this target (toolchain medusa-heads TARGET OUT)")
    if vocab_size is not None and v != vocab_size:
        raise ToolchainError(f"{where}: heads predict {v} tokens but the target's vocab_size is {vocab_size}",
                             "train heads for this target with its tokenizer")
    for src, _ in heads.source_names():
        want = (h,) if src.endswith("bias") else (v, h) if src.endswith(f".{num_layers}.weight") else (h, h)
        if shapes[src] != want:
            raise ToolchainError(f"{where}: {src} is {list(shapes[src])}, expected {list(want)}",
                                 "the heads file is inconsistent; retrain or re-export it")
    heads.shapes = {src: shapes[src] for src, _ in heads.source_names()}
    return heads


def _slices(trt: str, t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The tp slices of one heads tensor: every linear is column-parallel, the lm_head also
    padded to the padded vocabulary (the base lm_head's rule). Run on meta tensors to plan,
    on the real ones to write, so the two cannot disagree."""
    return sharding.split_vocab(t, tp) if trt.endswith("lm_head.weight") else sharding.split_column(t, tp)


def plan_heads(heads: MedusaHeads, dtype: str, tp: int, world_size: int) -> list[list[PlannedTensor]]:
    """Per rank, the Medusa tensors it holds (every rank: pipeline parallelism is refused)."""
    if heads.hidden_size % tp:
        raise ToolchainError(f"Medusa layer width {heads.hidden_size} does not split over tp {tp}",
                             "choose a tp dividing hidden_size")
    torch_dtype = TORCH_DTYPES[dtype]
    per_tp: list[list[Any]] = [[] for _ in range(tp)]
    for src, trt in heads.source_names():
        for r, piece in enumerate(_slices(trt, torch.empty(heads.shapes[src], device="meta"), tp)):
            per_tp[r].append(PlannedTensor(trt, tuple(piece.shape), torch_dtype))
    return [list(per_tp[rank % tp]) for rank in range(world_size)]


def write_heads(heads: MedusaHeads, writers, dtype: str, tp: int) -> None:
    """Each heads tensor once, its tp slices to the ranks holding them."""
    from safetensors import safe_open

    torch_dtype = TORCH_DTYPES[dtype]
    with safe_open(str(heads.directory / WEIGHTS), "pt") as fh:
        for src, trt in heads.source_names():
            pieces = _slices(trt, fh.get_tensor(src).to(torch_dtype), tp)
            for rank, w in enumerate(writers):
                w.write(trt, pieces[rank % tp].contiguous())


def medusa_config(config: dict, heads: MedusaHeads, max_draft_len: int, model_type: str) -> dict:
    """The base checkpoint's config as a MedusaForCausalLM one. A quantized base keeps the heads
    unquantized, as upstream's ModelOpt path does (exclude_modules gains '*medusa_heads*').

    `model_type` is the base's Hugging Face model_type: MedusaConfig and MedusaForCausalLm pick
    QWen's config and model when it names qwen and LLaMA's otherwise, so without it a Qwen2 base
    would build as LLaMA (no qkv bias). examples/medusa/convert_checkpoint.py writes it, and
    qwen_type for qwen2, which the base Qwen config already holds (facts medusa.json, rules)."""
    keys = _upstream()["config_keys"]
    out = dict(config)
    out["architecture"] = _upstream()["architecture"]
    out[keys["model_type"]] = model_type
    if "qwen" in model_type and "qwen_type" not in out:
        out["qwen_type"] = model_type
    out[keys["num_heads"]] = heads.num_heads
    out[keys["num_layers"]] = heads.num_layers
    out[keys["max_draft_len"]] = max_draft_len
    quant = out.get("quantization")
    if quant and quant.get("quant_algo"):
        exclude = list(quant.get("exclude_modules") or ALWAYS_EXCLUDED)
        if "*medusa_heads*" not in exclude:
            exclude.append("*medusa_heads*")
        out["quantization"] = {**quant, "exclude_modules": exclude}
    return out


def medusa_tree(spec, heads: MedusaHeads | None = None) -> list[list[int]]:
    """The spec's draft tree: speculative.choices, else the tree recorded with the heads."""

    sp = spec.speculative
    tree: list[list[int]] | None
    if sp.choices:
        try:
            tree = parse_choices(sp.choices)
        except ValueError as err:
            raise ToolchainError(f"speculative.choices: {err}") from None
    else:
        tree = (heads or read_heads(sp.heads)).choices if sp.heads is not None else None
        if not tree:
            raise ToolchainError("speculative.mode=medusa needs a draft tree",
                                 "set speculative.choices (e.g. \"{0}, {0, 0}, {1}\") or use heads written by "
                                 "`toolchain medusa-heads`, which record the tree measured for them")
    problem = tree_problem(tree, heads.num_heads if heads is not None else None)
    if problem is not None:
        raise ToolchainError(f"medusa tree: {problem}", "fix speculative.choices")
    return tree


def attach_heads(plan, spec) -> MedusaHeads:
    """Add the spec's Medusa heads to a conversion plan: tensors on every rank and the
    MedusaForCausalLM config. max_draft_len is the tree's size unless the spec sets it."""
    sp = spec.speculative
    if sp.heads is None:
        raise ToolchainError("speculative.mode=medusa needs speculative.heads (a directory of trained heads)",
                             "train them with `toolchain medusa-heads MODEL_DIR OUT_DIR` and set speculative.heads")
    if plan.options.pp > 1:
        raise ToolchainError(f"Medusa with parallelism.pp={plan.options.pp} is not supported",
                             "set parallelism.pp to 1 (use tp for more GPUs)")
    heads = read_heads(sp.heads, hidden_size=plan.params.hidden_size, vocab_size=plan.params.vocab_size)
    tree = medusa_tree(spec, heads)
    max_draft_len = sp.max_draft_len or len(tree)
    if len(tree) > max_draft_len:
        raise ToolchainError(f"the medusa tree has {len(tree)} nodes but speculative.max_draft_len is {max_draft_len}",
                             f"set speculative.max_draft_len to {len(tree)} (or 0 to take the tree's size)")
    for rank, extra in enumerate(plan_heads(heads, plan.options.dtype, plan.options.tp, plan.options.world_size)):
        plan.ranks[rank].extend(extra)
    plan.config = medusa_config(plan.config, heads, max_draft_len, plan.family.name)
    plan.medusa = heads
    return heads
