"""`toolchain eval SPEC`: held-out perplexity and greedy-token agreement of the
converted model against the original Hugging Face model; with `--endpoint URL`, of a running deployment's
OpenAI-compatible /v1/completions (echoed prompt log-probs), plus multiple-choice accuracy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from toolchain.cli._common import Context, spec_command
from toolchain.spec import DeploymentSpec

if TYPE_CHECKING:
    from toolchain.eval.adapters import AdapterEval


@click.command(help="Run the converted model (CPU engine, every rank) and the original HF model on held-out "
                    "text; report both perplexities and their greedy-token agreement. With --endpoint, measure a "
                    "running deployment's /v1/completions instead (echo with logprobs), plus multiple-choice "
                    "accuracy, against the HF model on the same tokens; validation.quality's bounds apply.")
@click.option("--endpoint", metavar="URL", default=None,
              help="A running OpenAI-compatible server (http://host:port): this project's, trtllm-serve, Dynamo's.")
@click.option("--model", "served_model", metavar="NAME", default=None,
              help="With --endpoint: the model to ask for (default: the first GET /v1/models lists).")
@click.option("--choices", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --endpoint: a JSONL multiple-choice set instead of the shipped one.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="With --endpoint: requests in flight at once.")
@click.option("--adapter", metavar="NAME", default=None,
              help="Evaluate under this LoRA adapter (a lora.adapters name) against PEFT's merged model.")
@click.option("--reference", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="With --adapter: an HF checkpoint taken as the merged model instead of PEFT's merge.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as JSON to this file.")
@click.option("--text", type=click.Path(dir_okay=False, path_type=Path),
              help="Evaluate on this UTF-8 file instead of the built-in held-out set.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=4096, show_default=True,
              help="Tokens evaluated at most (bounds the run time).")
@click.option("--window", type=click.IntRange(min=2), default=256, show_default=True,
              help="Tokens per forward pass (capped at the engine's max_seq_len).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads (default: torch's).")
@click.option("--min-agreement", type=click.FloatRange(0, 1), default=None,
              help="Exit 1 when greedy-token agreement is below this.")
@click.option("--max-perplexity-ratio", type=click.FloatRange(min=0), default=None,
              help="Exit 1 when perplexity / reference perplexity exceeds this.")
@spec_command
def command(ctx: Context, spec: DeploymentSpec, endpoint: str | None, served_model: str | None,
            choices: Path | None, concurrency: int, adapter: str | None, reference: Path | None,
            json_path: Path | None, text: Path | None, max_tokens: int, window: int, threads: int | None,
            min_agreement: float | None, max_perplexity_ratio: float | None) -> None:
    from toolchain.eval.adapters import adapter_eval
    from toolchain.eval.run import check_thresholds, run_eval  # keep `toolchain --help` light

    if reference is not None and adapter is None:
        raise click.UsageError("--reference is the merged model of an adapter: pass --adapter NAME with it")
    chosen = adapter_eval(spec, adapter, reference) if adapter is not None else None
    if endpoint is not None:
        report = _endpoint_eval(spec, endpoint, served_model, choices, concurrency, text, max_tokens, window,
                                min_agreement, max_perplexity_ratio, chosen)
        _write(report, json_path)
        check_thresholds(report)
        return
    report = run_eval(spec, ctx.workspace, text=text, max_tokens=max_tokens, window=window, threads=threads,
                      min_agreement=min_agreement, max_perplexity_ratio=max_perplexity_ratio, echo=click.echo,
                      adapter=chosen)
    m = report["model"]
    on = f" + LoRA adapter {adapter} (task {report['adapter']['task_id']})" if adapter is not None else ""
    click.echo(f"{m['architecture']} {m['dtype']} tp {m['tp']} x pp {m['pp']}{on}: {report['tokens_evaluated']} "
               f"tokens in {report['windows']} window(s) of {report['window']}")
    click.echo(f"  perplexity            {report['perplexity']:.4f}")
    merged = (" with the adapter merged by PEFT" if reference is None else f", {reference}") if adapter else ""
    click.echo(f"  reference perplexity  {report['reference_perplexity']:.4f}  (HF, float32{merged})")
    click.echo(f"  greedy agreement      {report['greedy_token_agreement']:.4%}")
    click.echo(f"  max |logit diff|      {report['max_abs_logit_diff']:.3g}")
    _write(report, json_path)
    check_thresholds(report)


def _endpoint_eval(spec: DeploymentSpec, endpoint: str, served_model: str | None, choices: Path | None,
                   concurrency: int, text: Path | None, max_tokens: int, window: int, min_agreement: float | None,
                   max_perplexity_ratio: float | None, adapter: AdapterEval | None = None) -> dict:
    from toolchain.eval.served import run_endpoint_eval  # torch, transformers

    # The spec's validation.quality bounds, with the command line's two over them.
    bounds = spec.validation.quality.bounds()
    given = {"min_greedy_agreement": min_agreement, "max_perplexity_ratio": max_perplexity_ratio}
    bounds.update({k: v for k, v in given.items() if v is not None})
    report = run_endpoint_eval(spec, endpoint, model=served_model, text=text, choices=choices, max_tokens=max_tokens,
                               window=window, concurrency=concurrency, bounds=bounds, echo=click.echo,
                               adapter=adapter)
    c = report["choices"]
    click.echo(f"{report['endpoint']} ({report['served_model']}): {report['tokens_evaluated']} tokens in "
               f"{report['windows']} window(s) of {report['window']}")
    click.echo(f"  perplexity            {report['perplexity']:.4f}")
    click.echo(f"  reference perplexity  {report['reference_perplexity']:.4f}  (HF, float32, the same tokens)")
    click.echo(f"  perplexity ratio      {report['perplexity_ratio']:.5f}")
    click.echo(f"  greedy agreement      {report['greedy_token_agreement']:.4%}")
    click.echo(f"  max |logprob diff|    {report['max_abs_logprob_diff']:.3g}")
    click.echo(f"  multiple choice       {c['accuracy']:.4f} (reference {c['reference_accuracy']:.4f}, "
               f"same pick {c['same_pick']:.2%}; {c['set']})")
    return report


def _write(report: dict, json_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
