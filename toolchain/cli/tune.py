"""`toolchain tune SPEC`: search tp x pp x replicas, quantization, KV cache, batch and token limits (and
speculative decoding where the spec has a draft or heads); drop what does not fit or misses the SLO; rank by
output throughput per GPU (or cost per million tokens); write the top specs; `--measure` deploys them here."""

from __future__ import annotations

import time
from pathlib import Path

import click

from toolchain.cli._common import Context, pass_ctx
from toolchain.errors import StageFailed, ToolchainError
from toolchain.gpus import lookup
from toolchain.plan import crosscheck
from toolchain.slo import RATE_KEYS, parse_slo, thresholds
from toolchain.spec import load_spec
from toolchain.spec_workload import SloSection
from toolchain.targets import CPU, target_of
from toolchain.tune import measure as measuring
from toolchain.tune.candidates import derive
from toolchain.tune.report import render, slo_miss_line, write, written_spec
from toolchain.tune.disagg import search_with_disagg
from toolchain.tune.search import cross_check


def parse_slo_option(text: str | None) -> list[str]:
    """--slo "ttft_p99_ms=500,tpot_p99_ms=50" as threshold strings ("ttft_p99_ms<=500"; a rate key's "=" is ">="); one
    line on a bad one."""
    if not text:
        return []
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        # K=V is a bound in the direction of its kind: latencies at most V, rates (goodput_fraction=0.9) at least V
        op = ">=" if key.strip() in RATE_KEYS else "<="
        item = part if key.endswith(("<", ">")) or not sep else f"{key.strip()}{op}{value.strip()}"
        try:
            parse_slo(item)
        except ValueError as err:
            raise ToolchainError(f"--slo: {err}", "write --slo ttft_p99_ms=500,tpot_p99_ms=50") from None
        out.append(item)
    if not out:
        raise ToolchainError(f"--slo '{text}' names no threshold", "write --slo ttft_p99_ms=500,tpot_p99_ms=50")
    return out


def with_slo(spec, items: list[str]):
    """The spec with --slo as its `validation.slo`, so every candidate, and every spec written, carries the SLO it
    was judged against: --slo replaces the spec's named bounds (a bound it names goes into its field, any other
    into `extra`); the spec's extra strings stay unless --slo names them too."""
    if not items:
        return spec
    named = [f for f in SloSection.model_fields if f != "extra"]
    given = {parse_slo(item).name: item for item in items}
    fields: dict = {f: None for f in named}
    extra = [x for x in spec.validation.slo.extra if parse_slo(x).name not in given]
    for name, item in given.items():
        t = parse_slo(item)
        if name in named:
            fields[name] = t.value
        else:
            extra.append(f"{t.name}{'<=' if t.upper else '>='}{t.value:.10g}")
    return derive(spec, {**{f"validation.slo.{f}": v for f, v in fields.items()}, "validation.slo.extra": extra})


def gpu_specs(spec, gpus: tuple[str, ...], prices: tuple[float, ...]) -> list:
    """The user's spec once per GPU to search, with gpu.name and gpu.hourly_usd set."""
    if target_of(spec).device == CPU:
        if gpus:
            raise ToolchainError(f"--gpu names a GPU, and target {spec.target} runs on this host's CPU",
                                 "drop --gpu, or set --set target=trtllm to tune for GPUs")
        return [derive(spec, {"gpu.hourly_usd": prices[0]}) if prices else spec]
    names = list(gpus) or ([spec.gpu.name] if spec.gpu.name else [])
    if not names:
        raise ToolchainError("no GPU to tune for", "pass --gpu NAME (e.g. --gpu H200) or set gpu.name in the spec")
    if len(prices) not in (0, 1, len(names)):
        raise ToolchainError(f"{len(prices)} --gpu-hour-usd values for {len(names)} GPUs",
                             "give one price for all, or one per --gpu in the same order")
    out = []
    for i, name in enumerate(names):
        row = lookup(name)  # an unknown name fails here, in one line
        changes: dict = {"gpu.name": row.name, "gpu.memory_gib": None, "gpu.sm": None}
        if prices:
            changes["gpu.hourly_usd"] = prices[i if len(prices) > 1 else 0]
        out.append(derive(spec, changes))
    return out


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a spec field before the search, e.g. --set validation.workload.concurrency=32.")
@click.option("--gpus", "gpu_count", type=click.IntRange(min=1), default=None,
              help="GPUs to spend (replicas x tp x pp); target cpu: CPU ranks at most. Default: parallelism.gpus, "
                   "else tp x pp.")
@click.option("--gpu", "gpu_names", multiple=True, metavar="NAME",
              help="GPU to tune for (repeatable: the GPUs compete, by cost with --gpu-hour-usd). Default: gpu.name.")
@click.option("--slo", "slo_text", default=None, metavar="K=V,...",
              help="SLO replacing the spec's named bounds, e.g. ttft_p99_ms=500,tpot_p99_ms=50.")
@click.option("--gpu-hour-usd", "prices", multiple=True, type=click.FloatRange(min=0, min_open=True),
              help="Price of one GPU-hour (one for all, or one per --gpu): rank by cost per million output tokens.")
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True,
              help="Specs written (and deployed with --measure).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for the specs, table, Pareto plot and tune.json [default: <root>/tune/<name>].")
@click.option("--measure", is_flag=True,
              help="Deploy the top specs here (target cpu), bench each and pick by measured goodput.")
