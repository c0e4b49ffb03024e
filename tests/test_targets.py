"""The targets table (toolchain/targets.py) against the spec that names them."""

import os
import re
from pathlib import Path
from typing import get_args

import pytest

from toolchain import pipeline
from toolchain.archs.params import engine_dtype
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec, load_spec
from toolchain.targets import TARGETS, named, target_of
from toolchain.triton.launch import TritonLaunch
from toolchain.triton.server import TritonServer
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]


def test_every_spec_target_has_a_row_and_no_row_is_unreachable():
    assert set(get_args(DeploymentSpec.model_fields["target"].annotation)) == set(TARGETS)


def test_rows_say_what_each_target_is():
    assert [t for t in TARGETS if TARGETS[t].builds_engine] == ["cpu", "trtllm"]
    assert [t for t in TARGETS if TARGETS[t].on_cpu] == ["cpu", "llmapi-cpu"]
    assert named("llmapi", "cpu") == "llmapi-cpu" and named("engine", "gpu") == "trtllm"
    spec = DeploymentSpec(target="llmapi-cpu")
    assert target_of(spec) is TARGETS["llmapi-cpu"] and spec.llmapi_path and spec.on_cpu
    for row in TARGETS.values():
        assert row.default_launch is None or row.default_launch in row.launches
        # one implementation per path: an engine builder on the engine path, an LLM() runtime on the LLM-API path
        assert (row.engine_builder is not None) == row.builds_engine == (row.llm_runtime is None)


def test_rows_carry_what_the_stages_read():
    """What varies with the target is read from its row: the engine builder, dtype narrowing, compute dtype,
    the LLM() runtime and the way it launches on a GPU host (its printer and manifest writer), how mpirun binds
    its ranks, what the memory plan budgets against and how performance is predicted without a GPU, whether it
    serves the OpenAI server too, and which spec fields run replicas."""
    got = {t.name: (t.engine_builder and t.engine_builder.name, t.narrows_float32, t.compute_dtype, t.llm_runtime,
                    t.gpu_launch) for t in TARGETS.values()}
    assert got == {"cpu": ("cpu-engine", False, "float32", None, None),
                   "trtllm": ("trtllm-build", True, None, None, "triton-mpirun"),
                   "llmapi": (None, False, None, "tensorrt_llm", "llmapi-serve"),
                   "llmapi-cpu": (None, False, "float32", "cpu-stand-in", None)}
    got = {t.name: (t.binds_ranks, t.budgets_host_ram, t.predicts_from_host_profile, t.serves_openai,
                    t.replica_fields) for t in TARGETS.values()}
    assert got == {"cpu": (False, True, True, False, ()),
                   "trtllm": (True, False, False, False, ("serving.replicas",)),
                   "llmapi": (True, False, False, True, ("serving.replicas", "dynamo.workers")),
                   "llmapi-cpu": (False, True, True, True, ())}
    # a GPU host launches exactly the GPU targets, and runs their replicas; only trtllm-build narrows float32
    # (TensorRT-LLM infer_dtype)
    assert all((t.gpu_launch is not None) == t.on_gpu == bool(t.replica_fields) for t in TARGETS.values())
    assert engine_dtype("auto", "float32", "trtllm") == "float16" and engine_dtype("auto", "float32", "cpu") == "float32"


# docs/architecture.md, "How to add ... A target": a new row is reached by every place that serves or prints
# a target, so a row the pipeline does not know fails here rather than on a GPU host.
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_row_reaches_server_for_and_the_gpu_launch_printer(name, tmp_path, monkeypatch):
    # target trtllm's server_for finds this host's mpirun and tritonserver (never run here): stand-ins on PATH.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mpirun", "tritonserver"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    row = TARGETS[name]
    overrides = [f"target={name}"] + (["gpu.name=H100 80GB"] if row.on_gpu else [])
    spec = load_spec(REPO / "build" / "tiny-llama.yaml", overrides)
    ws = Workspace(tmp_path / "ws")
    server = pipeline.server_for(spec, ws, read_key=False)
    assert isinstance(server, (TritonLaunch, TritonServer))
    lines: list[str] = []
    if row.gpu_launch is None:
        with pytest.raises(ToolchainError, match=f"target {name} runs on this host: it has no GPU launch lines"):
            pipeline.print_gpu_launch(spec, ws, lines.append)
        assert not row.on_gpu and isinstance(server, TritonServer) or spec.rank_processes
        return
    pipeline.print_gpu_launch(spec, ws, lines.append)
    assert "tritonserver" in "\n".join(lines) and row.on_gpu
    paths = pipeline.write_manifests(spec, ws, tmp_path / "manifests")
    assert paths and all(p.is_file() for p in paths)


def test_the_how_to_add_a_target_recipe_names_files_and_tests_that_exist():
    """docs/architecture.md's "A target" recipe lists the files to touch: each exists, and each test it names
    is in tests/test_targets.py."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    recipe = doc[doc.index("**A target**"):].split("\n\n")[0]
    files = re.findall(r"`((?:toolchain|tests)/[\w/]+\.py)`", recipe)
    assert "toolchain/targets.py" in files and "tests/test_targets.py" in files
    assert all((REPO / f).is_file() for f in files), files
    tests = re.findall(r"`(test_\w+)`", recipe)
    assert tests and all(f"def {t}(" in Path(__file__).read_text() for t in tests)
    fields = set(re.findall(r"`(\w+)`", recipe))
    assert {"engine_builder", "llm_runtime", "narrows_float32", "compute_dtype", "gpu_launch"} <= fields
