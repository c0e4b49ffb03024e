"""Record NVIDIA ModelOpt's own Hugging Face-format FP8 export of tiny mixture-of-experts models as golden layouts.

What it writes (one JSON per model, beside the dense ones' format in /work/shared/reference/layouts-hf/README.md):
the HF config the model was built from, the exported config.json and hf_quant_config.json, the files written and
every tensor's shape and safetensors dtype. tests/test_moe_quant.py compares the project's own export
(toolchain/checkpoint/hf_quant.py) of the same config with it. Tests never run this script: it needs ModelOpt,
which the project does not depend on. Run it in a throwaway environment outside the repository:

    python -m venv /tmp/mo && /tmp/mo/bin/pip install nvidia-modelopt==0.47.0 "transformers==5.14.*" \\
        torch==2.13.0 safetensors accelerate
    /tmp/mo/bin/python tools/modelopt_moe_layouts.py tests/data/layouts-hf-moe

Each model is built random in float32 from its config, saved and loaded back in float16 (as the dense golden
layouts were), quantized with `mtq.FP8_DEFAULT_CFG` as shipped (lm_head and routers unquantized), calibrated on 16 random
sequences of 128 tokens, and exported with `export_hf_checkpoint` on the CPU.

It also tries what the issue reports failing, and records the outcome in `attempts.json`:
`export_tensorrt_llm_checkpoint` of the FP8 model, and INT4 AWQ (`mtq.INT4_AWQ_CFG`) calibration and export.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

SAFETENSORS_DTYPE = {"torch.float16": "F16", "torch.float32": "F32", "torch.bfloat16": "BF16", "torch.int8": "I8",
                     "torch.uint8": "U8", "torch.float8_e4m3fn": "F8_E4M3"}
# The tiny models: the sizes of tests/conftest.py TINY_DIMS, 4 experts of which each token takes 2.
BASE = dict(vocab_size=250, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(BASE, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(BASE, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       head_dim=32, norm_topk_prob=True)),
}
CALIB_SAMPLES, CALIB_LEN = 16, 128


def build(name: str, where: Path):
    """The model of `name`, saved in float32 and loaded back in float16; (model, the config it was built from)."""
    import torch
    import transformers

    config_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    getattr(transformers, model_cls)(config).eval().save_pretrained(where)
    source = json.loads((where / "config.json").read_text())
    model = getattr(transformers, model_cls).from_pretrained(where, dtype=torch.float16).eval()
    return model, source


def calibrate(model) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(CALIB_SAMPLES):
            model(torch.randint(0, model.config.vocab_size, (1, CALIB_LEN), generator=g))


def quantize(model, cfg_name: str):
    """The config as ModelOpt ships it: its quant_cfg list already disables "*lm_head*", the routers
    ("*block_sparse_moe.gate*", "*mlp.gate.*", "*router*") and "*mlp.shared_expert_gate.*"."""
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, getattr(mtq, cfg_name), forward_loop=calibrate)


def layout(export_dir: Path) -> dict:
    from safetensors import safe_open

    tensors = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():
                t = fh.get_tensor(n)
                tensors[n] = [list(t.shape), SAFETENSORS_DTYPE[str(t.dtype)]]
    return {"exported_config": json.loads((export_dir / "config.json").read_text()),
            "hf_quant_config": json.loads((export_dir / "hf_quant_config.json").read_text()),
            "files": sorted(p.name for p in export_dir.iterdir()),
            "tensors": dict(sorted(tensors.items()))}


def attempt(what: str, fn) -> dict:
    try:
        fn()
        return {"what": what, "ok": True}
    except Exception as err:  # recorded, not raised: these are the failures the issue reports
        return {"what": what, "ok": False, "error": f"{type(err).__name__}: {err}",
                "where": traceback.format_exc().strip().splitlines()[-3:]}


def main(out: Path) -> None:
    import modelopt
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    versions = {"modelopt": modelopt.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    attempts = []
    for name, (_, arch, _) in MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            model, source = build(name, tmp_path / "hf")
            model = quantize(model, "FP8_DEFAULT_CFG")
            with torch.inference_mode():
                export_hf_checkpoint(model, export_dir=tmp_path / "fp8")
            record = {"source": f"nvidia-modelopt {versions['modelopt']} export_hf_checkpoint, FP8_DEFAULT_CFG "
                                f"(float16, lm_head unquantized, {CALIB_SAMPLES} x {CALIB_LEN} random tokens); "
                                f"transformers {versions['transformers']}, torch {versions['torch']}",
                      "hf_architecture": arch, "hf_config": source, "format": "fp8", **layout(tmp_path / "fp8")}
            (out / f"{name}-fp8.json").write_text(json.dumps(record, indent=1) + "\n")
            attempts.append({"model": name, **attempt(
                "export_tensorrt_llm_checkpoint (FP8)",
                lambda m=model, d=tmp_path / "trtllm": export_tensorrt_llm_checkpoint(
                    m, "llama", torch.float16, export_dir=d, inference_tensor_parallel=1))})
            awq_model, _ = build(name, tmp_path / "hf-awq")
            attempts.append({"model": name, **attempt(
                "INT4_AWQ_CFG calibration and export_hf_checkpoint",
                lambda m=awq_model, d=tmp_path / "awq": export_hf_checkpoint(quantize(m, "INT4_AWQ_CFG"),
                                                                             export_dir=d))})
    (out / "attempts.json").write_text(json.dumps({"versions": versions, "attempts": attempts}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/layouts-hf-moe"))
