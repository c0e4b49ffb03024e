"""LoRA in the rendered model repository: the tensorrt_llm model's lora_cache_* parameters from spec.lora.cache and
lora_prefetch_dir naming the adapters convert wrote, on both engine-path targets, read by the C++ backend's rules
(backend_params) as a GPU host reads them; the ensemble and the BLS carry lora_task_id / lora_weights / lora_config
to tensorrt_llm as upstream's do."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from test_upstream_triton_conformance import as_triton_json
from test_upstream_triton_conformance import render as render_repo
from toolchain.spec import load_spec
from toolchain.triton import backend_models, backend_params
from toolchain.upstream import facts
from toolchain.workspace import Workspace

LORA_PARAMS = ("lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction",
               "lora_cache_host_memory_bytes", "lora_prefetch_dir")
LORA_INPUTS = ("lora_task_id", "lora_weights", "lora_config")


def render(tmp_path: Path, target: str, **sections) -> tuple[dict[str, pb.ModelConfig], Workspace, object]:
    configs = render_repo(tmp_path, target, **sections)
    return configs, Workspace(tmp_path / "ws"), load_spec(tmp_path / "spec.yaml")


def params(cfg: pb.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def adapter_dir(tmp_path: Path) -> Path:
    """The spec loader does not read adapters and model-repo renders from the spec alone: a directory suffices."""
    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.parametrize("target", ["trtllm", "cpu"])
def test_cache_parameters_and_prefetch_dir_reach_tensorrt_llm(tmp_path, target):
    cache = {"optimal_adapter_size": 16, "max_adapter_size": 32, "gpu_memory_fraction": 0.1,
             "host_memory_bytes": 1 << 28}
    configs, ws, spec = render(tmp_path, target, lora={"adapters": {"a": str(adapter_dir(tmp_path))}, "cache": cache})
    model = configs["tensorrt_llm"]
    got = params(model)
    assert set(LORA_PARAMS) <= set(facts("model_templates")["models"]["tensorrt_llm"]["parameters"])
    assert {k: got[k] for k in LORA_PARAMS} == {
        "lora_cache_optimal_adapter_size": "16", "lora_cache_max_adapter_size": "32",
        "lora_cache_gpu_memory_fraction": "0.1", "lora_cache_host_memory_bytes": str(1 << 28),
        "lora_prefetch_dir": str(ws.lora_dir(spec).resolve())}
    assert Path(got["lora_prefetch_dir"]).is_absolute()
    # What the C++ backend (and the CPU stand-in, which reads by the same rules) makes of them.
    values = backend_params.read(as_triton_json(model))
    assert (values["lora_cache_optimal_adapter_size"], values["lora_cache_max_adapter_size"],
            values["lora_cache_gpu_memory_fraction"], values["lora_cache_host_memory_bytes"]) == (16, 32, 0.1, 1 << 28)
    assert values["lora_prefetch_dir"] == str(ws.lora_dir(spec).resolve())


def test_unset_cache_values_leave_the_backend_defaults(tmp_path):
    # The engine built for adapters sent per request: no prefetch dir; the fraction unset is the backend's 0.05.
    lora = {"target_modules": ["attn_q"], "max_lora_rank": 8}
    configs, _, _ = render(tmp_path / "cpu", "cpu", lora=lora)
    got = params(configs["tensorrt_llm"])
    assert "lora_prefetch_dir" not in got and "lora_cache_gpu_memory_fraction" not in got
    assert got["lora_cache_host_memory_bytes"] == str(1 << 30) and got["lora_cache_optimal_adapter_size"] == "8"
    config = as_triton_json(configs["tensorrt_llm"])
    config["parameters"]["lora_prefetch_dir"] = {"string_value": "${lora_prefetch_dir}"}  # upstream's unfilled
    values = backend_params.read(config)
    assert values["lora_cache_gpu_memory_fraction"] is None  # std::nullopt: PeftCacheManagerConfig's 0.05
    assert backend_params.is_unset(values["lora_prefetch_dir"], "lora_prefetch_dir")
    configs, _, _ = render(tmp_path / "trt", "trtllm", lora=lora)
    assert params(configs["tensorrt_llm"])["lora_cache_gpu_memory_fraction"] == "0.05"  # TRITON_DEFAULTS


def test_ensemble_and_bls_carry_the_lora_inputs_to_tensorrt_llm(tmp_path):
    configs, _, _ = render(tmp_path, "cpu", lora={"adapters": {"a": str(adapter_dir(tmp_path))}})
    templates = facts("model_templates")["models"]

    def declared(cfg, name):
        [t] = [t for t in cfg.input if t.name == name]
        return pb.DataType.Name(t.data_type), list(t.dims), t.optional

    for model in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm"):
        upstream = {t["name"]: t for t in templates[model]["inputs"]}
        for name in LORA_INPUTS:
            dtype, dims, optional = declared(configs[model], name)
            assert (dtype, dims, optional) == (upstream[name]["data_type"], upstream[name]["dims"], True), (model, name)
    [step] = [s for s in configs["ensemble"].ensemble_scheduling.step if s.model_name == "tensorrt_llm"]
    assert all(step.input_map[name] == name for name in LORA_INPUTS)
    # The BLS sends each to tensorrt_llm under its own name (triton_decoder.py _get_llm_tensors' name_map).
    tree = ast.parse(backend_models.source("tensorrt_llm_bls").read_text())
    [passthrough] = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", None) == "PASSTHROUGH"]
    assert all(passthrough[name] == name for name in LORA_INPUTS)
