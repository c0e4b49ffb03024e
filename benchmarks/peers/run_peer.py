"""Runs inside a peer quantizer's own virtual environment (never imported by the
project): quantize a Hugging Face model with nvidia-modelopt or llmcompressor
on CPU, then report held-out perplexity of the peer's own (fake-quantized)
model and the bytes of what it exports.

Usage: python run_peer.py JOB.json RESULT.json, where JOB holds
{"tool", "method", "model_dir", "calib": [[ids]], "eval": [[ids]], "out_dir", "tp"}.
The token ids come from the benchmark, so every tool sees the same
calibration and evaluation tokens as the toolchain.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path

import torch


def perplexity(model, windows, logp_path: str | None = None) -> float:
    """Held-out perplexity; with `logp_path`, the next-token log-probabilities are
    saved there too (bf16), for the benchmark's KL against its fp16 row."""
    nll, count, logps = 0.0, 0, []
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
            nll -= float(logp.gather(1, x[0, 1:, None]).sum())
            count += len(ids) - 1
            if logp_path:
                logps.append(logp.to(torch.bfloat16))
    if logp_path:
        torch.save(logps, logp_path)
    return math.exp(nll / count)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*.safetensors"))


def run_modelopt(job, model) -> dict:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    # "INT4_AWQ@g64": modelopt's INT4_AWQ with 64-weight blocks (its default is 128), for models whose
    # hidden size is not a multiple of 128 (SmolLM2-135M: 576).
    method, _, group = job["method"].partition("@g")
    cfg = copy.deepcopy({"INT4_AWQ": mtq.INT4_AWQ_CFG, "INT8_SMOOTHQUANT": mtq.INT8_SMOOTHQUANT_CFG,
                         "FP8": mtq.FP8_DEFAULT_CFG, "INT8_DEFAULT": mtq.INT8_DEFAULT_CFG}[method])
    if group:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                entry["cfg"]["block_sizes"][-1] = int(group)

    def loop(m):
        for ids in job["calib"]:
            m(torch.tensor([ids]))

    start = time.perf_counter()
    with torch.no_grad():
        model = mtq.quantize(model, cfg, loop)
    quant_s = time.perf_counter() - start
    ppl = perplexity(model, job["eval"])
    if job.get("prequant_path"):  # each linear's own AWQ scales, before the export merges any of them
        torch.save({name: m.input_quantizer.pre_quant_scale.detach().clone() for name, m in model.named_modules()
                    if getattr(getattr(m, "input_quantizer", None), "pre_quant_scale", None) is not None},
                   job["prequant_path"])
    start = time.perf_counter()
    export_tensorrt_llm_checkpoint(model, "llama", dtype=torch.float16, export_dir=job["out_dir"],
                                   inference_tensor_parallel=job.get("tp", 1))
    result = {"perplexity": ppl, "convert_s": quant_s + time.perf_counter() - start,
              "bytes": dir_bytes(Path(job["out_dir"])), "format": "tensorrt_llm_checkpoint"}
    if job.get("after_export"):
        # The export rewrites the model in place: one averaged pre_quant_scale for q, k and v
        # (modelopt/torch/export/quant_utils.py preprocess_linear_fusion), weights rescaled and
        # requantized. Its own fake-quantized model after that is what the checkpoint holds.
        result["perplexity_after_export"] = perplexity(model, job["eval"])
    return result


def run_llmcompressor(job, model) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    # AWQ pins its activation cache to accelerator memory; on a CPU-only host that raises
    # (llmcompressor src/llmcompressor/pipelines/cache.py, IntermediatesCache).
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
    calib = job["calib"]
    ds = Dataset.from_dict({"input_ids": calib, "attention_mask": [[1] * len(c) for c in calib]})
    # "AWQ": scales and clipping, then round to nearest; "AWQ+GPTQ": the same scales, then GPTQ's
    # error-compensating rounding (llmcompressor's documented chaining of the two modifiers).
    quantizer = {"AWQ": QuantizationModifier, "AWQ+GPTQ": GPTQModifier}[job["method"]]
    recipe = [AWQModifier(duo_scaling=True), quantizer(ignore=["lm_head"], scheme="W4A16_ASYM", targets=["Linear"])]
    start = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=max(len(c) for c in calib),
            num_calibration_samples=len(calib))
    quant_s = time.perf_counter() - start
    ppl = perplexity(model, job["eval"], job.get("logp_path"))
    start = time.perf_counter()
    model.save_pretrained(job["out_dir"], save_compressed=True)
    return {"perplexity": ppl, "convert_s": quant_s + time.perf_counter() - start,
            "bytes": dir_bytes(Path(job["out_dir"])), "format": "compressed-tensors"}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    runner = {"modelopt": run_modelopt, "llmcompressor": run_llmcompressor}[job["tool"]]
    result = runner(job, model)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
