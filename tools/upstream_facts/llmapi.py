"""What TensorRT-LLM's LLM-API path on Triton accepts, as far as the stored upstream
files allow: from tensorrt_llm/llmapi/llm_args.py the `decoding_type` -> config-class
map and each speculative config's fields and backend support, every LLM() argument
(BaseLlmArgs + TorchLlmArgs, the PyTorch backend's LlmArgs) with type, default and
status, and the KvCacheConfig / SchedulerConfig / CudaGraphConfig fields; the llmapi
Triton model's config.pbtxt (inputs, outputs, backend), its model.yaml (the LLM() keys
and triton_config) and what its model.py / helpers.py do with them (curated, quoted);
and the argparse flags of triton_backend/scripts/launch_triton_server.py.

The files are gathered one by one into a plain directory whose `.commits.json`
names the commit each came from (no stored copy is at release 1.2.1 itself).
llm_args.py is a whole stored version of the 1.1/1.2 line whose commit the index
does not report: its `.commits.json` entry says so instead of naming a commit.
"""

from __future__ import annotations

import ast
import re

import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from tools.upstream_facts.common import classes, document, verify_quotes

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
ARGS = "tensorrt_llm/llmapi/llm_args.py"
PBTXT = "triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt"
YAML = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml"
LAUNCH = "triton_backend/scripts/launch_triton_server.py"
MODEL_PY = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py"
HELPERS = "triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py"
FILES = (ARGS, PBTXT, YAML, LAUNCH, MODEL_PY, HELPERS)
RULES = [
    {"rule": "decoding_type_key", "path": ARGS, "quote": 'decoding_type = data.get("decoding_type")'},
    {"rule": "unknown_decoding_type", "path": ARGS, "quote": 'raise ValueError(f"Invalid decoding type: {decoding_type}")'},
    {"rule": "limits_live_in_model_yaml", "path": PBTXT, "quote": "# The below config arguments are specific in model.yaml"},
    {"rule": "no_batching", "path": YAML, "quote": "max_batch_size: 0 # The current implementation does not support batching"},
    {"rule": "no_mpi_world_one", "path": LAUNCH, "quote": 'assert world_size == 1, "world size must be 1 when using no-mpi"'},
    {"rule": "llmapi_launch_prefix", "path": LAUNCH, "quote": "cmd += ['trtllm-llmapi-launch']"},
    {"rule": "one_process_per_rank", "path": LAUNCH, "quote": "cmd += ['-n', '1']"},
    {"rule": "other_ranks_load_only_trtllm", "path": LAUNCH, "quote": "cmd += ['--model-control-mode=explicit']"},
    {"rule": "strict_models_forbid_extra_keys", "path": ARGS, "quote": 'extra = "forbid"  # globally forbid arbitrary fields'},
    {"rule": "llm_args_forbid_extra_keys", "path": ARGS, "quote": '"extra": "forbid",'},
    {"rule": "llm_args_is_torch", "path": ARGS, "quote": "LlmArgs = TorchLlmArgs"},
    {"rule": "speculative_backend_checked", "path": ARGS,
     "quote": "if not self.speculative_config.supports_backend(self.backend):"},
]


def _where(src, path: str, line: int) -> dict:
    return {"source": "trtllm", "path": path, "commit": src.commit_of(path), "line": line}


def _literal(node: ast.AST | None):
    """(True, value) for a literal expression, else (False, None)."""
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except ValueError:
        return False, None


def _is_field_call(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("Field", "PydanticField")


def _str_enums(found: dict[str, ast.ClassDef]) -> dict[str, dict[str, str]]:
    """Enum classes of the module whose members are all string literals: name -> {member: value}."""
    out = {}
    for name, cls in found.items():
        if not any(ast.unparse(b) in ("StrEnum", "Enum") for b in cls.bases):
            continue
        members = {}
        for n in cls.body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                known, value = _literal(n.value)
                if known:
                    members[n.targets[0].id] = value
        if members and all(isinstance(v, str) for v in members.values()):
            out[name] = members
    return out


def _enum_members(cls: ast.ClassDef, src) -> dict:
    return {n.targets[0].id: {"value": ast.literal_eval(n.value), **_where(src, ARGS, n.lineno)}
            for n in cls.body if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)}


