"""HF checkpoint directory -> TensorRT-LLM 1.2 checkpoint directory.

Order matters for error quality: config.json is normalised and the
parallelism checked (§3.5) before any safetensors file is opened, names are
matched and every rank planned from headers before any weight is read, and
only then is data read and written.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.archs import load_params
from toolchain.archs.params import ArchParams
from toolchain.checkpoint import sharding
from toolchain.checkpoint.config import build_config
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.checkpoint.layout import Options, Plan, build_plan
from toolchain.checkpoint.writer import write_plan
from toolchain.errors import ToolchainError

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
TARGETS = ("cpu", "trtllm")


def resolve_dtype(requested: str, params: ArchParams, ckpt: HFCheckpoint, target: str) -> str:
    """The checkpoint dtype. "auto" takes the HF dtype; fp32 becomes fp16 on the
    trtllm target as the upstream converters do (§1.2), but stays fp32 on cpu
    where fp16 matmuls are slow and lossy for no gain."""
    if requested not in DTYPE_CHOICES:
        raise ToolchainError(f"unknown dtype '{requested}'", f"use one of {', '.join(DTYPE_CHOICES)}")
    if target not in TARGETS:
        raise ToolchainError(f"unknown target '{target}'", f"use one of {', '.join(TARGETS)}")
    if requested != "auto":
        return requested
    hf = params.dtype
    if hf is None:
        # config.json without dtype/torch_dtype: the embedding's stored dtype is the truth.
        stored = ckpt.tensors.get("model.embed_tokens.weight")
        hf = str(stored.dtype).removeprefix("torch.") if stored is not None else "float32"
        if hf not in ("float32", "float16", "bfloat16"):
            hf = "float32"
    return "float16" if hf == "float32" and target == "trtllm" else hf


def plan_checkpoint(hf_dir: Path | str, *, tp: int, pp: int, dtype: str = "auto", target: str = "cpu",
                    use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                    ckpt: HFCheckpoint | None = None) -> Plan:
    """Everything `convert_checkpoint` would write, per rank, without reading weights."""
    ckpt = ckpt or HFCheckpoint(hf_dir)
    family, params = load_params(ckpt.config, str(ckpt.config_path))
    sharding.check_parallelism(params, tp, pp, use_parallel_embedding=use_parallel_embedding,
                               embedding_sharding_dim=embedding_sharding_dim)
    resolved = resolve_dtype(dtype, params, ckpt, target)
    opts = Options(tp=tp, pp=pp, dtype=resolved, use_parallel_embedding=use_parallel_embedding,
                   embedding_sharding_dim=embedding_sharding_dim)
    config = build_config(family, params, dtype=resolved, tp=tp, pp=pp,
                          use_parallel_embedding=use_parallel_embedding,
                          embedding_sharding_dim=embedding_sharding_dim)
    return build_plan(family, params, ckpt, opts, config)


def convert_checkpoint(hf_dir: Path | str, out_dir: Path | str, *, tp: int, pp: int, dtype: str = "auto",
                       target: str = "cpu", use_parallel_embedding: bool = False,
                       embedding_sharding_dim: int = 0) -> dict:
    """Write config.json and rank{N}.safetensors into `out_dir` (existing, empty);
    return the config written."""
    out = Path(out_dir)
    if not out.is_dir() or any(out.iterdir()):
        raise ToolchainError(f"output directory {out} must exist and be empty",
                             "pass a fresh directory (the convert stage uses a temporary one)")
    with HFCheckpoint(hf_dir) as ckpt:
        plan = plan_checkpoint(hf_dir, tp=tp, pp=pp, dtype=dtype, target=target,
                               use_parallel_embedding=use_parallel_embedding,
                               embedding_sharding_dim=embedding_sharding_dim, ckpt=ckpt)
        write_plan(plan, ckpt, out)
    (out / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    return plan.config
