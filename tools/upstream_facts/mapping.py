"""How TensorRT-LLM reads a checkpoint's `mapping` and splits layers across
pipeline stages (tensorrt_llm/mapping.py): `Mapping.from_dict` is `cls(**mapping)`
over `Mapping.__init__`'s parameters (an unknown key is a TypeError), the world
size must equal tp x pp x cp, and `pp_layers` hands stage `pp_rank` its part of
torch.tensor_split(arange(num_layers), pp_size).
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import document, verify_quotes

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PATH = "tensorrt_llm/mapping.py"
RULES = [
    {"rule": "from_dict", "quote": "return cls(**mapping)"},
    {"rule": "world_size", "quote": "if tp_size * pp_size * cp_size != world_size:"},
    {"rule": "pp_layers", "quote": "return torch.tensor_split(torch.arange(num_layers),"},
]


def extract(sources, previous=None):
    src = sources["trtllm"]
    tree = ast.parse(src.read(PATH))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Mapping")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    where = {"source": "trtllm", "path": PATH, "commit": src.commit_of(PATH)}
    positional = init.args.args[1:]  # without self
    defaults = dict(zip([a.arg for a in positional][-len(init.args.defaults):], init.args.defaults, strict=False))
    defaults.update({a.arg: d for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=False)})
    params = {a.arg: {"default": ast.literal_eval(defaults[a.arg]) if defaults.get(a.arg) is not None else None,
                      **where, "line": a.lineno}
              for a in [*positional, *init.args.kwonlyargs]}
    rules = [dict(r, **where, line=0) for r in RULES]
    verify_quotes(rules, sources)
    about = ("Mapping.__init__ parameters (the keys config.json `mapping` may hold; from_dict is cls(**mapping)) "
             "and the rules for world size and pipeline layer assignment, from tensorrt_llm/mapping.py.")
    return document(about, sources, {"init_params": params, "rules": {r["rule"]: r for r in rules}})