def _field(node: ast.AnnAssign, enums: dict, src, declared_in: str) -> dict:
    """One pydantic field: its annotation text and how its default is given. `default` is
    the literal default (an enum member's string value counts, with default_expr naming
    the member); `default_factory` the factory's name; `required` when neither is given
    (no value, or Field(...) / Field() without one). Field's `status`, `alias` and
    `deprecated` keywords are kept where literal."""
    entry: dict = {"type": ast.unparse(node.annotation), "declared_in": declared_in}
    value, kw = node.value, {}
    if _is_field_call(value):
        kw = {k.arg: k.value for k in value.keywords if k.arg}
        value = kw.get("default", value.args[0] if value.args else None)
        if value is not None and isinstance(value, ast.Constant) and value.value is Ellipsis:
            value = None
        if "default_factory" in kw:
            entry["default_factory"] = ast.unparse(kw["default_factory"])
    if value is None and "default_factory" not in entry:
        entry["required"] = True
    elif value is not None:
        known, literal = _literal(value)
        if known:
            entry["default"] = literal
        else:
            entry["default_expr"] = ast.unparse(value)
            if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                    and value.attr in enums.get(value.value.id, {})):
                entry["default"] = enums[value.value.id][value.attr]
    for key in ("status", "alias", "deprecated"):
        known, literal = _literal(kw.get(key))
        if known:
            entry[key] = literal
    return {**entry, **_where(src, ARGS, node.lineno)}


def _own_fields(cls: ast.ClassDef, enums: dict, src) -> dict:
    """A pydantic class's own annotated fields; ClassVars and private (`_`) attributes left out."""
    out = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if ast.unparse(node.annotation).startswith("ClassVar") or node.target.id.startswith("_"):
            continue
        out[node.target.id] = _field(node, enums, src, cls.name)
    return out


def _chain(found: dict, name: str) -> list[str]:
    """The class and its bases defined in this module, most derived first (single-line MRO
    of the module's own classes; mixins from elsewhere are left out)."""
    out = [name]
    for base in found[name].bases:
        base_name = ast.unparse(base)
        if base_name in found and base_name not in out:
            out += [b for b in _chain(found, base_name) if b not in out]
    return out


def _merged_fields(found: dict, name: str, enums: dict, src) -> dict:
    """Fields as `name` sees them: bases' first, a subclass's redeclaration replacing the
    base's (the replaced one's class is kept as `overrides`)."""
    out: dict = {}
    for cls_name in reversed(_chain(found, name)):
        for field, entry in _own_fields(found[cls_name], enums, src).items():
            if field in out:
                entry = {**entry, "overrides": out[field]["declared_in"]}
            out[field] = entry
    return out


def _extra_policy(found: dict, name: str, src) -> dict:
    """Where the model config of `name` (or a base) sets `extra`: a nested `class Config`
    with `extra = ...` or a `model_config` dict with an "extra" key; the most derived wins."""
    for cls_name in _chain(found, name):
        cls = found[cls_name]
        for node in cls.body:
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                for n in node.body:
                    if (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                            and n.targets[0].id == "extra"):
                        return {"extra": ast.literal_eval(n.value), "declared_in": cls_name,
                                "via": "class Config", **_where(src, ARGS, n.lineno)}
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == "model_config" and isinstance(node.value, ast.Dict)):
                for k, v in zip(node.value.keys, node.value.values):
                    if k is not None and ast.literal_eval(k) == "extra":
                        return {"extra": ast.literal_eval(v), "declared_in": cls_name,
                                "via": "model_config", **_where(src, ARGS, k.lineno)}
    return {"extra": None}


def _model(found: dict, name: str, enums: dict, src) -> dict:
    policy = _extra_policy(found, name, src)
    return {
        "class": name,
        "bases": _chain(found, name)[1:],
        "extra_forbidden": policy["extra"] == "forbid",
        "extra_policy": policy,
        "fields": _merged_fields(found, name, enums, src),
        **_where(src, ARGS, found[name].lineno),
    }


def _class_var(cls: ast.ClassDef, name: str):
    return next((ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == name), None)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _supports_backend(found: dict, name: str, src) -> dict | None:
    """supports_backend(backend) of the class or its nearest base: the returned expression
    and the backends it names, read as `allows` (== / in) or `excludes` (!= / not in);
    `return True` allows every backend."""
    for cls_name in _chain(found, name):
        fn = _method(found[cls_name], "supports_backend")
        if fn is None:
            continue
        ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return))
        out = {"declared_in": cls_name, "returns": ast.unparse(ret.value)}
        expr = ret.value
        if isinstance(expr, ast.Constant) and expr.value is True:
            out["allows"] = "all"
        elif isinstance(expr, ast.Compare) and len(expr.ops) == 1:
            value = ast.literal_eval(expr.comparators[0])
            backends = sorted(value) if isinstance(value, (tuple, list, set)) else [value]
            op = type(expr.ops[0])
            out["allows" if op in (ast.Eq, ast.In) else "excludes"] = backends
        return {**out, **_where(src, ARGS, ret.lineno)}
    return None


