"""NVIDIA Dynamo 1.6.1: the frontend's and the TensorRT-LLM worker's flags, the Python runtime API a
worker registers through, and the DynamoGraphDeployment fields and examples.

Two sources:
  dynamo_wheel  the installed ai-dynamo / ai-dynamo-runtime 1.6.1 wheels (site-packages; `make dynamo`):
                the flags are read from the argparse parsers upstream builds (frontend: FrontendArgGroup;
                dynamo.trtllm: DynamoRuntimeArgGroup + DynamoTrtllmArgGroup + the router advertisement flags,
                as dynamo/trtllm/args.py parse_args assembles them). backend_args.py imports TensorRT-LLM only
                for three numeric defaults (max_batch_size, max_num_tokens, max_seq_len, max_beam_width), so a
                stand-in module supplies None for them: those defaults are recorded as "from tensorrt_llm".
                The runtime API comes from dynamo/_core.pyi (the binding's own stubs); the DYN_* variables the
                Rust runtime reads are found as strings in dynamo/_core.abi3.so.
  dynamo        ai-dynamo/dynamo on GitHub, files gathered one by one (the repository is too large to clone
                whole; `.commits.json` names each file's commit): the operator's v1alpha1 Go types (json tags of
                DynamoGraphDeploymentSpec, DynamoComponentDeploymentSharedSpec, Resources, ResourceItem,
                ExtraPodSpec) and the trtllm deployment examples.
The JSON names of Kubernetes' own corev1 Container and EnvVar come from the kubernetes Python client
(ai-dynamo's own dependency), whose attribute_map is generated from the same OpenAPI schema.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import yaml

from tools.upstream_facts.common import document

# dynamo: the commit of the operator types file; every file names its own commit (.commits.json).
SOURCES = {"dynamo_wheel": "1.6.1", "dynamo": "00686d64463dceb8718974a481f643cc03dd469e"}

STRUCTS = {  # Go struct -> file under deploy/operator/api/v1alpha1/
    "DynamoGraphDeploymentSpec": "dynamographdeployment_types.go",
    "DynamoComponentDeploymentSharedSpec": "dynamocomponentdeployment_types.go",
    "Resources": "common.go",
    "ResourceItem": "common.go",
    "ExtraPodSpec": "common.go",
}
OPERATOR = "deploy/operator/api/v1alpha1"
EXAMPLES = ["examples/backends/trtllm/deploy/agg_router.yaml", "examples/backends/trtllm/deploy/disagg.yaml"]
ENGINE_CONFIGS = {"prefill": "examples/backends/trtllm/engine_configs/qwen3/prefill.yaml",
                  "decode": "examples/backends/trtllm/engine_configs/qwen3/decode.yaml"}
# Variables the Rust runtime reads (no Python flag declares them): looked up in the binding's binary.
RUNTIME_ENV = ["DYN_FILE_KV", "DYN_TCP_RPC_HOST", "DYN_TCP_RPC_PORT", "DYN_TCP_RESPONSE_STREAM_HOST",
               "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "DYN_SYSTEM_PORT", "DYN_SYSTEM_ENABLED"]
FLAG_FILES = ["dynamo/frontend/frontend_args.py", "dynamo/trtllm/backend_args.py",
              "dynamo/common/configuration/groups/runtime_args.py",
              "dynamo/common/configuration/groups/router_args.py",
              "dynamo/common/configuration/groups/kv_router_args.py",
              "dynamo/common/configuration/groups/ais_perf_args.py",
              "dynamo/common/configuration/groups/http_args.py",
              "dynamo/common/configuration/groups/frontend_decoding_args.py"]


def _wheel_files(root: Path) -> dict[str, str]:
    """path -> sha256 (as RECORD states it) of the files read, so a reader can check the wheel."""
    out = {}
    for dist in ("ai_dynamo-1.6.1.dist-info", "ai_dynamo_runtime-1.6.1.dist-info"):
        record = root / dist / "RECORD"
        if record.is_file():
            for line in record.read_text().splitlines():
                path, digest, _ = (line.split(",") + ["", ""])[:3]
                out[path] = digest
    return out


@contextmanager
def _importable(root: Path):
    """Import the wheel's `dynamo` from `root`, with a stand-in for tensorrt_llm and no DYN_* set."""
    saved_env = {k: v for k, v in os.environ.items() if k.startswith(("DYN_", "NATS_", "ETCD_"))}
    for key in saved_env:
        del os.environ[key]
    stub = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")

    class _Field:
        default = None

    class BuildConfig:  # backend_args reads only model_fields[...].default
        model_fields = {k: _Field() for k in ("max_batch_size", "max_num_tokens", "max_seq_len", "max_beam_width")}

    llmapi.BuildConfig = BuildConfig  # type: ignore[attr-defined]
    stub.llmapi = llmapi  # type: ignore[attr-defined]
    added = {"tensorrt_llm": stub, "tensorrt_llm.llmapi": llmapi}
    sys.modules.update(added)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in added:
            sys.modules.pop(name, None)
        os.environ.update(saved_env)