@click.option("--max-ppl-increase-pct", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="With --measure: a quantized candidate's perplexity may exceed the unquantized model's by this.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="With --measure: also deploy the spec as given, for the measured gain.")
@click.option("--cross-check", "cross_tool", type=click.Choice(["aiconfigurator"]), default=None,
              help="GPU targets: AIConfigurator 0.12.0's estimate of each of the top candidates beside ours (a "
                   "venv of its own, made on first use; about 7 s a candidate).")
@pass_ctx
def command(ctx: Context, spec_path: Path, overrides: tuple[str, ...], gpu_count: int | None,
            gpu_names: tuple[str, ...], slo_text: str | None, prices: tuple[float, ...], top: int,
            out_dir: Path | None, measure: bool, max_ppl_increase_pct: float, baseline: bool,
            cross_tool: str | None) -> None:
    """Search deployments of SPEC, rank them and write the best as specs ready for `toolchain deploy`."""
    spec = load_spec(spec_path, overrides)
    spec = with_slo(spec, parse_slo_option(slo_text))
    ths = thresholds(spec.validation.slo)
    if measure:
        why = measuring.measurable(spec)
        if why:
            raise ToolchainError(why)
    count = gpu_count or spec.parallelism.gpus or spec.parallelism.world_size
    specs = gpu_specs(spec, gpu_names, prices)
    executable = None
    if cross_tool:
        if target_of(spec).device == CPU:
            raise ToolchainError(f"--cross-check {cross_tool} estimates GPUs, and target {spec.target} runs on this "
                                 "host's CPU", "drop --cross-check, or tune a GPU target")
        executable = crosscheck.ensure_venv()  # before the search: a venv that cannot be made fails in one line
    by_cost = bool(prices) or (target_of(spec).device != CPU and all(s.gpu.hourly_usd is not None for s in specs))
    result = search_with_disagg(spec, specs, count, ths, by_cost)
    if not result.ranked and not result.closest():
        counts = ", ".join(f"{n} {why}" for why, n in result.drop_counts().items())
        where = f"{count} GPUs ({', '.join(s.gpu.name for s in specs)})" if target_of(spec).device != CPU \
            else f"{count} CPU rank(s)"
        raise ToolchainError(f"no tp x pp x replicas of {where} fits {spec.name}: {counts}",
                             "give more GPUs (--gpus), a larger GPU (--gpu) or shorter limits")
    if executable is not None:
        exe = executable
        cross_check(result.shown, top,
                    lambda s, device, batch: crosscheck.estimate(s, device, batch, executable=exe))
    text = render(result, top)
    click.echo(text)
    out = out_dir or ctx.workspace.root / "tune" / spec.name
    extra_doc: dict = {"gpu_count": count, "slo": {t.name: t.value for t in ths}}
    if measure and result.ranked:
        extra_doc["measured"], chosen = _measure(ctx, spec, result, top, max_ppl_increase_pct, baseline)
        extra_doc["choice"] = chosen
    written = write(out, result, top, text, extra_doc)
    for p in written:
        click.echo(f"wrote {p}")
    click.echo(f"wrote {out / 'tune.json'}")
    if not result.ranked:
        raise StageFailed(slo_miss_line(result) or "no candidate meets the SLO",
                          "loosen the SLO (--slo), give more GPUs, or lower the workload's concurrency")


def _measure(ctx: Context, spec, result, top: int, max_ppl: float, baseline: bool) -> tuple[list[dict], dict | None]:
    start = time.perf_counter()

    def progress(stage: str, msg: str) -> None:
        click.echo(f"[{time.perf_counter() - start:7.1f}s] {stage:<12} {msg}", err=True)

    ranked = [(e.candidate.label, written_spec(e, rank)) for rank, e in enumerate(result.shown, 1)]
    runs, best = measuring.measure(ranked, top, spec, ctx.workspace, max_ppl, progress, deploy_given=baseline)
    measured = [m.as_dict() for m in runs]
    click.echo("")
    click.echo("measured (goodput: requests/s meeting the SLO, at the spec's workload):")
    for m in runs:
        quality = "" if m.ppl_increase_pct is None else f", perplexity {m.ppl_increase_pct:+.2f}%"
        if m.error:
            click.echo(f"  {m.label}: failed: {m.error}")
            continue
        good = "-" if m.goodput_req_per_s is None else f"{m.goodput_req_per_s:.2f}"
        tok = "-" if m.output_tokens_per_s is None else f"{m.output_tokens_per_s:.1f}"
        pred = m.predicted
        against = "" if not pred else (f" (predicted {pred['output_tokens_per_s']:.1f}, "
                                       f"x{pred['ratio']['output_tokens_per_s'] or 0:.2f})")
        click.echo(f"  {m.label}: goodput {good} req/s, {tok} output tok/s{against}, SLO "
                   f"{'passed' if m.slo_passed else 'missed' if m.slo_passed is not None else '-'}{quality}"
                   + ("" if m.quality_ok else " (quality: not chosen)"))
    if best is None:
        click.echo("measured: no candidate ran and kept its quality")
        return measured, None
    click.echo(f"chosen: {best.label} ({best.spec.name}), goodput {best.goodput_req_per_s:.2f} req/s")
    given = next((m for m in runs if m.label == "as given" and m.goodput_req_per_s), None)
    choice = best.as_dict()
    if given is not None and best is not given:
        ratio = (best.goodput_req_per_s or 0.0) / (given.goodput_req_per_s or 1.0)
        choice["goodput_ratio_vs_given"] = round(ratio, 3)
        click.echo(f"  {ratio:.2f}x the spec as given ({given.goodput_req_per_s:.2f} req/s)")
    return measured, choice
