"""`toolchain init SOURCE`: write a starting spec for a Hugging Face model that passes `toolchain plan`."""

from __future__ import annotations

from pathlib import Path

import click

from toolchain.cli._common import Context, pass_ctx
from toolchain.errors import ToolchainError
from toolchain import hub
from toolchain.plan.model import load_model
from toolchain.checks.starter import (TP_SIZES, default_name, fit_parallelism, refuse_existing, render,
                                    resolve_options, spec_data, write_spec)
from toolchain.spec import apply_overrides, parse_overrides, spec_from_dict


@click.command()
@click.argument("source")
@click.option("--gpu", default=None, metavar="NAME", help="GPU the deployment runs on (H100, L40S, ...); "
              "implies --target llmapi (trtllm where the LLM-API path refuses the spec).")
@click.option("--quant", default="none", show_default=True, metavar="METHOD",
              help="Weight format: none, int8_wo, int4_wo, awq, smoothquant or fp8.")
@click.option("--target", default=None, metavar="TARGET",
              help="cpu, trtllm, llmapi or llmapi-cpu [default: llmapi with --gpu, else cpu].")
@click.option("--name", default=None, help="Deployment name [default: from SOURCE].")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Spec file to write [default: build/<name>.yaml under --root].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Set any other spec field, e.g. --set build.host_memory_gib=1024 (repeatable).")
@click.option("--force", is_flag=True, help="Overwrite an existing spec (and downloaded config directory).")
@pass_ctx
def command(ctx: Context, source: str, gpu: str | None, quant: str, target: str | None, name: str | None,
            out: Path | None, overrides: tuple[str, ...], force: bool) -> None:
    """Write a starting spec for SOURCE: a local Hugging Face model directory (config.json is enough), or a
    hub id such as Qwen/Qwen2.5-0.5B-Instruct, whose config and tokenizer files (no weights) are fetched into
    configs/<name> next to the spec. Tensor parallelism is the smallest size whose KV cache holds
    max_batch_size sequences of max_seq_len on a GPU, else the smallest that fits (with a note); the spec is
    planned before it is written and is never written over without --force."""

    fallback = "trtllm" if target is None and gpu else None  # a GPU's default target, llmapi, may give way
    target, gpu_name, quant = resolve_options(target, gpu, quant)
    name = name or default_name(source)
    spec_from_dict({"name": name}, Path.cwd(), "--name")  # the name becomes paths: refuse a bad one first
    out = out or ctx.workspace.root / "build" / f"{name}.yaml"
    refuse_existing(out, force, "or --out another file")
    local = Path(source).expanduser()
    if local.is_dir():
        checkpoint = local
    elif hub.is_repo_id(source):
        checkpoint = out.parent / "configs" / name
        refuse_existing(checkpoint, force, f"or pass {checkpoint} as SOURCE")
        hub.fetch_config(source, checkpoint)
    else:
        raise ToolchainError(f"no model directory '{source}'",
                             "pass a local Hugging Face model directory or a hub id such as org/model")
    model = load_model(checkpoint)
    data = spec_data(checkpoint, out, name=name, target=target, gpu=gpu_name, quant=quant, hf_config=model.hf_config)
    apply_overrides(data, overrides, "--set")
    fixed_tp = any(key == "parallelism.tp" for key, _ in parse_overrides(overrides))
    data, notes = fit_parallelism(data, out, source, (data["parallelism"]["tp"],) if fixed_tp else TP_SIZES,
                                  fallback)
    write_spec(out, render(data, source, model.params.architecture, notes))
    click.echo(f"wrote {out}: {model.params.architecture}, target {data['target']}, tp {data['parallelism']['tp']}"
               + (f" on {gpu_name}" if gpu_name else "") + f", quantization {quant}")
    for note in notes:
        click.echo(f"note: {note}")
    click.echo(f"next: toolchain plan {out}")

