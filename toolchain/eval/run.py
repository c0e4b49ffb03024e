"""`run_eval`: build (or reuse) the spec's engine, run it with the CPU engine
rank by rank, and compare it with the original Hugging Face model.

Target `cpu` evaluates the built engine directory. Target `trtllm` engines
only run on a GPU, so there the converted checkpoint (the exact rank files
trtllm-build consumes) is evaluated through a CPU engine view of it. Target
`llmapi-cpu` evaluates the engine its `convert` prepares for the LLM() stand-in
(llmapi/cpu_llm.py prepare_engine), the one its servers load. With an adapter (adapters.py) both sides run it:
the engine under its LoRA task id, the reference with it merged by PEFT.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from toolchain.errors import StageFailed, ToolchainError
from toolchain.eval.metrics import evaluate
from toolchain.eval.texts import STREAM_FACTOR, default_documents, file_documents, token_stream, token_windows
from toolchain.spec import DeploymentSpec
from toolchain.targets import CPU_ENGINE, CPU_STAND_IN, target_of
from toolchain.workspace import Workspace
from toolchain.engine.build import build_config, with_lora, write_cpu_engine
from toolchain.eval.adapters import AdapterEval, load_adapter
from toolchain.remote_code import auto_tokenizer
from toolchain.engine.build import run_build
from toolchain.llmapi.args import llm_args
from toolchain.llmapi.cpu_llm import LlmArgsError, prepare_engine
from toolchain.llmapi.stage import run_convert_llmapi, served_model_dir

DEFAULT_MAX_TOKENS = 4096
DEFAULT_WINDOW = 256


@contextmanager
def engine_for_eval(spec: DeploymentSpec, workspace: Workspace) -> Iterator[Path]:
    """A directory the CPU engine can load for `spec`, building what is missing: the engine itself where the
    target's builder is the CPU engine, else a CPU-engine view of the converted checkpoint."""
    if target_of(spec).engine_builder == CPU_ENGINE:

        run_build(spec, workspace)
        yield workspace.engine_dir(spec)
        return
    if target_of(spec).llm_runtime == CPU_STAND_IN:
        yield _stand_in_engine(spec, workspace)
        return
    from toolchain.checkpoint.stage import run_convert

    run_convert(spec, workspace)
    checkpoint = workspace.checkpoint_dir(spec)
    with tempfile.TemporaryDirectory(prefix="toolchain-eval-") as tmp:
        view = Path(tmp)
        write_cpu_engine(checkpoint, view, with_lora(build_config(spec), spec, checkpoint), version="eval-view")
        yield view


