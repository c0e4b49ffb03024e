"""A model's own multi-token-prediction (MTP) layer into its checkpoint, for speculative.mode mtp.

DeepSeek-V3 stores num_nextn_predict_layers MTP modules after its decoder, as model.layers.{num_hidden_layers + k}.*
(transformers drops them on load). Each is a whole decoder layer (the same MLA attention and mixture of experts as
the others) with enorm, hnorm, eh_proj [H, 2H] and shared_head.norm around it (TensorRT-LLM
_torch/models/modeling_deepseekv3.py, DeepseekV3MTP). TensorRT-LLM's MTPDecodingConfig reads them from the
checkpoint it loads; the CPU stand-in of the LLM API (target llmapi-cpu) converts them here: the first `layers` of
them go into the rank files as transformer.layers.{num_hidden_layers + k}.*, the decoder split over tp as every
layer is, the family's `mtp_rows` whole on every rank; config.json's num_hidden_layers stays the main model's
and `num_nextn_predict_layers` says how many MTP layers follow it.

Refused in one line: pipeline parallelism (upstream asserts "PP + MTP combination is not supported" in
DeepseekV3ForCausalLM), a family without MTP rows, a checkpoint whose config has fewer MTP layers than asked or
whose weights lack them, a quantized conversion, and a plan from config.json alone.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.checkpoint.layout import Plan, PlannedTensor, build_groups, prepare, shard_group, TORCH_DTYPES
from toolchain.errors import ToolchainError

CONFIG_KEY = "num_nextn_predict_layers"
"""The checkpoint config.json key counting the MTP layers held after num_hidden_layers (HF's name for them)."""
_PREFIX = "model.layers."


def _layer_of(hf_name: str) -> int | None:
    if not hf_name.startswith(_PREFIX):
        return None
    index = hf_name[len(_PREFIX):].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def available(params: Any) -> int:
    """MTP layers the model's config.json declares (0 for a family without them)."""
    return int(json.loads(params.extras_json or "{}").get(CONFIG_KEY, 0))


def attach_mtp(plan: Plan, ckpt: HFCheckpoint, layers: int) -> None:
    """Add the checkpoint's first `layers` MTP layers to `plan`: their tensors on every rank and the config key."""
    family, params, n = plan.family, plan.params, plan.params.num_hidden_layers
    origin = str(ckpt.config_path)
    if plan.options.pp > 1:
        raise ToolchainError(f"speculative.mode mtp with parallelism.pp {plan.options.pp}: PP + MTP combination is not "
                             "supported (TensorRT-LLM DeepseekV3ForCausalLM)", "set parallelism.pp to 1 (use tp)")
    if not family.mtp_rows:
        raise ToolchainError(f"{origin}: speculative.mode mtp needs multi-token prediction layers, which "
                             f"{params.architecture} does not have", "use speculative.mode draft_target, eagle3 or ngram")
    have = available(params)
    if have < layers:
        raise ToolchainError(f"{origin}: speculative.mode mtp asks for {layers} MTP layer(s) but the model has "
                             f"{CONFIG_KEY} {have}", "use a checkpoint with its MTP layer, or speculative.mode none")
    if plan.quant is not None:
        raise ToolchainError(f"{origin}: speculative.mode mtp with a quantized conversion is not supported yet",
                             "convert the bfloat16 checkpoint with quantization.method none")
    if plan.config_only:
        raise ToolchainError(f"{origin}: the MTP layer cannot be planned from config.json alone",
                             "download the checkpoint's weights first")
    keep = range(n, n + layers)
    wanted = [f"{_PREFIX}{i}.{row.hf.split('}.', 1)[1]}" for i in keep for row in family.mtp_rows if row.trt]
    missing = [name for name in wanted if name not in ckpt.tensors]
    if missing:
        raise ToolchainError(f"{origin}: config.json says {CONFIG_KEY} {have} but the weights lack {missing[0]}"
                             f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}",
                             "use the checkpoint with its MTP layer (as released), or speculative.mode none")

    def ignore(p: Any, hf_name: str) -> bool:  # the MTP layers not kept, as the family drops all of them
        layer = _layer_of(hf_name)
        return bool(family.ignore and family.ignore(params, hf_name)) and (layer is None or layer not in keep)

    extras = {**json.loads(params.extras_json or "{}"), "mtp_from": n}
    with_mtp = dataclasses.replace(params, num_hidden_layers=n + layers, extras_json=json.dumps(extras, sort_keys=True))
    table = dataclasses.replace(family, rows=family.rows + family.mtp_rows, ignore=ignore)
    groups, _dropped = build_groups(table, with_mtp, ckpt, plan.options)
    prefixes = tuple(f"transformer.layers.{i}." for i in keep)
    groups = [g for g in groups if g.outputs[0].name.startswith(prefixes)]
    dtype = TORCH_DTYPES[plan.options.dtype]
    for group in groups:
        row = group.outputs[0].row
        metas = {s: prepare(ckpt.meta(s), row, dtype, s) for s in group.sources}
        for rank, items in shard_group(group, metas, params, plan.options).items():
            plan.ranks[rank].extend(PlannedTensor(name, tuple(t.shape), t.dtype) for name, t in items)
    plan.groups.extend(groups)
    converted = {source for group in groups for source in group.sources}
    plan.dropped = [name for name in plan.dropped if name not in converted]
    plan.config = {**plan.config, CONFIG_KEY: layers}
