"""`toolchain eval SPEC --endpoint URL`, and deploy's quality gate: a running deployment measured through its
OpenAI-compatible /v1/completions against the HF reference (float32, the spec's checkpoint) computed here on the
same tokens.

- Held-out text (texts.py's windows) goes out as token-id prompts with echo; the endpoint's prompt log-probs give
  its perplexity, the reference's logits give the reference perplexity on exactly those tokens, and greedy
  agreement is the share of positions where the endpoint's top-1 token is the reference's argmax (metrics.py's
  definitions, which the CPU-engine eval reports too).
- The multiple-choice set (choices.py) is scored on both by summed continuation log-probability.

The endpoint is a black box here: what it runs (engine, dtype, quantization, GPU or CPU) is what is measured.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from toolchain.errors import ToolchainError
from toolchain.eval import choices as mc
from toolchain.eval.adapters import AdapterEval
from toolchain.eval.endpoint import Echoed, Endpoint, Rendering
from toolchain.eval.run import DEFAULT_MAX_TOKENS, DEFAULT_WINDOW, hf_reference, spec_tokenizer
from toolchain.eval.texts import STREAM_FACTOR, default_documents, file_documents, token_stream, token_windows
from toolchain.spec import DeploymentSpec
from toolchain.spec_workload import QualitySection

DEFAULT_CONCURRENCY = 4


def run_endpoint_eval(spec: DeploymentSpec, url: str, *, model: str | None = None, text: Path | None = None,
                      choices: Path | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                      window: int = DEFAULT_WINDOW, concurrency: int = DEFAULT_CONCURRENCY,
                      bounds: dict[str, float] | None = None, echo: Callable[[str], None] | None = None,
                      adapter: AdapterEval | None = None) -> dict:
    """Measure the deployment at `url` against the spec's HF checkpoint; the report dict, with `passed` and the
    `missed` bounds (QualitySection field names) when `bounds` are given. With `adapter`, the endpoint's model
    defaults to the adapter's name (this project's OpenAI server selects adapters by `model`) and the reference
    is the merged model."""
    if adapter is not None and model is None:
        model = adapter.info.name
    say = echo or (lambda _msg: None)
    if max_tokens < 2:
        raise ToolchainError(f"max_tokens {max_tokens} is too small", "use --max-tokens 2 or more")
    start = time.monotonic()
    endpoint = Endpoint(url, model)  # reachable, and its model known, before the reference loads
    description, documents = file_documents(text) if text is not None else default_documents()
    tokenizer = spec_tokenizer(spec)
    # The prompt is bounded by the server's max_input_len (the spec's, for a deployment of this spec) and
    # one token is generated after it.
    window = min(window, spec.limits.max_input_len)
    windows = token_windows(token_stream(tokenizer, documents, STREAM_FACTOR * max_tokens), window, max_tokens)
    choice_set, items = mc.load_items(choices)
    pairs = mc.pairs(tokenizer, items)
    prompts = windows + [head + tail for item in pairs for head, tail in item]
    if max(map(len, prompts)) > spec.limits.max_input_len:
        raise ToolchainError(f"a multiple-choice prompt has {max(map(len, prompts))} tokens, more than "
                             f"limits.max_input_len {spec.limits.max_input_len}", "pass --choices with shorter items")
    say(f"sending {len(windows)} window(s) of up to {window} tokens ({description}) and {len(prompts) - len(windows)} "
        f"multiple-choice prompts ({choice_set}) to {endpoint.url} (model {endpoint.model})")
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        echoed = list(pool.map(endpoint.echo, prompts))
    say("computing the HF reference (float32) on the same tokens")
    reference = _log_softmax(hf_reference(spec, adapter), prompts)
    rendering = Rendering(tokenizer)
    for ids, got in zip(prompts, echoed, strict=True):
        rendering.learn(ids, got)
    report = _text_figures(windows, echoed[:len(windows)], reference[:len(windows)], rendering)
    report["choices"] = _choice_figures(items, pairs, echoed[len(windows):], reference[len(windows):], choice_set)
    report.update({"endpoint": endpoint.url, "served_model": endpoint.model, "text": description, "window": window,
                   "max_tokens": max_tokens, "token_names": rendering.name,
                   "reference": {"checkpoint": str(spec.model.checkpoint), "dtype": "float32"},
                   **({"adapter": adapter.describe()} if adapter is not None else {}),
                   "seconds": round(time.monotonic() - start, 2)})
    return judge(report, bounds or {})


def _log_softmax(reference: Callable[[list[int]], torch.Tensor], prompts: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = reference(ids)
            if max(ids) >= logits.shape[-1]:
                raise ToolchainError(f"the tokenizer produced id {max(ids)} outside the model's vocabulary "
                                     f"[0, {logits.shape[-1]})", "set model.tokenizer to the model's own tokenizer")
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


def _text_figures(windows: list[list[int]], echoed: list[Echoed], reference: list[torch.Tensor],
                  name: Rendering) -> dict:
    tokens = agree = hits = ref_hits = 0
    nll = ref_nll = worst = 0.0
    for ids, got, ref in zip(windows, echoed, reference, strict=True):
        target = torch.tensor(ids[1:], dtype=torch.int64)
        ref_lp = ref[:-1].gather(1, target[:, None])[:, 0]
        ref_pick = ref[:-1].argmax(-1)
        lp = torch.tensor(got.logprobs[1:], dtype=torch.float64)
        nll -= float(lp.sum())
        ref_nll -= float(ref_lp.double().sum())
        worst = max(worst, float((lp - ref_lp.double()).abs().max()))
        for t, top in enumerate(got.top[1:]):
            assert top is not None
            agree += int(top[0] == name(int(ref_pick[t])))
            hits += int(top[0] == got.tokens[t + 1])
        ref_hits += int((ref_pick == target).sum())
        tokens += len(target)
    ppl, ref_ppl = math.exp(nll / tokens), math.exp(ref_nll / tokens)
    return {"perplexity": round(ppl, 4), "reference_perplexity": round(ref_ppl, 4),
            "perplexity_ratio": round(ppl / ref_ppl, 5), "greedy_token_agreement": round(agree / tokens, 5),
            "top1_accuracy": round(hits / tokens, 5), "reference_top1_accuracy": round(ref_hits / tokens, 5),
            "max_abs_logprob_diff": float(f"{worst:.4g}"), "tokens_evaluated": tokens, "windows": len(windows)}


def _choice_figures(items: list[mc.Item], pairs, echoed: list[Echoed], reference: list[torch.Tensor],
                    choice_set: str) -> dict:
    scores: list[list[float]] = []
    ref_scores: list[list[float]] = []
    flat = iter(zip(echoed, reference, strict=True))
    for item in pairs:
        scores.append([])
        ref_scores.append([])
        for head, tail in item:
            got, ref = next(flat)
            n = len(head)
            scores[-1].append(sum(v for v in got.logprobs[n:] if v is not None))
            target = torch.tensor(tail, dtype=torch.int64)
            ref_scores[-1].append(float(ref[n - 1:-1].gather(1, target[:, None]).double().sum()))
    picks, ref_picks = mc.picks(scores), mc.picks(ref_scores)
    return {"set": choice_set, "items": len(items), "accuracy": round(mc.accuracy(items, picks), 5),
            "reference_accuracy": round(mc.accuracy(items, ref_picks), 5),
            "same_pick": round(sum(int(a == b) for a, b in zip(picks, ref_picks, strict=True)) / len(items), 5)}


# The figure each QualitySection bound reads, and whether a value above (max) or below (min) it misses.
_BOUNDS = {
    "max_perplexity_ratio": (lambda r: r["perplexity_ratio"], ">"),
    "min_greedy_agreement": (lambda r: r["greedy_token_agreement"], "<"),
    "min_choice_accuracy": (lambda r: r["choices"]["accuracy"], "<"),
    "max_choice_accuracy_drop": (lambda r: round(r["choices"]["reference_accuracy"] - r["choices"]["accuracy"], 5),
                                 ">"),
}


def judge(report: dict, bounds: dict[str, float]) -> dict:
    """`report` with `bounds` (QualitySection field names), `passed` and the `missed` ones, each as one phrase."""
    missed = []
    for name, bound in bounds.items():
        value = _BOUNDS[name][0](report)
        if (value > bound) if _BOUNDS[name][1] == ">" else (value < bound):
            figure = name.split("_", 1)[1]
            missed.append(f"{figure} {value} {_BOUNDS[name][1]} {bound} ({name})")
    report.update({"bounds": bounds, "passed": not missed})
    if missed:
        report["missed"] = missed
    return report


def deploy_quality(spec: DeploymentSpec, url: str, model: str, echo: Callable[[str], None] | None = None) -> dict:
    """Deploy's gate: the endpoint eval at the spec's validation.quality settings and bounds."""
    quality: QualitySection = spec.validation.quality
    return run_endpoint_eval(spec, url, model=model, max_tokens=quality.tokens, window=quality.window,
                             bounds=quality.bounds(), echo=echo)
