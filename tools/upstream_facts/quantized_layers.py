"""The parameters TensorRT-LLM's quantized linear layers declare, and what
trtllm-build does to checkpoint tensors before loading them into those layers.

From tensorrt_llm/quantization/layers.py: for each layer class, every
`self.<name> = Parameter(shape=..., dtype=...)` of `__init__` (a local such as
`scale_shape` inlined), and the per-rank `self.in_features` / `self.out_features`
it computes. Classes built on Linear / RowLinear (tensorrt_llm/layers/linear.py)
take their weight and per-rank features from that base: column-parallel splits
out_features, row-parallel in_features.

From tensorrt_llm/models/modeling_utils.py `preprocess_perlayer_weights`: the
per-quant-algo transforms, curated with the source line quoted (checked against
the file on every regeneration).
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import document, verify_quotes

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
LAYERS = "tensorrt_llm/quantization/layers.py"
MODELING = "tensorrt_llm/models/modeling_utils.py"
# The layers W4A16_AWQ and FP8 checkpoints load into (quantization/quantize.py
# weight_only_groupwise_quantize, fp8_quantize). W8A8_SQ_PER_CHANNEL goes through the
# SmoothQuant plugin modules, which rename the checkpoint's tensors: not covered here.
CLASSES = ("WeightOnlyGroupwiseQuantLinear", "WeightOnlyGroupwiseQuantRowLinear", "FP8Linear", "FP8RowLinear")
# W4A16_AWQ in preprocess_perlayer_weights: checkpoint tensor suffix -> what is done to it.
PREPROCESS = {
    "W4A16_AWQ": [
        {"suffix": "weight", "transform": "transpose, interleave for the mixed GEMM, view as the model dtype "
                                          "(int8 (out/2, in) -> (in, out/4))",
         "quote": "weights[name] = preprocessor(param.transpose(-1, -2),"},
        {"suffix": "weights_scaling_factor", "transform": "transpose, cast to the model dtype",
         "quote": "weights[name] = param.transpose(-1, -2).contiguous().to("},
        {"suffix": "prequant_scaling_factor", "transform": "reshape to (1, in)",
         "quote": "weights[name] = param.reshape(1, -1)"},
    ],
}


def _params(cls: ast.ClassDef, src, text: str) -> dict:
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    local: dict[str, str] = {}
    features: dict[str, str] = {}
    params: dict[str, dict] = {}
    for node in ast.walk(init):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name):
            local[target.id] = ast.unparse(node.value)
            continue
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            continue
        if target.attr in ("in_features", "out_features"):
            features[target.attr] = ast.unparse(node.value)
        value = node.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "Parameter":
            kw = {k.arg: k.value for k in value.keywords}
            shape = ast.unparse(kw["shape"])
            shape = local.get(shape, shape)
            params[target.attr] = {"shape": shape.replace("self.", ""),
                                   "dtype": ast.unparse(kw["dtype"]) if "dtype" in kw else None,
                                   "source": "trtllm", "path": LAYERS, "commit": src.commit_of(LAYERS),
                                   "line": node.lineno}
    return {"base": [ast.unparse(b) for b in cls.bases], "features": features, "parameters": params,
            "source": "trtllm", "path": LAYERS, "commit": src.commit_of(LAYERS), "line": cls.lineno}


def extract(sources, previous=None):
    src = sources["trtllm"]
    text = src.read(LAYERS)
    tree = ast.parse(text)
    found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in CLASSES if c not in found]
    if missing:
        raise SystemExit(f"{LAYERS}: no class {missing[0]}")
    layers = {name: _params(found[name], src, text) for name in CLASSES}
    rules = {algo: [dict(r, source="trtllm", path=MODELING, commit=src.commit_of(MODELING), line=0)
                    for r in entries] for algo, entries in PREPROCESS.items()}
    for entries in rules.values():
        verify_quotes(entries, sources)
    about = ("Quantized linear layers' parameters (shape expressions over in_features, out_features, group_size; "
             "dtype: `dtype` is the model dtype) from quantization/layers.py, and trtllm-build's per-algo "
             "preprocessing of checkpoint tensors from models/modeling_utils.py. A tensor not listed for an algo "
             "is loaded as stored.")
    return document(about, sources, {"layers": layers, "preprocess": rules})