def _flag_lines(root: Path, first: str) -> dict[str, tuple[str, int]]:
    """flag -> (file, line) of its declaration; `first` is searched before the shared groups (the frontend
    and the worker both declare --namespace, each in its own file)."""
    out: dict[str, tuple[str, int]] = {}
    for rel in [first, *FLAG_FILES]:
        path = root / rel
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r'(?:flag_name=|add_argument\(\s*)"(--[a-z0-9][a-z0-9.-]*)"', line):
                out.setdefault(m.group(1), (rel, i))
    return out


def _json_safe(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def _actions(parser, lines: dict, from_trtllm: set[str]) -> dict[str, dict]:
    import argparse

    out = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        primary = action.option_strings[0]
        help_text = action.help if isinstance(action.help, str) else ""
        env = re.search(r"env var: ([A-Z_][A-Z0-9_]*)", help_text)
        entry: dict = {"dest": action.dest, "aliases": list(action.option_strings[1:]),
                       "takes_value": action.nargs != 0}
        if action.dest in from_trtllm:
            entry["default"] = "from tensorrt_llm"
        else:
            entry["default"] = _json_safe(action.default)
        if action.choices is not None:
            # Sorted: the parser names come from a hash map in the binding, in a new order each run.
            entry["choices"] = sorted(str(c) for c in action.choices)
        if env:
            entry["env_var"] = env.group(1)
        where = lines.get(primary)
        if where:
            entry.update({"source": "dynamo_wheel", "path": where[0], "line": where[1]})
        out[primary] = entry
    return out


def _parsers(root: Path) -> tuple[dict, dict]:
    import argparse

    with _importable(root):
        from dynamo.common.configuration.groups.router_args import register_worker_router_help
        from dynamo.common.configuration.groups.runtime_args import DynamoRuntimeArgGroup
        from dynamo.frontend.frontend_args import FrontendArgGroup
        from dynamo.trtllm.backend_args import DynamoTrtllmArgGroup

        frontend = argparse.ArgumentParser()
        FrontendArgGroup().add_arguments(frontend)
        worker = argparse.ArgumentParser()
        DynamoRuntimeArgGroup().add_arguments(worker)
        DynamoTrtllmArgGroup().add_arguments(worker)
        register_worker_router_help(worker)
    from_trtllm = {"max_batch_size", "max_num_tokens", "max_seq_len", "max_beam_width"}
    return (_actions(frontend, _flag_lines(root, "dynamo/frontend/frontend_args.py"), set()),
            _actions(worker, _flag_lines(root, "dynamo/common/configuration/groups/runtime_args.py"), from_trtllm))


def _stub_api(root: Path) -> dict:
    """Signatures and enum members of dynamo/_core.pyi that a worker uses."""
    rel = "dynamo/_core.pyi"
    tree = ast.parse((root / rel).read_text())
    where = {"source": "dynamo_wheel", "path": rel}

    def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        a = fn.args
        return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg not in ("self", "cls")]

    out: dict = {"functions": {}, "classes": {}}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("register_model",
                                                                                       "compute_block_hash_for_seq"):
            out["functions"][node.name] = {"params": params(node), "async": isinstance(node, ast.AsyncFunctionDef),
                                           **where, "line": node.lineno}
        if isinstance(node, ast.ClassDef) and node.name in ("ModelInput", "ModelType", "WorkerType",
                                                            "KvEventPublisher", "Endpoint", "DistributedRuntime",
                                                            "ModelRuntimeConfig"):
            members = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            methods = {f.name: {"params": params(f), "line": f.lineno} for f in node.body
                       if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_")
                       or isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in ("__init__", "__new__")}
            out["classes"][node.name] = {"members": members, "methods": methods, **where, "line": node.lineno}
    return out


def _runtime_env(root: Path) -> dict:
    rel = "dynamo/_core.abi3.so"
    blob = (root / rel).read_bytes()
    return {name: {"found": name.encode() in blob, "source": "dynamo_wheel", "path": rel} for name in RUNTIME_ENV}


def _metadata(root: Path) -> dict:
    text = (root / "ai_dynamo-1.6.1.dist-info" / "METADATA").read_text()
    requires = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    trtllm = [r for r in requires if r.startswith("tensorrt-llm") and "extra == 'trtllm'" in r]
    return {"requires_dist": [r for r in requires if "extra ==" not in r],
            "trtllm_extra_pin": trtllm[0].split(";")[0].strip() if trtllm else None,
            "source": "dynamo_wheel", "path": "ai_dynamo-1.6.1.dist-info/METADATA"}


