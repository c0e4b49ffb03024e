"""trtllm-build's command line: every flag, its kind, choices and default.

Read with `ast` (TensorRT-LLM cannot be imported without CUDA) from
tensorrt_llm/commands/build.py `parse_arguments`: each `add_argument` call,
with defaults written as `BuildConfig.<field>` resolved from the BuildConfig
class in tensorrt_llm/builder.py. The plugin flags are added by
`add_plugin_argument` (tensorrt_llm/plugin/plugin.py): one per PluginConfig
field, bool fields as enable/disable, dtype fields as their Literal choices
plus "disable", the rest by type.
"""

from __future__ import annotations

import ast

from tools.upstream_facts.common import document

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
BUILD = "tensorrt_llm/commands/build.py"
BUILDER = "tensorrt_llm/builder.py"
PLUGIN = "tensorrt_llm/plugin/plugin.py"
TYPES = {"int": "int", "float": "float", "str": "str"}


def _literal(node: ast.AST | None):
    """(value, resolved): the node's Python literal, or its source text unresolved."""
    if node is None:
        return None, True
    try:
        return ast.literal_eval(node), True
    except ValueError:
        return ast.unparse(node), False


def _field_default(node: ast.AST | None):
    """The default of a class field: `x: T = v` or `x: T = Field(default=v, ...)`."""
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return _literal(kw.value)
        return None, True
    return _literal(node)


def _class_fields(tree: ast.Module, name: str) -> dict[str, tuple[ast.AnnAssign, object, bool]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {f.target.id: (f, *_field_default(f.value)) for f in node.body
                    if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    raise SystemExit(f"no class {name}")


def _literal_choices(annotation: ast.AST, aliases: dict[str, ast.AST]) -> list | None:
    """add_plugin_argument's choices: the values of the Literal inside an Optional/Union
    annotation (aliases such as DefaultPluginDtype expanded), None shown as "disable";
    None when the annotation holds no Literal."""
    def expand(node):
        return aliases.get(node.id, node) if isinstance(node, ast.Name) else node

    node = expand(annotation)
    if not (isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "Union")):
        return None
    members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    for member in map(expand, members):
        if isinstance(member, ast.Subscript) and ast.unparse(member.value) == "Literal":
            values = ast.literal_eval(member.slice) if isinstance(member.slice, ast.Tuple) else \
                (ast.literal_eval(member.slice),)
            return list(dict.fromkeys("disable" if v is None else v for v in [*values, None]))
    return None


def _plugin_flags(src) -> dict[str, dict]:
    """One flag per PluginConfig field named in cli_plugin_args, as add_plugin_argument adds it."""
    text = src.read(PLUGIN)
    tree = ast.parse(text)
    aliases = {n.targets[0].id: n.value for n in tree.body
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    cli = ast.literal_eval(aliases["cli_plugin_args"])
    flags = {}
    for name, (node, default, _) in _class_fields(tree, "PluginConfig").items():
        if name not in cli:
            continue
        entry = {"source": "trtllm", "path": PLUGIN, "commit": src.commit_of(PLUGIN), "line": node.lineno}
        choices = _literal_choices(node.annotation, aliases)
        if choices is not None:
            # gemm_plugin keeps its None default (no flag means "decide by quantization")
            entry.update(kind="choice", choices=choices,
                         default=default if name == "gemm_plugin" else (default or "disable"))
        elif ast.unparse(node.annotation) == "bool":
            entry.update(kind="choice", choices=["enable", "disable"], default="enable" if default else "disable")
        else:
            entry.update(kind=TYPES.get(ast.unparse(node.annotation), "other"), choices=None, default=default)
        flags[f"--{name}"] = entry
    return flags


def extract(sources, previous=None):
    src = sources["trtllm"]
    text = src.read(BUILD)
    tree = ast.parse(text)
    build_config = _class_fields(ast.parse(src.read(BUILDER)), "BuildConfig")
    parse = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_arguments")
    flags: dict[str, dict] = {}
    plugins = False
    for call in ast.walk(parse):
        if not isinstance(call, ast.Call):
            continue
        func = ast.unparse(call.func)
        if func == "add_plugin_argument":
            plugins = True
            continue
        if not func.endswith(".add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        if not names:
            continue
        kw = {k.arg: k.value for k in call.keywords}
        action, _ = _literal(kw.get("action"))
        default, resolved = _literal(kw.get("default"))
        default_source = None
        if not resolved and str(default).startswith("BuildConfig."):
            field = build_config.get(str(default).split(".", 1)[1])
            if field is not None and field[2]:
                default, resolved = field[1], True
                default_source = {"source": "trtllm", "path": BUILDER, "commit": src.commit_of(BUILDER),
                                  "line": field[0].lineno}
        choices, known = _literal(kw.get("choices"))
        if action == "store_true":
            kind = "switch"
        elif kw.get("choices") is not None:
            kind = "choice"
        else:
            kind = TYPES.get(ast.unparse(kw["type"]) if "type" in kw else "str", "other")
        type_expr = ast.unparse(kw["type"]) if "type" in kw else None
        flags[names[0]] = {
            "kind": kind, "choices": list(choices) if known and choices is not None else None,
            "choices_expr": None if known else choices, "default": default,
            "default_expr": None if resolved else default, "nargs": _literal(kw.get("nargs"))[0],
            "type_expr": type_expr if kind == "other" else None, "default_source": default_source,
            "source": "trtllm", "path": BUILD, "commit": src.commit_of(BUILD), "line": call.lineno,
        }
        if not resolved:
            flags[names[0]]["default"] = None
    if plugins:
        flags.update(_plugin_flags(src))
    about = ("trtllm-build flags from tensorrt_llm/commands/build.py parse_arguments (BuildConfig defaults resolved "
             "from builder.py) and plugin/plugin.py add_plugin_argument. kind: switch (store_true), choice, int, "
             "float, str, other (a converter such as enum_type(KVCacheType), in type_expr). A default or choice list that "
             "is an expression upstream is kept as text in *_expr.")
    return document(about, sources, {"flags": dict(sorted(flags.items()))})
