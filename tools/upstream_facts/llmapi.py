"""What TensorRT-LLM's LLM-API path on Triton accepts, as far as the stored upstream
files allow: from tensorrt_llm/llmapi/llm_args.py the `decoding_type` -> config-class
map and each speculative config's fields and backend support, every LLM() argument
(BaseLlmArgs + TorchLlmArgs, the PyTorch backend's LlmArgs) with type, default and
status, and the KvCacheConfig / SchedulerConfig / CudaGraphConfig fields; the llmapi
Triton model's config.pbtxt (inputs, outputs, backend), its model.yaml (the LLM() keys
and triton_config) and what its model.py / helpers.py do with them (curated, quoted);
and the argparse flags of triton_backend/scripts/launch_triton_server.py. And trtllm-serve
(`trtllm_serve`): the `serve` click command's options (tensorrt_llm/commands/serve.py), the
HTTP routes OpenAIServer registers (tensorrt_llm/serve/openai_server.py) and the Prometheus
families of MetricsCollector (tensorrt_llm/metrics/collector.py).

The files are gathered one by one into a plain directory whose `.commits.json`
names the commit each came from (no stored copy is at release 1.2.1 itself).
llm_args.py is a whole stored version of the 1.1/1.2 line whose commit the index
does not report: its `.commits.json` entry says so instead of naming a commit.

Some excerpts are upstream's file from its first line up to what is read, not the whole
file (PARTIAL: path -> the last part kept), so every line number is upstream's and the
kept part parses on its own: serve.py through the `serve` command (00209af1, the stored
version with `--config` as alias of --extra_llm_api_options), openai_server.py through
register_mm_encoder_routes (e7f7345e, the only NVIDIA/TensorRT-LLM version the index
names a commit for). collector.py is whole: the stored version with the `trtllm_` prefix
and only the 1.2 families (request latencies, success counter, two KV-cache gauges),
read_file id 46484645625, a copy in another repository whose commit the index does not
report; NVIDIA/TensorRT-LLM's own stored versions are the 1.1 one without a prefix and a
2026 one with some sixty families.
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
SERVE = "tensorrt_llm/commands/serve.py"
OPENAI_SERVER = "tensorrt_llm/serve/openai_server.py"
COLLECTOR = "tensorrt_llm/metrics/collector.py"
FILES = (ARGS, PBTXT, YAML, LAUNCH, MODEL_PY, HELPERS, SERVE, OPENAI_SERVER, COLLECTOR)
# Excerpts that stop before upstream's end: the last definition kept. Checked on every run,
# so a re-gathered excerpt that stops elsewhere (or an extractor that reads past it) fails.
PARTIAL = {SERVE: "def serve(", OPENAI_SERVER: "def register_mm_encoder_routes(self):"}
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
                for k, v in zip(node.value.keys, node.value.values, strict=False):
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
    for key, value in zip(table.keys, table.values, strict=False):
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
            for k, v in zip(table.keys, table.values, strict=False)}


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
                for k, v in zip(defaults_node.keys, defaults_node.values, strict=False)}
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
    for key, value in zip(fields.keys, fields.values, strict=False):
        name = ast.literal_eval(value.elts[0])
        out[name] = {**out.get(name, {}), "when": ast.literal_eval(key), **_where(src, MODEL_PY, key.lineno)}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["line"]))


def _check_partial(src) -> dict:
    """Each partial excerpt still ends in the definition named in PARTIAL: path -> the
    number of upstream lines it holds (recorded in the facts, so a reader knows where
    the excerpt stops)."""
    out = {}
    for path, last in PARTIAL.items():
        text = src.read(path)
        tree = ast.parse(text)  # a kept part that does not parse was cut mid-statement
        ends = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        tail = max(ends, key=lambda n: (n.end_lineno, n.lineno))  # innermost of those ending last
        if last not in text.splitlines()[tail.lineno - 1]:
            raise SystemExit(f"{path}: excerpt should end with {last!r}, ends with {tail.name}")
        out[path] = len(text.splitlines())
    return out


def _click_options(src) -> dict:
    """The `serve` click command's options: each @click.option's names (the first is the
    key, the rest `aliases`), its dest (a bare name among the arguments, else click's rule:
    the first --name, dashes to underscores), is_flag/multiple, type and default."""
    tree = ast.parse(src.read(SERVE))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    out = {}
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and ast.unparse(deco.func) == "click.option"):
            continue
        names = [ast.literal_eval(a) for a in deco.args]
        flags = [n for n in names if n.startswith("-")]
        bare = [n for n in names if not n.startswith("-")]
        # click: a bare name wins, else the first "--" name (dashes to underscores).
        long_names = [n for n in flags if n.startswith("--")] or flags
        dest = bare[0] if bare else long_names[0].lstrip("-").replace("-", "_")
        kw = {k.arg: k.value for k in deco.keywords}
        entry: dict = {"aliases": flags[1:], "dest": dest}
        for key in ("is_flag", "multiple"):
            known, value = _literal(kw.get(key))
            if known:
                entry[key] = value
        if "type" in kw:
            entry["type"] = ast.unparse(kw["type"])
        known, default = _literal(kw.get("default"))
        if known:
            entry["default"] = default
        elif "default" in kw:
            entry["default_expr"] = ast.unparse(kw["default"])
        out[flags[0]] = {**entry, **_where(src, SERVE, deco.lineno)}
    # Decorators apply bottom-up but --help lists them top-down: keep the source order.
    return dict(sorted(out.items(), key=lambda kv: kv[1]["line"]))


def _routes(src) -> dict:
    """OpenAIServer.register_routes: path -> {method: handler} from each add_api_route(path,
    handler, methods=[...]); a Mount (the Prometheus app) is kept as `mount` with the
    condition it is registered under (`when`), answering every method at that prefix."""
    tree = ast.parse(src.read(OPENAI_SERVER))
    server = classes(tree)["OpenAIServer"]
    out: dict = {}

    def walk(body: list[ast.stmt], when: str | None):
        for node in body:
            if isinstance(node, ast.If):  # a conditional registration: its test is kept
                walk(node.body, ast.unparse(node.test))
            else:
                calls(node, when)

    def calls(node: ast.stmt, when: str | None):
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            name = ast.unparse(call.func)
            if name == "self.app.add_api_route":
                path = ast.literal_eval(call.args[0])
                methods = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "methods"))
                handler = ast.unparse(call.args[1])
                for method in methods:
                    out.setdefault(path, {"methods": {}})["methods"][method] = {
                        "handler": handler, **({"when": when} if when else {}), **_where(src, OPENAI_SERVER, call.lineno)}
            elif name.startswith("self.") and name.split(".")[-1] in methods_of:
                walk(methods_of[name.split(".")[-1]].body, when)  # e.g. self.mount_metrics()
            elif name == "Mount":
                path = ast.literal_eval(call.args[0])
                out[path] = {"mount": ast.unparse(call.args[1]), "methods": "any",
                             **({"when": when} if when else {}), **_where(src, OPENAI_SERVER, call.lineno)}

    # Only the LLM server's routes: register_mm_encoder_routes is the multimodal-encoder role's.
    methods_of = {n.name: n for n in server.body if isinstance(n, ast.FunctionDef)
                  and n.name not in ("register_routes", "register_mm_encoder_routes")}
    walk(next(n for n in server.body if isinstance(n, ast.FunctionDef) and n.name == "register_routes").body, None)
    return out


def _metrics(src) -> dict:
    """MetricsCollector's Prometheus families: the prefix and, per family (the full name as
    given to prometheus_client: a Counter's given name may already end in _total), its
    kind and label names: the labels OpenAIServer constructs the collector with (model_name,
    engine_type), plus finished_reason where the family uses labels_with_finished_reason."""
    server_tree = ast.parse(src.read(OPENAI_SERVER))
    made = next(n for n in ast.walk(server_tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "MetricsCollector")
    server_labels = list(ast.literal_eval(made.args[0]))
    tree = ast.parse(src.read(COLLECTOR))
    cls = classes(tree)["MetricsCollector"]
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    prefix_node = next(n for n in ast.walk(init) if isinstance(n, ast.Assign)
                       and ast.unparse(n.targets[0]) == "self.metric_prefix")
    prefix = ast.literal_eval(prefix_node.value)
    # Class constants such as labelname_finish_reason = "finished_reason".
    extra = {ast.unparse(n.targets[0]): ast.literal_eval(n.value)
             for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    kinds = {"Counter": "counter", "Histogram": "histogram", "Gauge": "gauge", "Summary": "summary"}
    families = {}
    for call in ast.walk(init):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) in kinds):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        # name=self.metric_prefix + "x": resolve the prefix; anything else must be a literal.
        name_node = kw["name"]
        if (isinstance(name_node, ast.BinOp) and ast.unparse(name_node.left) == "self.metric_prefix"):
            name = prefix + ast.literal_eval(name_node.right)
        else:
            name = ast.literal_eval(name_node)
        labels = list(server_labels)
        if "labels_with_finished_reason" in ast.unparse(kw.get("labelnames", ast.Constant(""))):
            labels.append(extra["labelname_finish_reason"])
        entry = {"kind": kinds[ast.unparse(call.func)], "labels": labels,
                 "documentation": ast.literal_eval(kw["documentation"])}
        if "buckets" in kw:
            entry["buckets"] = ast.literal_eval(kw["buckets"])
        families[name] = {**entry, **_where(src, COLLECTOR, call.lineno)}
    return {"prefix": {"value": prefix, **_where(src, COLLECTOR, prefix_node.lineno)},
            "server_labels": {"labels": server_labels, **_where(src, OPENAI_SERVER, made.lineno)},
            "families": dict(sorted(families.items(), key=lambda kv: kv[1]["line"]))}


def _trtllm_serve(src) -> dict:
    return {"options": _click_options(src), "routes": _routes(src), "metrics": _metrics(src),
            "excerpt_lines": _check_partial(src)}


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
        "trtllm_serve": _trtllm_serve(src),
        "rules": {r["rule"]: r for r in rules},
    }
    about = ("TensorRT-LLM's LLM-API path on Triton. From llm_args.py: speculative_config's decoding_type -> class "
             "map with each class's fields and supports_backend; llm_args, every LLM() argument of the PyTorch "
             "backend (TorchLlmArgs merged with BaseLlmArgs, each field's declared_in, type, default or "
             "default_factory or required, status) and whether extra keys are forbidden; kv_cache_config, "
             "scheduler_config (with its policy enums) and cuda_graph_config fields. From the llmapi Triton model: "
             "config.pbtxt, model.yaml, and what model.py/helpers.py do with them (triton_model_code). And "
             "launch_triton_server.py's flags. trtllm_serve: the `serve` click options of commands/serve.py, the "
             "routes OpenAIServer.register_routes adds (path -> method -> handler; /prometheus/metrics is a Mount "
             "registered only with return_perf_metrics), and MetricsCollector's Prometheus families (full names, "
             "kind, labels); serve.py and openai_server.py are kept up to the definitions read (excerpt_lines). "
             "Each file's commit is under sources.trtllm.files; none is stored at "
             "release 1.2.1, and llm_args.py is a stored version whose commit the index does not report.")
    doc = document(about, sources, facts)
    doc["sources"]["trtllm"]["files"] = {path: src.commit_of(path) for path in FILES}
    return doc