def _go_struct(text: str, name: str) -> tuple[int, dict[str, dict]]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"type {name} struct {{", ln))
    fields: dict[str, dict] = {}
    for i in range(start + 1, len(lines)):
        ln = lines[i]
        if ln.startswith("}"):
            break
        m = re.match(r'^\s*(\*?[\w.]+)(?:\s+([\w.*\[\]]+(?:\[[\w.*]+\][\w.*]+)?))?\s+`json:"([^",]*)', ln)
        if not m:
            continue
        go_name, go_type, json_name = m.groups()
        if go_type is None:  # embedded: `*corev1.PodSpec `json:",inline"``
            go_type, go_name = go_name, ""
        key = json_name or ("(inline)" + go_type.lstrip("*"))
        fields[key] = {"go": go_name, "type": go_type, "line": i + 1}
    return start + 1, fields


def _crd(src) -> dict:
    structs = {}
    for name, file in STRUCTS.items():
        rel = f"{OPERATOR}/{file}"
        line, fields = _go_struct(src.read(rel), name)
        structs[name] = {"fields": fields, "source": "dynamo", "path": rel, "commit": src.commit_of(rel),
                         "line": line}
    enum_line = next(i for i, ln in enumerate(src.read(f"{OPERATOR}/{STRUCTS['DynamoGraphDeploymentSpec']}")
                                              .splitlines(), 1) if "validation:Enum=sglang;vllm;trtllm" in ln)
    return {"api_version": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment", "structs": structs,
            "backend_frameworks": {"values": ["sglang", "vllm", "trtllm"], "source": "dynamo",
                                   "path": f"{OPERATOR}/{STRUCTS['DynamoGraphDeploymentSpec']}",
                                   "commit": src.commit_of(f"{OPERATOR}/{STRUCTS['DynamoGraphDeploymentSpec']}"),
                                   "line": enum_line}}


def _examples(src) -> dict:
    out = {}
    for rel in EXAMPLES:
        text = src.read(rel)
        line = next(i for i, ln in enumerate(text.splitlines(), 1) if "dynamo.trtllm" in ln)
        out[Path(rel).name] = {"doc": yaml.safe_load(text), "source": "dynamo", "path": rel,
                               "commit": src.commit_of(rel), "line": line}
    for role, rel in ENGINE_CONFIGS.items():
        text = src.read(rel)
        out[f"engine_{role}"] = {"doc": yaml.safe_load(text), "source": "dynamo", "path": rel,
                                 "commit": src.commit_of(rel), "line": 1}
    return out


def _k8s_container() -> dict:
    from kubernetes import __version__ as k8s_version
    from kubernetes import client

    kinds = {"container": "V1Container", "env_var": "V1EnvVar", "pod_spec": "V1PodSpec", "volume": "V1Volume",
             "volume_mount": "V1VolumeMount", "config_map_volume": "V1ConfigMapVolumeSource",
             "host_path_volume": "V1HostPathVolumeSource", "empty_dir_volume": "V1EmptyDirVolumeSource",
             "config_map": "V1ConfigMap", "object_meta": "V1ObjectMeta"}
    out: dict = {key: sorted(getattr(client, cls).attribute_map.values()) for key, cls in kinds.items()}
    out.update({"package": f"kubernetes=={k8s_version}", "via": "kubernetes.client.<V1 class>.attribute_map"})
    return out


def extract(sources, previous=None):
    wheel = sources["dynamo_wheel"]
    root = Path(wheel.root)
    frontend, worker = _parsers(root)
    facts = {
        "release": {"ai-dynamo": wheel.ref, **_metadata(root)},
        "frontend": {"module": "dynamo.frontend", "flags": frontend},
        "trtllm_worker": {"module": "dynamo.trtllm", "flags": worker,
                          # parse_args expands the deprecated combined flag into the two it replaced.
                          "deprecated": {"--publish-events-and-metrics": ["--publish-kv-events", "--publish-metrics"]},
                          "dynamic_flag_prefix": "--trtllm.", "source": "dynamo_wheel", "path": "dynamo/trtllm/args.py"},
        "runtime_api": _stub_api(root),
        "runtime_env": _runtime_env(root),
        "crd": _crd(sources["dynamo"]),
        "examples": _examples(sources["dynamo"]),
        "kubernetes": _k8s_container(),
    }
    doc = document(__doc__.split("\n\n")[0].replace("\n", " "), sources, facts)
    # A released package, not a checkout: named by version, each file read by the hash its wheel's RECORD states.
    doc["sources"]["dynamo_wheel"].update({"repository": "pypi:ai-dynamo", "version": wheel.ref,
                                           "packages": ["ai-dynamo", "ai-dynamo-runtime"],
                                           "files": {p: d for p, d in _wheel_files(root).items()
                                                     if p in _read_files()}})
    dyn = sources["dynamo"]
    doc["sources"]["dynamo"]["files"] = {rel: dyn.commit_of(rel) for rel in
                                         [f"{OPERATOR}/{f}" for f in sorted(set(STRUCTS.values()))]
                                         + EXAMPLES + list(ENGINE_CONFIGS.values())}
    return doc


def _read_files() -> set[str]:
    return {*FLAG_FILES, "dynamo/_core.pyi", "dynamo/_core.abi3.so", "dynamo/trtllm/args.py",
            "ai_dynamo-1.6.1.dist-info/METADATA"}
