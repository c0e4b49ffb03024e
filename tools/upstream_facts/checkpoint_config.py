"""The fields a TensorRT-LLM checkpoint's config.json is read into.

From tensorrt_llm/models/modeling_utils.py: the `QuantConfig` dataclass fields
(`QuantConfig.from_dict` is `cls(**config)`, so a key that is not a field fails
trtllm-build with a TypeError) and the keyword parameters of
`PretrainedConfig.__init__` (those without a default must be present; the rest
of the keys pass through **kwargs to the architecture's config class).
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import document

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PATH = "tensorrt_llm/models/modeling_utils.py"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"{PATH}: no class {name}")


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
    }
    about = ("QuantConfig fields (config.json `quantization` keys; any other key is a TypeError in "
             "QuantConfig.from_dict) and PretrainedConfig.__init__ keyword parameters (required = no default; "
             "extra keys go to **kwargs) from TensorRT-LLM tensorrt_llm/models/modeling_utils.py.")
    return document(about, sources, facts)
