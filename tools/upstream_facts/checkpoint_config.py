"""The fields a TensorRT-LLM checkpoint's config.json is read into.

From tensorrt_llm/models/modeling_utils.py: the `QuantConfig` dataclass fields
(`QuantConfig.from_dict` is `cls(**config)`, so a key that is not a field fails
trtllm-build with a TypeError) and the keyword parameters of
`PretrainedConfig.__init__` (those without a default must be present; the rest
of the keys pass through **kwargs to the architecture's config class).

And what a checkpoint's `exclude_modules` replaces: quantize_layers' default module list
(tensorrt_llm/quantization/quantize.py) and weight_only_quantize_dict's default tensor list and the
tensor-name substrings it quantizes (tensorrt_llm/models/convert_utils.py), each applied only when
exclude_modules is None, so any list given (even an empty one) replaces them.
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import document

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PATH = "tensorrt_llm/models/modeling_utils.py"
QUANTIZE = "tensorrt_llm/quantization/quantize.py"
CONVERT_UTILS = "tensorrt_llm/models/convert_utils.py"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"{PATH}: no class {name}")


def _function(tree: ast.Module, name: str, path: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise SystemExit(f"{path}: no function {name}")


def _when_none(fn: ast.FunctionDef, path: str) -> tuple[list[str], int]:
    """The list `exclude_modules = [...]` takes under `if exclude_modules is None:` in `fn`, and that if's line."""
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and ast.unparse(node.test)
                == "exclude_modules is None" and isinstance(node.body[0], ast.Assign)):
            return ast.literal_eval(node.body[0].value), node.lineno
    raise SystemExit(f"{path}: {fn.name} has no `if exclude_modules is None:` default")


def _exclusion_defaults(src) -> dict:
    quantize = _function(ast.parse(src.read(QUANTIZE)), "quantize_layers", QUANTIZE)
    patterns, line = _when_none(quantize, QUANTIZE)
    layers = {"patterns": patterns, "applies_when": "exclude_modules is None",
              "matched_against": "module names (quantize_layers: fnmatchcase over model.named_modules_with_parent)",
              "source": "trtllm", "path": QUANTIZE, "commit": src.commit_of(QUANTIZE), "line": line}
    wo = _function(ast.parse(src.read(CONVERT_UTILS)), "weight_only_quantize_dict", CONVERT_UTILS)
    defaults = dict(zip([a.arg for a in wo.args.args][-len(wo.args.defaults):], wo.args.defaults, strict=True))
    tensors, line = _when_none(wo, CONVERT_UTILS)
    build = {"quant_weights": ast.literal_eval(defaults["quant_weights"]),
             "quant_weights_match": "substring of the tensor name", "default_exclude": tensors,
             "applies_when": "exclude_modules is None",
             "matched_against": "tensor names (weight_only_quantize_dict, W8A16/W4A16: fnmatchcase over the rank's "
                                "weights)",
             "scale_suffix": ".per_channel_scale",
             "source": "trtllm", "path": CONVERT_UTILS, "commit": src.commit_of(CONVERT_UTILS), "line": line}
    return {"default_exclude_modules": layers, "weight_only_build": build}


def extract(sources, previous=None):
    src = sources["trtllm"]
    text = src.read(PATH)
    tree = ast.parse(text)
    where = {"source": "trtllm", "path": PATH, "commit": src.commit_of(PATH)}
    quant = _class(tree, "QuantConfig")
    quant_fields = {
        node.target.id: {"type": ast.unparse(node.annotation),
                         "default": ast.unparse(node.value) if node.value is not None else None,
                         **where, "line": node.lineno}
        for node in quant.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and not node.target.id.startswith("_")}
    pretrained = _class(tree, "PretrainedConfig")
    init = next(n for n in pretrained.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    defaults = dict(zip([a.arg for a in args.kwonlyargs], args.kw_defaults, strict=False))
    params = {a.arg: {"type": ast.unparse(a.annotation) if a.annotation else None,
                      "required": defaults[a.arg] is None,
                      "default": ast.unparse(defaults[a.arg]) if defaults[a.arg] is not None else None,
                      **where, "line": a.lineno}
              for a in args.kwonlyargs}
    facts = {
        "quant_config": {"from_dict": "cls(**config)", "fields": quant_fields, **where, "line": quant.lineno},
        "pretrained_config": {"init_params": params, "accepts_extra_keys": args.kwarg is not None,
                              **where, "line": init.lineno},
        **_exclusion_defaults(src),
    }
    about = ("QuantConfig fields (config.json `quantization` keys; any other key is a TypeError in "
             "QuantConfig.from_dict) and PretrainedConfig.__init__ keyword parameters (required = no default; "
             "extra keys go to **kwargs) from TensorRT-LLM tensorrt_llm/models/modeling_utils.py. Also the exclusion "
             "defaults: quantize_layers' module list (tensorrt_llm/quantization/quantize.py) and "
             "weight_only_quantize_dict's tensor list (tensorrt_llm/models/convert_utils.py), each used only when "
             "exclude_modules is None.")
    return document(about, sources, facts)