def _speculative(found: dict, enums: dict, src) -> dict:
    base = found["DecodingBaseConfig"]
    from_dict = _method(base, "from_dict")
    table = next(n.value for n in ast.walk(from_dict) if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "config_classes")
    types = {}
    for key, value in zip(table.keys, table.values):
        cls = found.get(value.id)
        if cls is None:  # not defined in the stored file
            types[ast.literal_eval(key)] = {"class": value.id, "fields": None, **_where(src, ARGS, key.lineno)}
            continue
        types[ast.literal_eval(key)] = {
            "class": cls.name,
            # The class's own ClassVar; it need not equal the from_dict key (e.g. "Draft_Target").
            "decoding_type": _class_var(cls, "decoding_type"),
            "bases": _chain(found, cls.name)[1:],
            "fields": _own_fields(cls, enums, src),
            "supports_backend": _supports_backend(found, cls.name, src),
            **_where(src, ARGS, key.lineno),
        }
    return {"base_fields": _own_fields(base, enums, src), "from_dict": _where(src, ARGS, from_dict.lineno),
            "types": types}


def _extra_dict_conversions(tree: ast.Module, src) -> dict:
    """update_llm_args_with_extra_dict's field_mapping: the model.yaml / extra-options keys it
    turns into config objects before LLM(), and how (from_dict or the constructor); every
    other key is passed on as given (pydantic then validates dicts such as kv_cache_config)."""
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "update_llm_args_with_extra_dict")
    table = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "field_mapping")
    manual = next(ast.literal_eval(n.comparators[0]) for n in ast.walk(fn) if isinstance(n, ast.Compare)
                  and isinstance(n.ops[0], ast.In) and ast.unparse(n.left) == "field_name"
                  and isinstance(n.comparators[0], ast.List))
    return {ast.literal_eval(k): {"class": ast.unparse(v), "via": "from_dict" if ast.literal_eval(k) in manual
                                  else "constructor", **_where(src, ARGS, k.lineno)}
            for k, v in zip(table.keys, table.values)}


def _llm_args(src) -> dict:
    tree = ast.parse(src.read(ARGS))
    found = classes(tree)
    enums = _str_enums(found)
    torch_args = _model(found, "TorchLlmArgs", enums, src)
    scheduler = _model(found, "SchedulerConfig", enums, src)
    scheduler["policies"] = {name: {"members": _enum_members(found[name], src), **_where(src, ARGS, found[name].lineno)}
                             for name in ("CapacitySchedulerPolicy", "ContextChunkingPolicy") if name in found}
    if "DynamicBatchConfig" in found:
        scheduler["dynamic_batch_config"] = _model(found, "DynamicBatchConfig", enums, src)
    torch_args["extra_dict_conversions"] = _extra_dict_conversions(tree, src)
    return {
        "speculative": _speculative(found, enums, src),
        "llm_args": torch_args,
        "kv_cache_config": _model(found, "KvCacheConfig", enums, src),
        "scheduler_config": scheduler,
        "cuda_graph_config": _model(found, "CudaGraphConfig", enums, src),
    }


def _line_matching(lines: list[str], pattern: str, start: int = 0) -> int:
    return next(i + 1 for i in range(start, len(lines)) if re.search(pattern, lines[i]))


def _triton_config(src) -> dict:
    text = src.read(PBTXT)
    lines = text.splitlines()
    config = text_format.Parse(text, pb.ModelConfig())
    dtype = pb.DataType.Name

    def tensor(t, with_optional: bool) -> dict:
        out = {"data_type": dtype(t.data_type), "dims": list(t.dims)}
        if with_optional:
            out["optional"] = t.optional
        return {**out, **_where(src, PBTXT, _line_matching(lines, rf'name: "{t.name}"'))}

    return {
        "name": config.name,
        "backend": config.backend,
        # Neither is set in config.pbtxt: model.yaml's triton_config carries them.
        "max_batch_size_set": "max_batch_size" in re.sub(r"#.*", "", text),
        "decoupled_set": config.HasField("model_transaction_policy"),
        "instance_group": [{"count": g.count, "kind": pb.ModelInstanceGroup.Kind.Name(g.kind)}
                           for g in config.instance_group],
        "parameters": sorted(config.parameters),
        "inputs": {t.name: tensor(t, True) for t in config.input},
        "outputs": {t.name: tensor(t, False) for t in config.output},
        **_where(src, PBTXT, _line_matching(lines, r"^backend:")),
    }


