"""`toolchain eval SPEC`: held-out perplexity and greedy-token agreement of the
converted model against the original Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import click

from toolchain.cli._common import Context, spec_command
from toolchain.spec import DeploymentSpec


@click.command(help="Run the converted model (CPU engine, every rank) and the original HF model on held-out "
                    "text; report both perplexities and their greedy-token agreement.")
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
def command(ctx: Context, spec: DeploymentSpec, json_path: Path | None, text: Path | None, max_tokens: int,
            window: int, threads: int | None, min_agreement: float | None,
            max_perplexity_ratio: float | None) -> None:
    from toolchain.eval.run import check_thresholds, run_eval  # keep `toolchain --help` light

    report = run_eval(spec, ctx.workspace, text=text, max_tokens=max_tokens, window=window, threads=threads,
                      min_agreement=min_agreement, max_perplexity_ratio=max_perplexity_ratio, echo=click.echo)
    m = report["model"]
    click.echo(f"{m['architecture']} {m['dtype']} tp {m['tp']} x pp {m['pp']}: {report['tokens_evaluated']} tokens "
               f"in {report['windows']} window(s) of {report['window']}")
    click.echo(f"  perplexity            {report['perplexity']:.4f}")
    click.echo(f"  reference perplexity  {report['reference_perplexity']:.4f}  (HF, float32)")
    click.echo(f"  greedy agreement      {report['greedy_token_agreement']:.4%}")
    click.echo(f"  max |logit diff|      {report['max_abs_logit_diff']:.3g}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    check_thresholds(report)
