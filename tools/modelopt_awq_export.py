"""Where nvidia-modelopt's INT4_AWQ export of SmolLM2 loses quality: five readings of one calibration.

docs/quantization.md lists `peer:modelopt:INT4_AWQ@g64` at 41.33 perplexity (ModelOpt's own fake-quantized
model) but 46.70 when our CPU engine runs the TensorRT-LLM checkpoint it exported. This script measures, on
the same English windows and calibration as benchmarks/quantization.py:

1. ModelOpt's fake-quantized model before `export_tensorrt_llm_checkpoint` (the 41.33 reading);
2. the same model object after the export: the export rewrites it in place, giving q, k and v one
   averaged `pre_quant_scale` and requantizing their weights for it (modelopt/torch/export/layer_utils.py
   `build_attention_config` -> quant_utils.py `preprocess_linear_fusion`, `_update_pre_quant_scale`),
   because TensorRT-LLM's fused qkv is one `WeightOnlyGroupwiseQuantLinear` with one `pre_quant_scale`
   of shape (1, in) (NVIDIA/TensorRT-LLM tensorrt_llm/quantization/layers.py);
3. the exported rank0.safetensors read by a second reader, plain torch here (`dequantize_checkpoint`:
   unpack, times the per-group scale, the prequant vector folded into the input columns), run by
   transformers' LlamaForCausalLM in float32;
4. the same checkpoint on our CPU engine;
5. where the export's config.json leaves out the model's rope base (TensorRT-LLM then rotates with its
   default, 10000), the engine again with the model's own base written in.

If 2, 3 and 4 agree and sit above 1, the loss is the export's merge, not our reader. It also prints
how far each layer's own q, k and v AWQ vectors were from the average the export wrote.

ModelOpt is no dependency of the project: step 1-2 runs benchmarks/peers/run_peer.py in a Python that
has nvidia-modelopt 0.47 (`--peer-python`, default the benchmark's own benchmarks/.venv-peers/modelopt).
`--reuse DIR` takes a previous run's folder (export/, result.json, prequant.pt) instead.

    python tools/modelopt_awq_export.py [--json PATH] [--peer-python PY] [--reuse DIR] [--calib-samples 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# TensorRT-LLM checkpoint names -> Hugging Face Llama names (toolchain/archs: the llama map, written
# out here so this reader shares no code with the engine it checks).
LAYER_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
               "post_layernorm.weight": "post_attention_layernorm.weight",
               "attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj",
               "mlp.proj": "mlp.down_proj"}


def int4_values(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `pack_int4_in_uint8` bytes (out/2, in) -> signed int4 values (out, in): byte [j, k]
    holds row 2j in its low nibble and row 2j+1 in its high one (modelopt/torch/export/quant_utils.py)."""
    b = packed.view(torch.uint8).to(torch.int32)
    nibbles = torch.stack([b % 16, b // 16], dim=1)  # (out/2, 2, in): rows 2j, 2j+1
    signed = nibbles - 16 * (nibbles >= 8).to(torch.int32)
    return signed.reshape(-1, packed.shape[1]).float()


def dequantized_linear(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float32 (out, in) weight a W4A16_AWQ linear applies to its input: q · s per group of in,
    then the prequant vector, which TensorRT-LLM multiplies into the activation, folded into columns."""
    q = int4_values(t[f"{prefix}.weight"])
    scale = t[f"{prefix}.weights_scaling_factor"].float()  # (out, in/g)
    w = q * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)
    pre = t.get(f"{prefix}.prequant_scaling_factor")
    return w if pre is None else w * pre.float()[None, :]


def dequantize_checkpoint(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A TensorRT-LLM W4A16_AWQ Llama checkpoint (tp 1) -> (Hugging Face state dict in float32, its config)."""
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    t = load_file(str(ckpt / "rank0.safetensors"))
    heads, kv, head = config["num_attention_heads"], config["num_key_value_heads"], config["head_size"]
    sd = {"model.embed_tokens.weight": t["transformer.vocab_embedding.weight"].float(),
          "model.norm.weight": t["transformer.ln_f.weight"].float(),
          "lm_head.weight": t["lm_head.weight"].float()}
    for i in range(config["num_hidden_layers"]):
        src, dst = f"transformer.layers.{i}.", f"model.layers.{i}."
        q, k, v = dequantized_linear(t, src + "attention.qkv").split([heads * head, kv * head, kv * head])
        sd.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                   dst + "self_attn.v_proj.weight": v})
        for ours, theirs in LAYER_NAMES.items():
            if ours.endswith(".weight"):
                sd[dst + theirs] = t[src + ours].float()
            else:
                sd[dst + theirs + ".weight"] = dequantized_linear(t, src + ours)
    return sd, config


def hf_model(hf_dir: Path, state_dict: dict[str, torch.Tensor]):
    """`hf_dir`'s architecture in float32 (transformers) with `state_dict` loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config.tie_word_embeddings = False  # the export writes lm_head out, even where the source ties it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or missing:
        raise SystemExit(f"state dict does not fit {hf_dir}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def torch_perplexity(hf_dir: Path, state_dict: dict[str, torch.Tensor], windows: list[list[int]]) -> float:
    """Perplexity of `hf_dir`'s architecture with `state_dict` loaded, float32, run by transformers, scored
    by the peers' own loop (benchmarks/peers/run_peer.py), so it counts as ModelOpt's reading is counted."""
    sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
    from run_peer import perplexity

    return perplexity(hf_model(hf_dir, state_dict), windows)


def qkv_spread(prequant: dict[str, torch.Tensor]) -> list[dict]:
    """Per layer: how far q's, k's and v's own AWQ vectors lie from their mean (what the export wrote),
    as the largest and the mean |log2| ratio over input channels."""
    rows = []
    layers = sorted({int(n.split(".")[2]) for n in prequant if ".self_attn.q_proj" in n})
    for i in layers:
        own = [prequant[f"model.layers.{i}.self_attn.{p}_proj"].float() for p in "qkv"]
        mean = torch.stack(own).mean(0)
        ratio = torch.stack([(o / mean).log2().abs() for o in own])
        rows.append({"layer": i, "max_abs_log2_ratio": round(float(ratio.max()), 3),
                     "mean_abs_log2_ratio": round(float(ratio.mean()), 4)})
    return rows


def run_modelopt(run: Path, peer_python: Path, calib_samples: int, calib_len: int, windows: int) -> None:
    """Calibrate and export with ModelOpt (benchmarks/peers/run_peer.py) into `run`, on the benchmark's tokens."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import quantization as bench

    from toolchain.quant.calibration import calibration_tokens, hf_tokenizer

    hf = bench.SMOLLM2.resolve()
    tokenize = hf_tokenizer(hf)
    job = {"tool": "modelopt", "method": "INT4_AWQ@g64", "model_dir": str(hf), "tp": 1,
           "calib": [c.tolist() for c in calibration_tokens(tokenize, "builtin", calib_samples, calib_len)],
           "eval": bench.text_windows(tokenize, bench.english_text(), windows, 256),
           "out_dir": str(run / "export"), "after_export": True, "prequant_path": str(run / "prequant.pt")}
    (run / "job.json").write_text(json.dumps(job))
    subprocess.run([str(peer_python), str(bench.PEER_SCRIPT), str(run / "job.json"), str(run / "result.json")],
                   check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def engine_perplexity(ckpt: Path, out: Path, windows: list[list[int]]) -> float:
    """Perplexity of the TensorRT-LLM checkpoint `ckpt` on our CPU engine (built into `out`)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import quantization as bench

    from toolchain.engine.cpu import CpuEngine

    shutil.rmtree(out, ignore_errors=True)  # a rerun's engine links the same rank files
    engine = CpuEngine.load(bench.engine_dir(ckpt, out, 256 + 80), num_threads=1)
    try:
        scores, _ = bench.engine_scores(engine, windows, None)
    finally:
        engine.close()
    return scores["perplexity"]


def hf_rope_base(hf_dir: Path) -> float:
    """The rope base the Hugging Face model was trained with (transformers 5 keeps it in rope_parameters)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def with_rope_base(ckpt: Path, out: Path, base: float) -> Path:
    """A copy of checkpoint `ckpt` whose config.json names `base` as rotary_base (the weights linked)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((ckpt / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rotary_base": base}, indent=1))
    for f in ckpt.glob("rank*.safetensors"):
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return out


def measure(run: Path) -> dict:
    """The readings of `run` (a folder run_modelopt filled): the four above, and where the export's
    config.json leaves out a rope base the model does not share with TensorRT-LLM's default (10000: LLaMAConfig
    `rotary_base: float = 10000.0`, tensorrt_llm/models/llama/config.py), the engine once more with the model's
    own base written in. ModelOpt writes rotary_base only when its config map finds one
    (modelopt/torch/export/tensorrt_llm_utils.py; hf_config_map.py reads `rope_theta` off the HF config
    object, which transformers 5 moved into rope_parameters)."""
    job, peer = json.loads((run / "job.json").read_text()), json.loads((run / "result.json").read_text())
    windows, hf = job["eval"], Path(job["model_dir"])
    sd, config = dequantize_checkpoint(run / "export")
    trained_base = hf_rope_base(hf)
    out = {"model": hf.name, "calib_samples": len(job["calib"]), "eval_tokens": sum(len(w) - 1 for w in windows),
           "modelopt_fake_quant_before_export": round(peer["perplexity"], 4),
           "modelopt_fake_quant_after_export": round(peer["perplexity_after_export"], 4),
           "plain_torch_dequant_of_export": round(torch_perplexity(hf, sd, windows), 4),
           "cpu_engine_on_export": engine_perplexity(run / "export", run / "engine", windows),
           "export_rotary_base": config.get("rotary_base"), "hf_rope_theta": trained_base}
    if float(config.get("rotary_base") or 10000.0) != trained_base:
        fixed = with_rope_base(run / "export", run / "export-rope", trained_base)
        out["cpu_engine_on_export_with_hf_rope_base"] = engine_perplexity(fixed, run / "engine-rope", windows)
    if (run / "prequant.pt").is_file():
        spread = qkv_spread(torch.load(run / "prequant.pt"))
        out["qkv_prequant_spread"] = spread
        out["qkv_prequant_spread_max"] = max(r["max_abs_log2_ratio"] for r in spread)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the readings here")
    ap.add_argument("--reuse", type=Path, help="run in this folder, or read the run already there "
                    "(job.json, result.json, export/, prequant.pt)")
    ap.add_argument("--peer-python", type=Path, default=REPO / "benchmarks" / ".venv-peers" / "modelopt" / "bin" / "python")
    ap.add_argument("--calib-samples", type=int, default=32, help="calibration sequences (the benchmark's: 32)")
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=16, help="windows of 256 tokens of English (benchmark: 16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="modelopt-awq-") as tmp:
        run = args.reuse or Path(tmp)
        run.mkdir(parents=True, exist_ok=True)
        if not (run / "result.json").is_file():
            if not args.peer_python.is_file():
                raise SystemExit(f"no ModelOpt python at {args.peer_python}: run benchmarks/quantization.py once "
                                 "(it makes that environment) or pass --peer-python")
            run_modelopt(run, args.peer_python, args.calib_samples, args.calib_seq_len, args.eval_windows)
        result = measure(run)
    for key, value in result.items():
        if key != "qkv_prequant_spread":
            print(f"{key:<36} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
