"""An EAGLE-1 draft network into an `EagleForCausalLM` checkpoint.

The draft directory is what EAGLE's trainer publishes (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3),
re-saved as safetensors: a Llama `config.json` for the draft's decoder layer(s) and weights
`fc.weight` [H, 2H], `fc.bias`, `layers.{l}.*` in Hugging Face Llama names (a `model.` prefix
is accepted) and optionally `embed_tokens.weight` (else the target's embedding is used, as
EAGLE shares it).

TensorRT-LLM builds `num_eagle_layers` EagleNets, one per level of the draft tree, each a
full copy of the draft: `eagle_nets.{i}.drafter` is a LLaMAModel with `fc` after the
embedding, no input_layernorm in its first layer and no final norm, and
`eagle_nets.{i}.lm_head` is the target's lm_head padded like the base one. The nets are
sharded over the whole world (tp = world size, pp 1), with LLaMA's split rules for the
layers. Names, flags and split rules are upstream facts (`toolchain/upstream/facts/eagle.json`).

Only safetensors are read: upstream's own converter torch.loads `pytorch_model.bin`, a
pickle that would run code on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from toolchain.archs.common import Family, NameTable, Row, Shard, Stage, trt_name
from toolchain.archs.layout import Layout
from toolchain.archs.llama import FAMILY as LLAMA
from toolchain.archs.params import ArchParams, normalize_params
from toolchain.checkpoint import sharding
from toolchain.checkpoint.config import build_config
from toolchain.checkpoint.hf_reader import HFCheckpoint, read_json_object, refuse_pickles
from toolchain.checkpoint.layout import TORCH_DTYPES, Group, Options, Output, PlannedTensor, prepare, shard_group
from toolchain.draft_tree import MC_SIM_7B_63, non_leaves_per_level, parse_choices, tree_problem
from toolchain.errors import ToolchainError
from toolchain.upstream import facts


def _upstream() -> dict:
    return facts("eagle")


def _drafter_rows() -> tuple[Row, ...]:
    """The LLaMA table re-rooted at the drafter: layers and the embedding keep their rules,
    the final norm and lm_head go (EagleNet has no ln_f; its lm_head is the target's), and
    `fc` joins as a column-parallel linear."""
    rows = []
    for row in LLAMA.rows:
        if not (row.per_layer or row.hf == "model.embed_tokens.weight"):
            continue
        trt = row.trt.removeprefix("transformer.") if row.trt else None
        rows.append(replace(row, hf=row.hf.removeprefix("model."), trt=trt, tied_from=None))
    rows.append(Row("fc.weight", "fc.weight", Shard.COLUMN, stage=Stage.FIRST))
    rows.append(Row("fc.bias", "fc.bias", Shard.COLUMN, stage=Stage.FIRST))
    return tuple(rows)


DRAFTER = Family(name="eagle-drafter", architectures=("LlamaForCausalLM",), rows=_drafter_rows(),
                 defaults=LLAMA.defaults)
EMBED = "embed_tokens.weight"


@dataclass
class EagleDraft:
    directory: Path
    params: ArchParams
    groups: list[Group] = field(default_factory=list)
    """Draft tensors grouped as they are sharded (q/k/v of a layer together), named relative to the drafter."""
    metas: dict[str, torch.Tensor] = field(default_factory=dict)
    """Data-less tensor of each source, from the headers read once (planning shards these)."""
    embedding_from_target: bool = False
    """The draft stores no embed_tokens: the target's embedding is copied into every net."""


def read_draft(directory: Path | str, target: ArchParams) -> EagleDraft:
    """Open an EAGLE draft directory and check it against the target; reads headers only."""
    d = Path(directory)
    where = f"speculative.heads {d}"
    if not d.is_dir():
        raise ToolchainError(f"{where} is not a directory", "point speculative.heads at the EAGLE draft checkpoint")
    if not any(d.glob("*.safetensors")):
        refuse_pickles(d, where)  # upstream's converter would torch.load pytorch_model.bin
        raise ToolchainError(f"{where} has no *.safetensors weights", "add the EAGLE draft's weights")
    cfg = read_json_object(d / "config.json", where, "it must describe the draft layer (a Llama config)")
    params = normalize_params({**cfg, "architectures": ["LlamaForCausalLM"]}, DRAFTER, f"{where}/config.json")
    if params.hidden_size != target.hidden_size:
        raise ToolchainError(f"{where}: the draft's hidden size is {params.hidden_size} but the target's is "
                             f"{target.hidden_size}", "use the EAGLE draft trained for this target")
    if params.vocab_size != target.vocab_size:
        raise ToolchainError(f"{where}: the draft's vocab_size is {params.vocab_size} but the target's is "
                             f"{target.vocab_size}", "use the EAGLE draft trained for this target and tokenizer")
    draft = EagleDraft(d, params)
    with HFCheckpoint(d) as ckpt:
        draft.groups, draft.embedding_from_target = _groups(ckpt, params, where)
        draft.metas = {s: ckpt.meta(s) for g in draft.groups for s in g.sources}
    return draft


def _groups(ckpt: HFCheckpoint, params: ArchParams, where: str) -> tuple[list[Group], bool]:
    table = NameTable(DRAFTER, params)
    names = {n.removeprefix("model."): n for n in ckpt.tensors}
    found, unknown = {}, []
    for short, full in names.items():
        m = table.match(short)
        if m is None:
            unknown.append(full)
        elif m.row.shard is not Shard.DROP and not (m.layer == 0 and "input_layernorm" in short):
            # EAGLE's first layer has no input_layernorm; a checkpoint that stores one has it unused.
            found[short] = (full, m)
    if unknown:
        raise ToolchainError(f"{where}: {len(unknown)} tensor(s) are not EAGLE draft weights, e.g. {sorted(unknown)[0]}",
                             "expected fc.weight, fc.bias, layers.{l}.* and optionally embed_tokens.weight")
    want = [n for n, m in table.expected() if not (m.layer == 0 and "input_layernorm" in n) and n != EMBED]
    missing = [n for n in want if n not in found]
    if missing:
        raise ToolchainError(f"{where} lacks {missing[0]} ({len(missing)} missing for {params.num_hidden_layers} "
                             "draft layer(s))", "check num_hidden_layers in the draft's config.json")
    fc = found["fc.weight"][0]
    if tuple(ckpt.tensors[fc].shape) != (params.hidden_size, 2 * params.hidden_size):
        raise ToolchainError(f"{where}: fc.weight is {list(ckpt.tensors[fc].shape)}, expected "
                             f"[{params.hidden_size}, {2 * params.hidden_size}] (EAGLE's fc maps [embedding, "
                             "hidden state] to the hidden size)", "this is not an EAGLE-1/2 draft checkpoint")
    groups: dict[tuple, Group] = {}
    for short, (full, m) in found.items():
        key = ("qkv", m.layer) if m.row.shard is Shard.QKV else ("one", short)
        group = groups.setdefault(key, Group(sources=()))
        if not group.outputs:
            group.outputs.append(Output(m.row, trt_name(m.row, m.layer), 0))
        group.sources += (full,)
    for key, group in groups.items():
        if key[0] == "qkv":
            parts = {found[s.removeprefix("model.")][1].row.part: s for s in group.sources}
            group.sources = (parts["q"], parts["k"], parts["v"])
    return list(groups.values()), EMBED not in found


def eagle_tree(spec) -> list[list[int]]:
    """speculative.choices, else the backend's default tree (mc_sim_7b_63)."""
    sp = spec.speculative
    if not sp.choices:
        return [list(p) for p in MC_SIM_7B_63]
    try:
        tree = parse_choices(sp.choices)
    except ValueError as err:
        raise ToolchainError(f"speculative.choices: {err}") from None
    problem = tree_problem(tree)
    if problem is not None:
        raise ToolchainError(f"eagle tree: {problem}", "fix speculative.choices")
    return tree


@dataclass(frozen=True)
class EagleShape:
    num_eagle_layers: int
    max_draft_len: int
    max_non_leaves_per_layer: int


def eagle_shape(spec, tree: list[list[int]]) -> EagleShape:
    """One EagleNet per tree level; the draft length and non-leaf bound the tree needs
    (EagleConfig defaults where the tree needs less)."""
    params = _upstream()["config_params"]
    depth = max(len(p) for p in tree)
    limit = spec.speculative.max_draft_len or len(tree)
    if len(tree) > limit:
        raise ToolchainError(f"the eagle tree has {len(tree)} nodes but speculative.max_draft_len is {limit}",
                             f"set speculative.max_draft_len to {len(tree)} (or 0 to take the tree's size)")
    non_leaves = max(non_leaves_per_level(tree), default=0)
    return EagleShape(depth, limit, max(non_leaves, params["max_non_leaves_per_layer"]["default"]))


def _sources(draft: EagleDraft, target_lm: str) -> list[tuple[Group, str]]:
    """(group, relative TensorRT-LLM name or 'lm_head') in write order, with the target-side groups."""
    out = [(g, g.outputs[0].name) for g in draft.groups]
    if draft.embedding_from_target:
        row = next(r for r in DRAFTER.rows if r.hf == EMBED)
        name = trt_name(row, None)
        out.append((Group(sources=("target:model.embed_tokens.weight",), outputs=[Output(row, name, 0)]), name))
    lm_row = Row(target_lm, "lm_head.weight", Shard.VOCAB, stage=Stage.LAST)
    out.append((Group(sources=(f"target:{target_lm}",), outputs=[Output(lm_row, "lm_head.weight", 0)]), "lm_head"))
    return out


def _full_name(relative: str, i: int) -> str:
    names = _upstream()["names"]
    if relative == "lm_head":
        return names["lm_head"].format(i=i)
    return f"{names['drafter'].format(i=i)}.{relative}"


def _shard(group: Group, tensor_of, draft: EagleDraft, options: Options) -> dict[int, torch.Tensor]:
    """tp rank -> the group's piece; the eagle nets use tp = world size (pp is refused)."""
    opts = Options(tp=options.world_size, pp=1, dtype=options.dtype,
                   use_parallel_embedding=options.use_parallel_embedding,
                   embedding_sharding_dim=options.embedding_sharding_dim)
    dtype = TORCH_DTYPES[options.dtype]
    row = group.outputs[0].row
    tensors = {s: prepare(tensor_of(s), row, dtype, s) for s in group.sources}
    return {rank: items[0][1] for rank, items in shard_group(group, tensors, draft.params, opts).items()}


def plan_draft(draft: EagleDraft, shape: EagleShape, options: Options) -> list[list[PlannedTensor]]:
    """Per rank, the EagleNet tensors it holds: every net a full copy (upstream duplicates them)."""
    metas = draft.metas
    v, h = draft.params.vocab_size, draft.params.hidden_size
    target_meta = torch.empty((v, h), device="meta")
    per_rank: list[list[PlannedTensor]] = [[] for _ in range(options.world_size)]
    for group, relative in _sources(draft, "lm_head.weight"):
        pieces = _shard(group, lambda s: target_meta if s.startswith("target:") else metas[s], draft, options)
        for i in range(shape.num_eagle_layers):
            for rank, piece in pieces.items():
                per_rank[rank].append(PlannedTensor(_full_name(relative, i), tuple(piece.shape),
                                                    TORCH_DTYPES[options.dtype]))
    return per_rank


def write_draft(draft: EagleDraft, shape: EagleShape, target: HFCheckpoint, writers, options: Options) -> None:
    """Each draft tensor read once, its slices written to every net on every rank."""
    target_lm = "lm_head.weight" if target.has("lm_head.weight") else "model.embed_tokens.weight"
    with HFCheckpoint(draft.directory) as ckpt:
        def tensor_of(source: str) -> torch.Tensor:
            return target.load(source.removeprefix("target:")) if source.startswith("target:") else ckpt.load(source)

        for group, relative in _sources(draft, target_lm):
            pieces = _shard(group, tensor_of, draft, options)
            for i in range(shape.num_eagle_layers):
                for rank, piece in pieces.items():
                    writers[rank].write(_full_name(relative, i), piece.contiguous())


def eagle_config(config: dict, draft: EagleDraft, shape: EagleShape, options: Options) -> dict:
    """The base checkpoint's config as an EagleForCausalLM one, with the draft's own
    LlamaForCausalLM config nested as eagle_net_config."""
    up = _upstream()
    keys = up["config_keys"]
    net = build_config(LLAMA, replace(draft.params, architecture=up["net_architecture"]), dtype=options.dtype,
                       tp=options.tp, pp=options.pp, use_parallel_embedding=options.use_parallel_embedding,
                       embedding_sharding_dim=options.embedding_sharding_dim)
    out = dict(config)
    out["architecture"] = up["architecture"]
    out[keys["num_layers"]] = shape.num_eagle_layers
    out[keys["max_draft_len"]] = shape.max_draft_len
    out[keys["max_non_leaves"]] = shape.max_non_leaves_per_layer
    out[keys["net_config"]] = net
    return out


def refuse_unsupported(spec, architecture: str | None, quantized: bool) -> None:
    """What an EAGLE conversion cannot take (plan and convert share it): no draft directory,
    pp > 1, quantization (`quantized`: the view is active, or the target is stored quantized), a non-Llama
    target."""
    sp = spec.speculative
    if sp.heads is None:
        raise ToolchainError("speculative.mode=eagle needs speculative.heads (the EAGLE draft checkpoint directory)",
                             "set speculative.heads to a directory with the draft's config.json and safetensors")
    if spec.parallelism.pp > 1:
        raise ToolchainError(f"EAGLE with parallelism.pp={spec.parallelism.pp} is not supported",
                             "set parallelism.pp to 1 (use tp for more GPUs)")
    if quantized:
        raise ToolchainError("EAGLE conversion writes an unquantized checkpoint",
                             "set quantization.method none (and kv_cache none) for speculative.mode eagle")
    if architecture is not None and architecture not in LLAMA.architectures:
        raise ToolchainError(f"EAGLE needs a Llama target ({architecture} given): TensorRT-LLM's "
                             "EagleForCausalLM extends LLaMAForCausalLM", "use a Llama model, or speculative.mode medusa")


def attach_draft(plan, spec) -> EagleDraft:
    """Add the spec's EAGLE draft to a conversion plan: EagleNet tensors on every rank and
    the EagleForCausalLM config. Refused before any write: what `refuse_unsupported` names,
    a draft that does not fit the target or the tree."""
    refuse_unsupported(spec, plan.params.architecture, quantized=plan.quant is not None)
    draft = read_draft(spec.speculative.heads, plan.params)
    shape = eagle_shape(spec, eagle_tree(spec))
    try:
        # the draft is one stage over every rank, its experts (none) left to the Mapping's default
        sharding.check_parallelism(draft.params, Layout(plan.options.world_size, 1,
                                                        parallel_embedding=plan.options.use_parallel_embedding,
                                                        embedding_sharding_dim=plan.options.embedding_sharding_dim))
    except ToolchainError as err:
        raise ToolchainError(f"the EAGLE draft cannot be split over {plan.options.world_size} ranks: {err.message}",
                             err.hint) from None
    for rank, extra in enumerate(plan_draft(draft, shape, plan.options)):
        plan.ranks[rank].extend(extra)
    plan.config = eagle_config(plan.config, draft, shape, plan.options)
    plan.eagle = (draft, shape)
    return draft