def _stand_in_engine(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """The CPU engine LLM()'s stand-in loads for an llmapi-cpu spec: the LLM-API path's convert (its layout and
    quantization checks, then the engine prepared in workspace.cpu_llm_dir) and the directory it prepared, found
    current there, so eval runs exactly what the deployment's servers run."""
    run_convert_llmapi(spec, workspace)
    try:
        inner, inner_ws = prepare_engine(llm_args(spec, served_model_dir(spec, workspace)), workspace.cpu_llm_dir(spec))
    except LlmArgsError as err:  # run_convert_llmapi has already refused what LLM() refuses; kept one line anyway
        raise ToolchainError(str(err), "fix the spec so LLM() accepts its arguments") from None
    return inner_ws.engine_dir(inner)


def spec_tokenizer(spec: DeploymentSpec):
    try:
        return auto_tokenizer(spec.model.tokenizer_dir, trust_remote_code=spec.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ToolchainError(f"cannot load a tokenizer from {spec.model.tokenizer_dir}: {str(err).splitlines()[0]}",
                             "set model.tokenizer to a directory with tokenizer.json / tokenizer_config.json") from None


def hf_reference(spec: DeploymentSpec, adapter: AdapterEval | None = None) -> Callable[[list[int]], torch.Tensor]:
    """The HF model's logits function at float32: the spec's checkpoint, with `adapter` merged into it by PEFT
    (or its --reference checkpoint instead)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # No progress bar: the command's output stays its own report lines.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # float32 whatever the stored dtype: the reference is the HF weights, computed exactly.
        # safetensors only (a pytorch_model.bin is a pickle that runs code when loaded); the model's own
        # code only when the spec trusts it.
        checkpoint = adapter.reference if adapter is not None and adapter.reference is not None \
            else spec.model.checkpoint
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, use_safetensors=True,
                                                     trust_remote_code=spec.model.trust_remote_code).eval()
        if adapter is not None and adapter.reference is None:
            from peft import PeftModel

            # An adapter directory holds no code; remote code stays off as for every load here.
            peft = PeftModel.from_pretrained(model, adapter.info.path, trust_remote_code=False)
            model = peft.merge_and_unload().eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return lambda ids: model(torch.tensor([ids])).logits[0].float()


def run_eval(spec: DeploymentSpec, workspace: Workspace, *, text: Path | None = None,
             max_tokens: int = DEFAULT_MAX_TOKENS, window: int = DEFAULT_WINDOW, threads: int | None = None,
             min_agreement: float | None = None, max_perplexity_ratio: float | None = None,
             echo: Callable[[str], None] | None = None, adapter: AdapterEval | None = None) -> dict:
    """Evaluate the spec's converted model against its HF checkpoint; returns the report dict.
    Raises StageFailed (after computing the report) when a given threshold is missed."""
    from toolchain.engine.cpu import CpuEngine

    say = echo or (lambda _msg: None)
    row = target_of(spec)
    if row.engine_builder is None and row.llm_runtime != CPU_STAND_IN:
        # The GPU's PyTorch backend runs only there; its CPU stand-in runs the same arguments here.
        raise ToolchainError(f"toolchain eval runs the model on this host's CPU engine, and target {spec.target} "
                             "runs it in TensorRT-LLM's PyTorch backend on a GPU", "evaluate it through LLM()'s CPU "
                             "stand-in: `toolchain eval SPEC --set target=llmapi-cpu`")
    if max_tokens < 2:
        raise ToolchainError(f"max_tokens {max_tokens} is too small", "use --max-tokens 2 or more")
    start = time.monotonic()
    description, documents = file_documents(text) if text is not None else default_documents()
    tokenizer = spec_tokenizer(spec)
    stream = token_stream(tokenizer, documents, STREAM_FACTOR * max_tokens)
    task = None
    with engine_for_eval(spec, workspace) as engine_dir:
        engine = CpuEngine.load(engine_dir, num_threads=threads,
                                lora_host_bytes=spec.lora.cache.host_memory_bytes if spec.lora.enabled else None)
    if adapter is not None:
        task = load_adapter(engine, spec, workspace, adapter)
    window = min(window, engine.limits.max_seq_len)
    bad = [t for t in stream if not 0 <= t < engine.vocab_size]
    if bad:
        raise ToolchainError(f"the tokenizer produced id {bad[0]} outside the model's vocabulary "
                             f"[0, {engine.vocab_size})", "set model.tokenizer to the model's own tokenizer")
    windows = token_windows(stream, window, max_tokens)
    say(f"evaluating {sum(map(len, windows))} of {len(stream)} tokens in {len(windows)} window(s) of {window} "
        f"({description})")
    report = evaluate(lambda ids: engine.forward_logits(ids, lora_task_id=task), hf_reference(spec, adapter), windows)
    pretrained = engine.config["pretrained_config"]
    report.update({
        "text": description,
        "window": window,
        "max_tokens": max_tokens,
        "model": {"checkpoint": str(spec.model.checkpoint), "architecture": pretrained["architecture"],
                  "dtype": pretrained["dtype"], "tp": engine.dims.tp, "pp": engine.dims.pp,
                  "quantization": pretrained.get("quantization")},
        "seconds": round(time.monotonic() - start, 2),
    })
    if adapter is not None:
        report["adapter"] = adapter.describe()
    missed = []
    if min_agreement is not None and report["greedy_token_agreement"] < min_agreement:
        missed.append(f"greedy_token_agreement {report['greedy_token_agreement']} < {min_agreement}")
    if max_perplexity_ratio is not None and report["perplexity_ratio"] > max_perplexity_ratio:
        missed.append(f"perplexity_ratio {report['perplexity_ratio']} > {max_perplexity_ratio}")
    report["passed"] = not missed
    if missed:
        report["missed"] = missed
    return report


def check_thresholds(report: dict) -> None:
    """Raise StageFailed naming every threshold `report` missed."""
    if not report.get("passed", True):
        raise StageFailed("eval thresholds missed: " + "; ".join(report["missed"]),
                          "compare the converted model's layout and dtype with the reference")
