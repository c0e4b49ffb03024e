"""`toolchain import SOURCE...`: an existing tensorrtllm_backend deployment read into a spec, with its round trip."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from toolchain.cli._common import Context, pass_ctx
from toolchain.errors import StageFailed, ToolchainError
from toolchain.fsutil import atomic_file
from toolchain.spec import spec_from_dict


def _sort_sources(sources: tuple[Path, ...], engine: Path | None, hf: Path | None) -> tuple[Path, Path | None,
                                                                                               Path | None]:
    """SOURCE... holds the repository, and may hold the engine and the HF checkpoint directories too."""
    repos = []
    for source in sources:
        if any(Path(source).glob("*/config.pbtxt")):
            repos.append(source)
            continue
        try:
            cfg = json.loads((Path(source) / "config.json").read_text())
        except (OSError, ValueError):
            raise ToolchainError(f"{source} is neither a model repository (*/config.pbtxt) nor an engine or HF "
                                 "checkpoint directory (config.json)", "pass the repository filled from the "
                                 "templates, and --engine / --hf") from None
        if isinstance(cfg, dict) and "build_config" in cfg:
            engine = engine or source
        else:
            hf = hf or source
    if len(repos) != 1:
        raise ToolchainError(f"{'no' if not repos else len(repos)} model repositories among {', '.join(map(str, sources))}",
                             "pass one repository directory (holding ensemble/, tensorrt_llm/, ...)")
    return repos[0], engine, hf


@click.command("import")
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--engine", "engine", type=click.Path(path_type=Path), default=None,
              help="Engine directory (trtllm-build output); default: the tensorrt_llm model's engine_dir.")
@click.option("--hf", "hf", type=click.Path(path_type=Path), default=None,
              help="Hugging Face checkpoint the engine was converted from (model.checkpoint); default: the "
                   "tokenizer directory.")
@click.option("--draft-hf", "draft_hf", type=click.Path(path_type=Path), default=None,
              help="draft-target: the draft's Hugging Face checkpoint (speculative.draft_model), which convert needs.")
@click.option("--out", "out", type=click.Path(path_type=Path), default=None,
              help="Spec to write (default build/<repository name>.yaml).")
@click.option("--target", type=click.Choice(["trtllm", "llmapi"]), default="trtllm", show_default=True,
              help="trtllm: the deployment as it is; llmapi: its LLM-API counterpart, with what is lost.")
@click.option("--gpu", default=None, help="The GPU the engine was built for and serves on (gpu.name: a name "
              "`toolchain plan` knows); the engine's config.json does not record it.")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="With --target llmapi: plan both deployments and print their predictions side by side.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Also write the round trip's report as JSON here.")
@pass_ctx
def command(ctx: Context, sources: tuple[Path, ...], engine: Path | None, hf: Path | None, draft_hf: Path | None,
            out: Path | None, gpu: str | None, target: str, compare: bool, report_path: Path | None) -> None:
    """Read a Triton repository filled from upstream's inflight_batcher_llm templates (plain ensemble, BLS or
    draft-target), its engine's config.json and the HF checkpoint into a spec; render the spec's repository
    and compare every parameter and build flag with the original."""
    from toolchain.importer.repo import read_repository
    from toolchain.importer.roundtrip import MISMATCH, round_trip
    from toolchain.importer.to_spec import read_deployment, spec_dict, spec_name

    repo_dir, engine, hf = _sort_sources(sources, engine, hf)
    repo = read_repository(repo_dir)
    dep = read_deployment(repo, engine, hf, draft_hf)
    out = out or Path("build") / f"{spec_name(None, repo)}.yaml"
    data = spec_dict(dep, spec_name(out, repo))
    if gpu is not None:  # an engine's config.json does not record the card it was built for
        data["gpu"] = {"name": gpu}
    spec = spec_from_dict(data, out.parent.resolve(), f"the spec imported from {repo.root}")
    report = round_trip(dep, spec)
    losses: list = []
    moved = None
    if target == "llmapi":
        from toolchain.importer.llmapi import to_llmapi

        data, losses = to_llmapi(data, repo["tensorrt_llm"].raw, base=out.parent)
        moved = spec_from_dict(data, out.parent.resolve(), f"the LLM-API spec moved from {repo.root}")
    header = (f"# Imported by `toolchain import` from {repo.root} ({repo.layout} layout) and {dep.engine.dir}.\n"
              "# The round trip's report lists what this spec does not express.\n")
    with atomic_file(out) as fh:
        fh.write(header + yaml.safe_dump(data, sort_keys=False))
    for line in report.lines():
        click.echo(line)
    for loss in losses:
        click.echo(loss.line())
    if report_path is not None:
        body = report.to_json() | {"spec": str(out), "target": target,
                                   "losses": [loss.line() for loss in losses]}
        with atomic_file(report_path) as fh:
            fh.write(json.dumps(body, indent=1) + "\n")
    click.echo(f"wrote {out} (target {data.get('target', target)})")
    if moved is not None and compare and gpu is None:
        click.echo("note: pass --gpu NAME to plan both deployments side by side (the engine does not record its "
                   "GPU)", err=True)
    elif moved is not None and compare:
        from toolchain.importer.llmapi import compare_plans, side_by_side

        click.echo(side_by_side(compare_plans(spec, moved)))
    if repo.draft and draft_hf is None:
        click.echo("note: speculative.draft_model is unset: set it (or pass --draft-hf) to the draft's Hugging Face "
                   "checkpoint before `toolchain convert`", err=True)
    bad = report.of(MISMATCH)
    if bad:
        raise StageFailed(f"the round trip differs from the original in {len(bad)} field(s), first "
                          f"{bad[0].where}.{bad[0].field}", "report it: the import missed a mapping")
    del ctx
