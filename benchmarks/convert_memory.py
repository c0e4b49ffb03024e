"""Bounded-memory conversion: convert a generated Llama of at least 2 GB and
report peak RSS against the bound the issue sets (twice the largest layer's
bytes plus the rank file being written), and the time against a plain copy
of the same bytes.

The model is random (fp16, sharded safetensors with an index, written one
shard at a time); conversion runs in a child process whose peak RSS
(VmHWM) is read from /proc, with the RSS after imports (torch alone is a few
hundred MB) reported as the baseline.

With `--method awq` it also calibrates (random tokens) and quantizes, and the
bound adds one layer's AWQ statistics, the calibration activations and the
layer the HF model runs: calibration is streamed, so the second-moment
matrices of only one layer are alive at a time (all layers' would be
`awq_stats_bytes_all_layers`).

    python benchmarks/convert_memory.py [--json PATH] [--tp 2] [--layers 20] [--keep DIR] [--method awq]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from toolchain.bench.results import write_results

DIMS = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4,
        "vocab_size": 32000}
SHARD_BYTES = 512 << 20
CALIB = (8, 128)  # calibration samples x tokens for --method awq


def awq_search_bytes() -> int:
    """Working set of the AWQ search and GPTQ rounding on the costliest linear input, an estimate
    from the code: per input width I, the second moments in float64 twice (E[xxᵀ], the scaled copy)
    and float32 five times (the search's copy, the permuted one, three factorization steps),
    36·I² bytes; per weight block O x I, about six float32 temporaries, 24·O·I bytes."""
    h, i = DIMS["hidden_size"], DIMS["intermediate_size"]
    q = h + 2 * DIMS["num_key_value_heads"] * h // DIMS["num_attention_heads"]
    return max(36 * width * width + 24 * out * width for out, width in ((q, h), (h, h), (2 * i, h), (h, i)))


def awq_stats_bytes() -> int:
    """The in x in float64 second-moment matrices AWQ keeps per decoder layer (one per distinct linear input)."""
    h, i = DIMS["hidden_size"], DIMS["intermediate_size"]
    return 8 * (3 * h * h + i * i)


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, i, v = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"]
    kv = DIMS["num_key_value_heads"] * h // DIMS["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def nbytes(shape) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def generate(out: Path, layers: int) -> dict:
    """Write the random fp16 model shard by shard (the generator never holds more than one shard)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "num_hidden_layers": layers, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16", **DIMS}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map, size = {}, 0
    names = list(tensor_shapes(layers).items())

    def flush():
        idx = len(weight_map_files) + 1
        name = f"model-{idx:05d}.safetensors"
        save_file(shards[-1], str(out / name))
        for t in shards[-1]:
            weight_map[t] = name
        weight_map_files.append(name)
        shards[-1] = {}

    weight_map_files: list[str] = []
    for tname, shape in names:
        t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.float16) * 0.02
        shards[-1][tname] = t
        size += nbytes(shape)
        if sum(x.numel() * 2 for x in shards[-1].values()) >= SHARD_BYTES:
            flush()
    if shards[-1]:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                  "weight_map": weight_map}))
    return {"bytes": size, "shards": len(weight_map_files)}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(hf: str, out: str, tp: int, method: str = "none") -> None:
    """Runs in a fresh process: convert and print the memory figures as JSON. AWQ calibrates on
    random token sequences (the generated model has no tokenizer; memory does not depend on the text)."""
    from toolchain.checkpoint.convert import convert_checkpoint
    from toolchain.quant.view import Quantization

    recipe = Quantization(method=method, calibration_samples=CALIB[0], calibration_seq_len=CALIB[1])
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, DIMS["vocab_size"], (CALIB[1],), generator=g) for _ in range(CALIB[0])]
    baseline = _rss_kb("VmRSS")
    start = time.perf_counter()
    convert_checkpoint(hf, out, tp=tp, pp=1, dtype="float16", target="trtllm", quantization=recipe,
                       calibration=calib if method != "none" else None)
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline_rss": baseline * 1024, "peak_rss": _rss_kb("VmHWM") * 1024, "seconds": seconds}))


