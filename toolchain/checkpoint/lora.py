"""Hugging Face PEFT LoRA adapters in TensorRT-LLM's converted LoRA format.

The engine path's adapter is what NVIDIA/TensorRT-LLM `examples/hf_lora_convert.py` (@05316d33,
`convert_hf_model`) writes and the Triton backend loads (`lora_weights` / `lora_config` inputs,
`lora_prefetch_dir`): `model.lora_weights.npy` [1, rows, W] in the storage dtype and `model.lora_config.npy`
[1, rows, 3] int32, one row per (layer, module) holding (module_id, layer_idx, rank). A weights row is
lora_A [r, in] flattened, then lora_B [out, r] times the PEFT scale flattened, zero-padded to the longest row.
The files are the whole, unsharded adapter: each TP rank cuts its own part when it copies the adapter into its
cache (`LoraCache::copyToPages`, cpp/tensorrt_llm/runtime/loraCache.cpp @063e02f7), which `shard` mirrors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors.torch import load_file

from toolchain.errors import ToolchainError

WEIGHTS_FILE = "model.lora_weights.npy"
CONFIG_FILE = "model.lora_config.npy"
ADAPTER_CONFIG = "adapter_config.json"  # peft/utils/constants.py CONFIG_NAME
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft/utils/constants.py SAFETENSORS_WEIGHTS_NAME

# tensorrt_llm/lora_manager.py @007e181b `LoraManager.LORA_MODULE_IDS` (= loraModule.h `ModuleType`).
LORA_MODULE_IDS = {
    "attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5, "mlp_4h_to_h": 6,
    "mlp_gate": 7, "cross_attn_qkv": 8, "cross_attn_q": 9, "cross_attn_k": 10, "cross_attn_v": 11,
    "cross_attn_dense": 12, "moe_h_to_4h": 13, "moe_4h_to_h": 14, "moe_gate": 15, "moe_router": 16,
    "mlp_router": 17, "mlp_gate_up": 18,
}
MODULE_NAMES = {module_id: name for name, module_id in LORA_MODULE_IDS.items()}

# HF module -> TRT-LLM LoRA module for Llama-style decoders: the inverse of
# `get_default_trtllm_modules_to_hf_modules()` (tensorrt_llm/lora_helper.py @037d4ba1), restricted to the names
# hf_lora_convert.py maps the same way (its gate_up_proj -> mlp_h_to_4h differs from the default
# mlp_gate_up, so fused gate_up adapters are refused rather than guessed). Note gate_proj -> mlp_h_to_4h and
# up_proj -> mlp_gate.
LLAMA_HF_TO_TRTLLM = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
}

# hf_lora_convert.py's key pattern; keys it would not match it skips, so an adapter holding any is refused
# here rather than converted with a part silently missing.
CONVERT_KEY = re.compile(r".*\.layers\.([0-9]+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight.*")

# loraModule.cpp @2a9abd95 `createLoraModules`: modules whose in dim is split over TP (inTpSplitDim == 1; A's
# columns) and those split on neither side; every other module splits its out dim (outTpSplitDim == 0; B's rows).
ROW_PARALLEL = frozenset({"attn_dense", "cross_attn_dense", "mlp_4h_to_h", "moe_4h_to_h"})
NOT_SPLIT = frozenset({"moe_router", "mlp_router"})

STORAGE_DTYPES = {"float16": torch.float16, "float32": torch.float32}

Converted = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
V = TypeVar("V")


def _refuse(adapter: Path, what: str, hint: str) -> ToolchainError:
    return ToolchainError(f"LoRA adapter {adapter}: {what}", hint)


def read_adapter_config(adapter: Path, hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> dict:
    """adapter_config.json, refused in one line where TensorRT-LLM's loaders would read it differently from PEFT."""
    path = Path(adapter) / ADAPTER_CONFIG
    if not path.is_file():
        raise _refuse(adapter, f"no {ADAPTER_CONFIG}", "point at the directory PEFT's save_pretrained wrote")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(adapter, f"{ADAPTER_CONFIG} is not readable JSON ({type(e).__name__})",
                      "save the adapter again with PEFT") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise _refuse(adapter, f"{ADAPTER_CONFIG} is not a LoRA adapter's (peft_type "
                      f"{config.get('peft_type') if isinstance(config, dict) else None!r})", "use a PEFT LoRA adapter")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _refuse(adapter, f"r={rank!r}, lora_alpha={alpha!r} are not a positive rank and a number",
                      "save the adapter again with PEFT")
    # Each of these changes what PEFT computes in a way TensorRT-LLM's converters do not carry (facts: lora_manager.py
    # HF_LORA_PATTERN refuses bias keys; rank_pattern / alpha_pattern / fan_in_fan_out are never read; DoRA needs
    # the magnitude vector hf_lora_convert.py drops).
    if config.get("bias", "none") != "none":
        raise _refuse(adapter, f"bias={config['bias']!r} trains biases, which TensorRT-LLM's LoRA has no place for",
                      "train the adapter with bias='none'")
    if config.get("lora_bias"):
        raise _refuse(adapter, "lora_bias=true adds a bias to lora_B, which TensorRT-LLM's LoRA has no place for",
                      "train the adapter with lora_bias=False")
    if config.get("use_dora"):
        raise _refuse(adapter, "use_dora=true (DoRA) is not carried by hf_lora_convert.py's format",
                      "use a plain LoRA adapter (use_dora=False)")
    saved = config.get("modules_to_save") or []
    other = sorted(set(saved) - {"lm_head", "embed_tokens"})
    if other:
        raise _refuse(adapter, f"modules_to_save {other}: TensorRT-LLM loads only lm_head / embed_tokens from an adapter",
                      "train the adapter without modules_to_save")
    if saved:
        # UNVERIFIED which path would apply them: lora_manager.py replaces the engine's lm_head / embedding at build
        # time from the first --lora_dir only, while hf_lora_convert.py skips those keys, so a per-request adapter
        # would silently run without them.
        raise _refuse(adapter, f"modules_to_save {sorted(saved)} cannot travel in the per-request LoRA format",
                      "train the adapter without modules_to_save")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(adapter, f"{key} {config[key]} sets per-module ranks/scales, which TensorRT-LLM ignores",
                          f"train the adapter without {key}")
    if config.get("fan_in_fan_out"):
        raise _refuse(adapter, "fan_in_fan_out=true (Conv1D weights), which TensorRT-LLM ignores",
                      "use an adapter on nn.Linear modules")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is "all-linear" or a regex: the tensor keys are checked instead
        # "all-linear" saves fully qualified paths: the module's own name is the last component (facts 5b).
        unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(hf_to_trtllm))
        if unknown:
            raise _refuse(adapter, f"target modules {unknown} have no TensorRT-LLM LoRA module for this family",
                          f"target only {sorted(hf_to_trtllm)}")
    return config


