"""`toolchain convert SPEC`: HF checkpoint -> TensorRT-LLM 1.2 checkpoint."""

from __future__ import annotations

import time

import click

from toolchain.cli._common import Context, spec_command
from toolchain.pipeline import convert_for
from toolchain.spec import DeploymentSpec


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _layers(layers: list[int]) -> str:
    return "none" if not layers else f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def _print_plan(plan, summary: bool = False) -> None:
    o = plan.options
    click.echo(f"plan: {plan.config['architecture']} -> {o.world_size} rank(s) (tp {o.tp} x pp {o.pp}), "
               f"dtype {o.dtype}, {_size(plan.total_bytes)}")
    quant = plan.config.get("quantization") or {}
    if quant.get("quant_algo") or quant.get("kv_cache_quant_algo"):
        click.echo("quantization: " + ", ".join(f"{k} {v}" for k, v in quant.items() if v not in (None, [])))
    if plan.config_only:
        click.echo("planned from config.json alone (no weights in the checkpoint directory yet); "
                   "`toolchain convert` needs the safetensors")
    for rank, tensors in enumerate(plan.ranks):
        click.echo(f"rank{rank}.safetensors  pp {rank // o.tp} tp {rank % o.tp}  "
                   f"layers {_layers(plan.stage_layers(rank))}  {len(tensors)} tensors  {_size(plan.rank_bytes(rank))}")
        if summary:
            continue
        for t in tensors:
            shape = "x".join(str(d) for d in t.shape)
            click.echo(f"  {t.name:<56} {shape:>14}  {str(t.dtype).removeprefix('torch.'):<9} {t.nbytes:>12}")
    if plan.dropped:
        click.echo(f"dropped HF tensors (no checkpoint counterpart): {len(plan.dropped)}")


@click.command(help="Convert the spec's HF checkpoint into a TensorRT-LLM 1.2 checkpoint "
                    "(config.json + rank{N}.safetensors).")
@click.option("--force", is_flag=True, help="Rebuild even when the existing checkpoint is current.")
@click.option("--keep-edits", is_flag=True,
              help="Keep files edited by hand since convert wrote the checkpoint instead of converting again "
                   "(its manifest records them as edited by hand).")
@click.option("--dry-run", is_flag=True,
              help="Print per-rank tensors, shapes and bytes; write nothing. Works on a checkpoint "
                   "directory holding only config.json.")
@click.option("--summary", is_flag=True, help="With --dry-run: one line per rank, no tensor list.")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, force: bool, keep_edits: bool, dry_run: bool, summary: bool) -> None:
    from toolchain.checkpoint.stage import plan_convert  # keep `toolchain --help` light

    if summary and not dry_run:
        raise click.UsageError("--summary only applies with --dry-run")
    if dry_run and spec.llmapi_path:
        raise click.UsageError(f"--dry-run plans a TensorRT-LLM checkpoint; target {spec.target} has none "
                               "(`toolchain plan` shows its memory per rank)")
    if dry_run:
        _print_plan(plan_convert(spec), summary=summary)
        return
    start = time.time()
    manifest = convert_for(spec)(spec, ctx.workspace, force=force, echo=click.echo, keep_edits=keep_edits)
    out = ctx.workspace.checkpoint_dir(spec)
    if spec.llmapi_path:
        o = manifest.outputs
        what = (f"a Hugging Face-format {o.get('format')} checkpoint in {out}" if o.get("quantized", True)
                else f"the checkpoint as it is ({o['model_dir']})")
        click.echo(f"LLM-API path: serving {what}")
        return
    if manifest.created >= start:
        o = manifest.outputs
        click.echo(f"wrote {out}: {o['world_size']} rank(s) (tp {o['tp']} x pp {o['pp']}), {o['dtype']}, "
                   f"{_size(o['bytes'])} in {time.time() - start:.1f}s")
