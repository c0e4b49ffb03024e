"""`toolchain model-repo SPEC`: render the Triton model repository."""

from __future__ import annotations

import time
from pathlib import Path

import click

from toolchain.cli._common import Context, spec_command
from toolchain.pipeline import model_repo_for
from toolchain.spec import DeploymentSpec


@click.command()
@click.option("--force", is_flag=True, help="Re-render even when the repository is up to date.")
@click.option("--keep-edits", is_flag=True,
              help="Keep files edited by hand since the repository was rendered instead of rendering again "
                   "(its manifest records them as edited by hand).")
@click.option("--python-models", "python_models", metavar="DIR", default=None,
              help="Use preprocessing, postprocessing and tensorrt_llm_bls model.py (and helpers) from "
                   "tensorrtllm_backend's all_models/inflight_batcher_llm tree DIR instead of the toolchain's; "
                   "target llmapi: TensorRT-LLM's triton_backend/all_models/llmapi (its model.py and helpers.py).")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, force: bool, keep_edits: bool, python_models: str | None) -> None:
    """Render model_repo/<name> for SPEC: ensemble, preprocessing, tensorrt_llm, postprocessing and
    tensorrt_llm_bls, every config.pbtxt built through Triton's ModelConfig protobuf."""
    ws = ctx.workspace
    start = time.time()
    manifest = model_repo_for(spec)(spec, ws, force=force, python_models=python_models, keep_edits=keep_edits,
                                    echo=click.echo)
    out = manifest.outputs
    state = f"rendered in {manifest.seconds:.2f}s" if manifest.created >= start else "up to date, reused"
    mode = "decoupled (streaming)" if out.get("decoupled") else "not decoupled"
    if spec.llmapi_path:
        click.echo(f"model repository {ws.model_repo_dir(spec)}: {state} (Triton's llmapi model, target "
                   f"{spec.target}, {mode}; model.yaml serves {out.get('model_dir')})")
        click.echo(f"python model: {out.get('python_model')}")
        return
    click.echo(f"model repository {ws.model_repo_dir(spec)}: {state} "
               f"({len(out.get('models', []))} models, target {out.get('target')}, "
               f"tensorrt_llm backend {out.get('backend')}, {mode})")
    used = out.get("python_models") or {}
    upstream = sorted(n for n, where in used.items() if where != "toolchain")
    click.echo("python models: " + (f"NVIDIA's from {Path(used[upstream[0]]).parent.parent} ({', '.join(upstream)})"
                                    if upstream else "the toolchain's"))
    if not (ws.engine_dir(spec) / "config.json").is_file():
        click.echo(f"note: no engine at {ws.engine_dir(spec)} yet; run `toolchain build-engine` before serving",
                   err=True)