def _model_yaml(src) -> dict:
    text = src.read(YAML)
    lines = text.splitlines()
    data = yaml.safe_load(text)

    def at(key: str, indent: str = "") -> int:
        return _line_matching(lines, rf"^{indent}{key}:")

    return {
        "llm_kwargs": {k: {"default": v, **_where(src, YAML, at(k))} for k, v in data.items() if k != "triton_config"},
        "triton_config": {k: {"default": v, **_where(src, YAML, at(k, r"\s+"))}
                          for k, v in data["triton_config"].items()},
    }


def _launch_flags(src) -> dict:
    """parse_arguments()'s add_argument calls: flag -> default (or store_true) and dest."""
    tree = ast.parse(src.read(LAUNCH))
    parse = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_arguments")
    out = {}
    for call in ast.walk(parse):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument"):
            continue
        names = [ast.literal_eval(a) for a in call.args]
        kw = {k.arg: k.value for k in call.keywords}
        action = ast.literal_eval(kw["action"]) if "action" in kw else None
        known, default = _literal(kw.get("default"))
        if action == "store_true" and "default" not in kw:
            known, default = True, False
        entry = {"aliases": names[1:], "dest": names[0].lstrip("-").replace("-", "_")}
        if action:
            entry["action"] = action
        if "type" in kw:
            entry["type"] = ast.unparse(kw["type"])
        if known:
            entry["default"] = default
        elif "default" in kw:
            entry["default_expr"] = ast.unparse(kw["default"])
        out[names[0]] = {**entry, **_where(src, LAUNCH, call.lineno)}
    return out


# What the llmapi model's model.py does with model.yaml and a request (curated: each
# entry quotes its source line; `value` is what the quote shows).
MODEL_CODE = [
    {"rule": "config_path_env", "path": MODEL_PY, "value": {"env": "LLM_CONFIG_PATH", "default": "model.yaml"},
     "quote": "os.environ.get('LLM_CONFIG_PATH', 'model.yaml'),"},
    {"rule": "config_path_relative_to_model_dir", "path": MODEL_PY,
     "quote": "engine_args_filepath = os.path.join(pb_utils.get_model_dir(), filename)"},
    {"rule": "triton_config_decoupled_required", "path": MODEL_PY, "value": {"key": "decoupled", "required": True},
     "quote": 'dict(decoupled=bool(triton_config["decoupled"])))'},
    {"rule": "triton_config_max_batch_size_required", "path": MODEL_PY,
     "value": {"key": "max_batch_size", "required": True}, "quote": 'int(triton_config["max_batch_size"]))'},
    {"rule": "triton_config_cancellation_check_period_ms", "path": MODEL_PY,
     "value": {"key": "cancellation_check_period_ms", "required": False, "default": 100},
     "quote": ') if "cancellation_check_period_ms" in triton_config else 100'},
    {"rule": "other_keys_to_llm_args", "path": MODEL_PY, "value": {"function": "update_llm_args_with_extra_dict"},
     "quote": "self.llm_engine_args = update_llm_args_with_extra_dict("},
    {"rule": "triton_config_excluded_from_llm_args", "path": MODEL_PY, "quote": 'exclude_keys=["triton_config"]),'},
    {"rule": "llm_built_from_args", "path": MODEL_PY, "quote": "None, lambda: LLM(**self.llm_engine_args))"},
    {"rule": "multi_rank_mpi_session", "path": MODEL_PY, "quote": 'self.llm_engine_args["_mpi_session"] = mpi_session'},
    {"rule": "streaming_needs_decoupled", "path": MODEL_PY, "quote": '"Streaming is only supported in decoupled mode.")'},
    {"rule": "sampling_params_from_request", "path": MODEL_PY, "quote": "prompt, SamplingParams(**sampling_params), streaming)"},
    {"rule": "text_input_1d_only", "path": MODEL_PY,
     "quote": 'f"The current implementation only supports text_input being a 1D tensor."'},
    {"rule": "stop_input_cancels_by_request_id", "path": MODEL_PY, "quote": "stop = get_input_scalar_by_name(request, 'stop')"},
    {"rule": "text_output_is_output_text", "path": MODEL_PY, "value": {"output": "text_output", "from": "output.text"},
     "quote": 'output.text.encode("utf-8") for output in request_output.outputs'},
    {"rule": "perf_outputs_need_request_perf_metrics", "path": MODEL_PY,
     "quote": "if hasattr(request_output.outputs[0], 'request_perf_metrics'"},
    {"rule": "stop_words_tensor", "path": HELPERS, "value": {"input": "sampling_param_stop", "field": "stop"},
     "quote": "kwargs['stop'] = get_input_tensor_by_name(request, 'sampling_param_stop')"},
    {"rule": "streaming_default_false", "path": HELPERS, "value": {"input": "streaming", "default": False},
     "quote": "batch_index) or False"},
]