def largest_layer_bytes(layers: int) -> tuple[int, int]:
    shapes = tensor_shapes(layers)
    per_layer = sum(nbytes(s) for n, s in shapes.items() if n.startswith("model.layers.0."))
    largest_tensor = max(nbytes(s) for s in shapes.values())
    return max(per_layer, largest_tensor), per_layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--keep", type=Path, help="generate into / reuse this directory instead of a temporary one")
    ap.add_argument("--method", choices=("none", "awq"), default="none",
                    help="awq: calibrate and quantize too (use --layers 4: the search is slow on 2 cores)")
    ap.add_argument("--child", nargs=4, metavar=("HF", "OUT", "TP", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.child[3])
        return 0
    with tempfile.TemporaryDirectory(prefix="convert-memory-") as tmp:
        work = Path(tmp)
        hf = args.keep or work / "hf"
        if not (hf / "model.safetensors.index.json").is_file():
            start = time.perf_counter()
            info = generate(hf, args.layers)
            print(f"generated {info['bytes'] / 2**30:.2f} GiB in {info['shards']} shards "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
        src_bytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        copy_dir = work / "copy"
        copy_dir.mkdir()
        start = time.perf_counter()
        for f in hf.glob("*.safetensors"):
            shutil.copyfile(f, copy_dir / f.name)
        copy_s = time.perf_counter() - start
        shutil.rmtree(copy_dir)
        out = work / "ckpt"
        out.mkdir()
        proc = subprocess.run([sys.executable, __file__, "--child", str(hf), str(out), str(args.tp), args.method],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        rank_files = sorted(out.glob("rank*.safetensors"))
        largest_rank = max(p.stat().st_size for p in rank_files)
        largest_layer, per_layer = largest_layer_bytes(args.layers)
        bound = 2 * largest_layer + largest_rank
        if args.method == "awq":
            # plus one layer's statistics, the search's working set, the calibration activations
            # (fp32, two copies while a layer runs) and the fp32 copy of the layer the HF model runs
            acts = 2 * 4 * CALIB[0] * CALIB[1] * DIMS["hidden_size"]
            bound += awq_stats_bytes() + awq_search_bytes() + acts + 2 * per_layer
        used = got["peak_rss"] - got["baseline_rss"]
        result = {"model_bytes": src_bytes, "tp": args.tp, "method": args.method, "rank_file_bytes": largest_rank,
                  "awq_stats_bytes_per_layer": awq_stats_bytes() if args.method == "awq" else None,
                  "awq_stats_bytes_all_layers": awq_stats_bytes() * args.layers if args.method == "awq" else None,
                  "awq_search_bytes": awq_search_bytes() if args.method == "awq" else None,
                  "largest_layer_bytes": largest_layer, "decoder_layer_bytes": per_layer,
                  "baseline_rss": got["baseline_rss"], "peak_rss": got["peak_rss"], "conversion_rss": used,
                  "bound": bound, "within_bound": used <= bound, "peak_within_bound": got["peak_rss"] <= bound,
                  "convert_s": round(got["seconds"], 2), "copy_s": round(copy_s, 2),
                  "convert_vs_copy": round(got["seconds"] / copy_s, 2) if copy_s else None}
    mib = 2 ** 20
    print(f"model {result['model_bytes'] / mib:.0f} MiB -> {len(rank_files)} rank files of "
          f"{largest_rank / mib:.0f} MiB")
    extra = "" if args.method == "none" else " + AWQ calibration and search"
    print(f"peak RSS {result['peak_rss'] / mib:.0f} MiB (baseline after imports {result['baseline_rss'] / mib:.0f} "
          f"MiB, conversion {used / mib:.0f} MiB); bound 2 x {largest_layer / mib:.0f} + {largest_rank / mib:.0f}"
          f"{extra} = {bound / mib:.0f} MiB: {'within' if result['within_bound'] else 'OVER'}")
    if args.method == "awq":
        print(f"AWQ second moments: {awq_stats_bytes() / mib:.0f} MiB per layer, one layer alive at a time "
              f"(all {args.layers} layers: {awq_stats_bytes() * args.layers / mib:.0f} MiB)")
    print(f"convert {result['convert_s']}s vs plain copy {result['copy_s']}s ({result['convert_vs_copy']}x)")
    write_results(result, args.json)
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