def lora_scale(config: Mapping) -> float:
    """PEFT's scaling (peft/tuners/lora/layer.py `update_layer`), folded into lora_B as hf_lora_convert.py does."""
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def weights_file(adapter: Path) -> Path:
    """The adapter's safetensors file, refused in one line when PEFT did not write one."""
    path = Path(adapter) / ADAPTER_WEIGHTS
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in Path(adapter).glob("adapter_model.*"))) or "nothing"
        raise _refuse(adapter, f"no {ADAPTER_WEIGHTS} (found {found})",
                      "save the adapter with PEFT's save_pretrained(DIR, safe_serialization=True)")
    return path


def paired(adapter: Path, items: Iterable[tuple[str, V]],
           hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> dict[tuple[int, str], tuple[V, V]]:
    """(lora_A, lora_B) per (layer, TRT-LLM module) from the file's (key, value) items (tensors, or their shapes),
    in the items' order; a key hf_lora_convert.py would skip, a module this family has no LoRA module for, an empty
    file and a half pair are refused in one line."""
    parts: dict[tuple[int, str], dict[str, V]] = {}
    for key, value in items:
        match = CONVERT_KEY.fullmatch(key)
        if match is None:
            raise _refuse(adapter, f"tensor {key} is not a LoRA A/B weight of a decoder layer",
                          "train the adapter on the decoder layers' linear projections only")
        layer, hf_module, side = int(match.group(1)), match.group(3), match.group(4)
        if hf_module not in hf_to_trtllm:
            raise _refuse(adapter, f"tensor {key}: {hf_module} has no TensorRT-LLM LoRA module for this family",
                          f"target only {sorted(hf_to_trtllm)}")
        parts.setdefault((layer, hf_to_trtllm[hf_module]), {})[side] = value
    if not parts:
        raise _refuse(adapter, f"{ADAPTER_WEIGHTS} holds no LoRA weights", "save the trained adapter with PEFT")
    out: dict[tuple[int, str], tuple[V, V]] = {}
    for (layer, module), pair in parts.items():
        if "A" not in pair or "B" not in pair:
            raise _refuse(adapter, f"layer {layer} {module} has only lora_{'A' if 'B' not in pair else 'B'}",
                          "the adapter is incomplete: save it again with PEFT")
        out[(layer, module)] = (pair["A"], pair["B"])
    return out


def read_adapter(adapter: Path, hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> tuple[dict, Converted]:
    """The adapter's config and its (A [r, in], B [out, r]) per (layer, TRT-LLM module), unscaled, in the order
    the safetensors file stores them: hf_lora_convert.py keeps key order, layers not sorted (whether it reads the
    file in storage order, as safetensors' load_file does, is UNVERIFIED; the runtime reads each row by its
    config row, so the order changes no result)."""
    adapter = Path(adapter)
    config = read_adapter_config(adapter, hf_to_trtllm)
    path = weights_file(adapter)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError and OSError on bad files
        raise _refuse(adapter, f"{ADAPTER_WEIGHTS} is not readable ({type(e).__name__})", "save the adapter again") from None
    weights: Converted = {}
    for (layer, module), (a, b) in paired(adapter, tensors.items(), hf_to_trtllm).items():
        # hf_lora_convert.py transposes A when in < r and B when out < r; a rank that large is refused instead.
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config["r"] or b.shape[1] != config["r"] \
                or a.shape[1] < a.shape[0] or b.shape[0] < b.shape[1]:
            raise _refuse(adapter, f"layer {layer} {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
                          f"fit rank {config['r']}", "use an adapter with one rank r no larger than the module's dims")
        weights[(layer, module)] = (a, b)
    return config, weights


def read_scaled(adapter: Path, hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> Converted:
    """(A, B x PEFT's scale) per (layer, module) in float32: what every runtime applies (hf_lora_convert.py and
    lora_manager.py fold the scale into B), before each casts to its own dtype."""
    config, weights = read_adapter(adapter, hf_to_trtllm)
    scale = lora_scale(config)
    return {key: (a.to(torch.float32), b.to(torch.float32) * scale) for key, (a, b) in weights.items()}


def convert_adapter(adapter: Path, out_dir: Path, dtype: str = "float16",
                    hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> Path:
    """Write `out_dir`/model.lora_weights.npy and model.lora_config.npy as hf_lora_convert.py does."""
    if dtype not in STORAGE_DTYPES:
        # hf_lora_convert.py also offers bfloat16; how it puts that in an .npy is UNVERIFIED, so it is refused.
        raise ToolchainError(f"LoRA storage dtype {dtype!r} is not supported", f"use one of {sorted(STORAGE_DTYPES)}")
    rows, keys = [], []
    for (layer, module), (a, b) in read_scaled(adapter, hf_to_trtllm).items():
        rows.append(torch.cat([a.to(STORAGE_DTYPES[dtype]).flatten(), b.to(STORAGE_DTYPES[dtype]).flatten()]))
        keys.append([LORA_MODULE_IDS[module], layer, a.shape[0]])
    width = max(len(row) for row in rows)
    packed = torch.zeros(len(rows), width, dtype=STORAGE_DTYPES[dtype])
    for i, row in enumerate(rows):
        packed[i, : len(row)] = row
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / WEIGHTS_FILE, packed.numpy()[None])
    np.save(out_dir / CONFIG_FILE, np.asarray(keys, dtype=np.int32)[None])
    return out_dir


def module_dims(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each dense TRT-LLM LoRA module, as loraModule.cpp @2a9abd95 `createLoraModules` sets them."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "attn_qkv": (hidden, q + 2 * kv), "attn_q": (hidden, q), "attn_k": (hidden, kv), "attn_v": (hidden, kv),
        "attn_dense": (hidden, hidden), "mlp_h_to_4h": (hidden, intermediate), "mlp_gate": (hidden, intermediate),
        "mlp_4h_to_h": (intermediate, hidden), "mlp_gate_up": (hidden, 2 * intermediate),
    }


def read_converted(directory: Path, dims: Mapping[str, tuple[int, int]], num_layers: int | None = None) -> Converted:
    """(A [r, in], B [out, r]) per (layer, module) of a converted adapter directory (`unpack` of its two files)."""
    directory = Path(directory)
    try:
        weights = np.load(directory / WEIGHTS_FILE, allow_pickle=False)
        keys = np.load(directory / CONFIG_FILE, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ToolchainError(f"LoRA weights in {directory} are not readable ({type(e).__name__}: {e})".replace("\n", " "),
                             "write them with convert_adapter or hf_lora_convert.py") from None
    return unpack(weights, keys, dims, num_layers, source=f"LoRA weights in {directory}")


def unpack(weights: np.ndarray, keys: np.ndarray, dims: Mapping[str, tuple[int, int]], num_layers: int | None = None,
           source: str = "lora_weights") -> Converted:
    """(A [r, in], B [out, r]) per (layer, module) from `lora_weights` [1, rows, W] and `lora_config` [1, rows, 3|4]
    (the files, or a Triton request's tensors), B already scaled. A row holds no dims of its own: `dims` gives
    each module's (in, out), as the engine's model config does for the runtime. The checks and their words are
    loraUtils.cpp @2a9abd95 `loraValidateRequestTensors`'s; `source` starts each message."""
    if weights.ndim != 3 or keys.ndim != 3 or weights.shape[0] != 1 or keys.shape[0] != 1:
        raise ToolchainError(f"{source}: Expected batch dimension to be 1 for each lora request",
                             f"weights {list(weights.shape)}, config {list(keys.shape)}; expected [1, rows, W] and [1, rows, 3]")
    if keys.dtype != np.int32 or keys.shape[2] not in (3, 4) or keys.shape[1] != weights.shape[1]:
        raise ToolchainError(f"{source}: lora_config is not [1, rows, 3|4] int32 matching the weights' rows",
                             f"got {keys.dtype} {list(keys.shape)} for weights {list(weights.shape)}")
    out: Converted = {}
    for row, (module_id, layer, rank) in zip(weights[0], keys[0][:, :3].tolist(), strict=True):
        module = MODULE_NAMES.get(module_id, "INVALID")
        if module not in dims:
            raise ToolchainError(f"{source}: lora module {module} not enabled for this model",
                                 f"this model has LoRA modules {sorted(dims)}")
        if num_layers is not None and not 0 <= layer < num_layers:
            raise ToolchainError(f"{source}: Expected layerId to be in the range [0, numModelLayers)",
                                 f"layer {layer}, the model has {num_layers}")
        if rank <= 0:
            raise ToolchainError(f"{source}: Expected adapterSize to be > 0", f"{module} layer {layer}")
        d_in, d_out = dims[module]
        if len(row) < rank * (d_in + d_out):
            raise ToolchainError(f"{source}: lora_weights has to few values for {module}",
                                 f"layer {layer}: the adapter was made for another base model")
        values = torch.from_numpy(np.ascontiguousarray(row))
        a = values[: rank * d_in].reshape(rank, d_in)
        b = values[rank * d_in: rank * (d_in + d_out)].reshape(d_out, rank)
        out[(layer, module)] = (a, b)
    return out


def shard(a: torch.Tensor, b: torch.Tensor, module: str, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One TP rank's (A, B), cut as `LoraCache::copyToPages` does: row-parallel modules (attn_dense, mlp_4h_to_h)
    keep their block of A's columns (their input is split), column-parallel ones their block of B's rows; the
    rank dim is never split (lora_manager.py @007e181b `load_from_hf` splits the same way)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp {tp}")
    if module in NOT_SPLIT or tp == 1:
        return a, b
    row_parallel = module in ROW_PARALLEL
    size = a.shape[1] if row_parallel else b.shape[0]
    if size % tp:
        raise ToolchainError(f"LoRA module {module}: its {'in' if row_parallel else 'out'} dim {size} does not split over tp {tp}",
                             "use a tp that divides it")
    block = size // tp
    if row_parallel:
        return a[:, rank * block: (rank + 1) * block], b
    return a, b[rank * block: (rank + 1) * block]