def _assigned(fn: ast.FunctionDef, name: str) -> ast.AST:
    return next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == name)


def _request_params(src, fn_name: str, args_name: str, prefix: str) -> dict:
    """A helpers.py request reader: each request input it reads (`prefix` + arg) -> the
    SamplingParams / output-config field it fills and the default it gets when absent."""
    tree = ast.parse(src.read(HELPERS))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name)
    names = _assigned(fn, args_name)
    defaults_node = _assigned(fn, "default_values")
    defaults = {ast.literal_eval(k): (ast.literal_eval(v), k.lineno)
                for k, v in zip(defaults_node.keys, defaults_node.values)}
    out = {}
    for elt in names.elts:
        arg = ast.literal_eval(elt)
        entry = {"field": arg}
        if prefix + arg in defaults:
            entry["default"], line = defaults[prefix + arg]
        else:
            line = elt.lineno
        out[prefix + arg] = {**entry, **_where(src, HELPERS, line)}
    return out


def _response_outputs(src) -> dict:
    """The output tensors _create_response can send, by name (pb_utils.Tensor("name", ...))."""
    tree = ast.parse(src.read(MODEL_PY))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_create_response")
    out = {}
    for call in ast.walk(fn):
        if (isinstance(call, ast.Call) and ast.unparse(call.func) == "pb_utils.Tensor" and call.args
                and isinstance(call.args[0], ast.Constant)):
            out.setdefault(call.args[0].value, _where(src, MODEL_PY, call.lineno))
    fields = _assigned(fn, "output_fields")
    for key, value in zip(fields.keys, fields.values):
        name = ast.literal_eval(value.elts[0])
        out[name] = {**out.get(name, {}), "when": ast.literal_eval(key), **_where(src, MODEL_PY, key.lineno)}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["line"]))


def _triton_model_code(src) -> dict:
    entries = [dict(e, source="trtllm", commit=src.commit_of(e["path"]), line=0) for e in MODEL_CODE]
    verify_quotes(entries, {"trtllm": src})
    return {
        "rules": {e["rule"]: e for e in entries},
        "sampling_params": _request_params(src, "get_sampling_params_from_request", "sampling_params_args",
                                           "sampling_param_"),
        "output_config": _request_params(src, "get_output_config_from_request", "output_config_args", ""),
        "outputs": _response_outputs(src),
    }


def extract(sources, previous=None):
    src = sources["trtllm"]
    rules = [dict(r, source="trtllm", commit=src.commit_of(r["path"]), line=0) for r in RULES]
    verify_quotes(rules, sources)
    args = _llm_args(src)
    facts = {
        "speculative": args["speculative"],
        "llm_args": args["llm_args"],
        "kv_cache_config": args["kv_cache_config"],
        "scheduler_config": args["scheduler_config"],
        "cuda_graph_config": args["cuda_graph_config"],
        "triton_model": _triton_config(src),
        "model_yaml": _model_yaml(src),
        "triton_model_code": _triton_model_code(src),
        "launch_flags": _launch_flags(src),
        "rules": {r["rule"]: r for r in rules},
    }
    about = ("TensorRT-LLM's LLM-API path on Triton. From llm_args.py: speculative_config's decoding_type -> class "
             "map with each class's fields and supports_backend; llm_args, every LLM() argument of the PyTorch "
             "backend (TorchLlmArgs merged with BaseLlmArgs, each field's declared_in, type, default or "
             "default_factory or required, status) and whether extra keys are forbidden; kv_cache_config, "
             "scheduler_config (with its policy enums) and cuda_graph_config fields. From the llmapi Triton model: "
             "config.pbtxt, model.yaml, and what model.py/helpers.py do with them (triton_model_code). And "
             "launch_triton_server.py's flags. Each file's commit is under sources.trtllm.files; none is stored at "
             "release 1.2.1, and llm_args.py is a stored version whose commit the index does not report.")
    doc = document(about, sources, facts)
    doc["sources"]["trtllm"]["files"] = {path: src.commit_of(path) for path in FILES}
    return doc
