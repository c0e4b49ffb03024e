"""Dynamo on GPU hosts, without a GPU: the command lines and the DynamoGraphDeployment rendered for target llmapi,
held against what Dynamo 1.6.1 itself declares (toolchain/upstream/facts/dynamo.json: the frontend's and
dynamo.trtllm's argparse flags, the operator's v1alpha1 Go types, Dynamo's trtllm examples, Kubernetes' own
field names) and, where Dynamo is installed, parsed by Dynamo's own argument parsers. Also the refused spec
combinations and the one-line error when Dynamo is missing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from toolchain import upstream
from toolchain.dynamo import checks, install, manifests, render
from toolchain.errors import ToolchainError
from toolchain.llmapi.args import serve_config
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "build" / "tiny-llama-dynamo.yaml"
UP = upstream.facts("dynamo")


def gpu_spec(*overrides: str):
    # The shipped spec's port (8090) is for this host; the operator serves the frontend on 8000.
    return load_spec(SPEC, ["target=llmapi", "parallelism.tp=2", "dynamo.http_port=8000", *overrides])


@pytest.fixture
def ws(tmp_path) -> Workspace:
    return Workspace(tmp_path)


def _flags(argv: list[str], module: str) -> list[str]:
    start = argv.index(module) + 1
    return [a for a in argv[start:] if a.startswith("--")]


def _known(section: str) -> set[str]:
    flags = UP[section]["flags"]
    return {n for flag, e in flags.items() for n in (flag, *e["aliases"])}


# -- facts ---------------------------------------------------------------------------------------------------


def test_facts_record_the_release_and_what_the_toolchain_relies_on():
    assert UP["release"]["ai-dynamo"] == "1.6.1"
    # ai-dynamo pins aisimulate (which cannot install here): why `make dynamo` installs it without its deps.
    assert any(r.startswith("aisimulate==") for r in UP["release"]["requires_dist"])
    assert UP["release"]["trtllm_extra_pin"].startswith("tensorrt-llm==")
    front = UP["frontend"]["flags"]
    assert "kv" in front["--router-mode"]["choices"] and "round-robin" in front["--router-mode"]["choices"]
    assert front["--router-mode"]["env_var"] == "DYN_ROUTER_MODE"
    assert front["--discovery-backend"]["choices"] == ["etcd", "file", "kubernetes", "mem"]
    worker = UP["trtllm_worker"]["flags"]
    assert worker["--model"]["aliases"] == ["--model-path"]
    assert {"prefill", "decode", "agg"} <= set(worker["--disaggregation-mode"]["choices"])
    assert worker["--publish-kv-events"]["takes_value"] is False
    api = UP["runtime_api"]
    assert {"model_input", "model_type", "endpoint", "model_path", "worker_type", "kv_cache_block_size"} <= set(
        api["functions"]["register_model"]["params"])
    assert {"Tokens", "Text"} <= set(api["classes"]["ModelInput"]["members"])
    assert {"Chat", "Completions"} <= set(api["classes"]["ModelType"]["members"])
    publisher = api["classes"]["KvEventPublisher"]["methods"]
    assert publisher["publish_stored"]["params"][:4] == ["token_ids", "num_block_tokens", "block_hashes", "parent_hash"]
    assert publisher["publish_removed"]["params"] == ["block_hashes"]
    assert all(e["found"] for e in UP["runtime_env"].values())
    shared = UP["crd"]["structs"]["DynamoComponentDeploymentSharedSpec"]["fields"]
    assert {"componentType", "subComponentType", "replicas", "resources", "envs", "extraPodSpec"} <= set(shared)


def test_the_installed_dynamo_is_the_one_the_facts_were_read_from():
    pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
    import importlib.metadata

    assert importlib.metadata.version("ai-dynamo") == UP["release"]["ai-dynamo"]


# -- GPU commands --------------------------------------------------------------------------------------------


def test_aggregated_commands_use_only_declared_flags(ws):
    spec = gpu_spec()
    lines = render.gpu_commands(spec, ws)
    assert len(lines) == 1 + spec.dynamo.workers
    front = shlex.split(lines[0].rstrip(" &"))
    assert set(_flags(front, "dynamo.frontend")) <= _known("frontend")
    assert front[front.index("--router-mode") + 1] == "kv"
    for i, line in enumerate(lines[1:]):
        env, *argv = shlex.split(line.rstrip(" &"))
        assert env == f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}"  # tp 2: two GPUs per worker, in turn
        assert set(_flags(argv, "dynamo.trtllm")) <= _known("trtllm_worker")
        # The same LLM-API YAML trtllm-serve takes, written by `toolchain model-repo`.
        assert argv[argv.index("--extra-engine-args") + 1] == str(ws.model_repo_dir(spec) / "trtllm-serve.yaml")
        assert "--publish-kv-events" in argv and "--disaggregation-mode" not in argv


def test_disaggregated_workers_take_dynamos_prefill_and_decode_keys(ws):
    spec = gpu_spec("dynamo.disaggregated=true", "dynamo.prefill_workers=2", "dynamo.decode_workers=1")
    groups = {g.role: g for g in render.worker_groups(spec, ws)}
    assert set(groups) == {"prefill", "decode"} and groups["prefill"].replicas == 2
    examples = UP["examples"]
    for role, group in groups.items():
        argv = group.argv
        assert argv[argv.index("--disaggregation-mode") + 1] == role
        override = json.loads(argv[argv.index("--override-engine-args") + 1])
        example = examples[f"engine_{role}"]["doc"]
        assert override == {k: example[k] for k in render.DISAGG_KEYS}
    assert render.gpus_needed(spec) == 3 * 2
    assert len(render.gpu_commands(spec, ws)) == 1 + 3


def test_rendered_commands_parse_with_dynamos_own_parsers(ws, monkeypatch):
    pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
    from dynamo_helpers import dynamo_parsers

    spec = gpu_spec("dynamo.disaggregated=true")
    with dynamo_parsers(monkeypatch) as (front, worker):
        argv = render.frontend_command(spec)
        parsed = front.parse_args(argv[3:])
        assert (parsed.router_mode, parsed.http_port, parsed.discovery_backend) == ("kv", spec.dynamo.http_port, "file")
        for group in render.worker_groups(spec, ws):
            parsed = worker.parse_args(group.argv[3:])
            assert parsed.disaggregation_mode == group.role and parsed.publish_kv_events is True
            assert json.loads(parsed.override_engine_args) == group.overrides


# -- Kubernetes ----------------------------------------------------------------------------------------------


def _check_fields(node: dict, allowed: set[str], where: str) -> None:
    unknown = set(node) - allowed
    assert not unknown, f"{where}: {sorted(unknown)} not declared"


def test_graph_deployment_fields_are_the_operators_and_kubernetes(ws):
    crd, k8s = UP["crd"], UP["kubernetes"]
    structs = {name: set(s["fields"]) for name, s in crd["structs"].items()}
    for overrides in ((), ("dynamo.disaggregated=true",)):
        doc = manifests.graph_deployment(gpu_spec(*overrides), ws)
        assert (doc["apiVersion"], doc["kind"]) == (crd["api_version"], crd["kind"])
        _check_fields(doc["spec"], structs["DynamoGraphDeploymentSpec"], "spec")
        assert doc["spec"]["backendFramework"] in crd["backend_frameworks"]["values"]
        for name, svc in doc["spec"]["services"].items():
            _check_fields(svc, structs["DynamoComponentDeploymentSharedSpec"], name)
            pod = svc["extraPodSpec"]
            _check_fields(pod, {"mainContainer"} | set(k8s["pod_spec"]), f"{name}.extraPodSpec")
            _check_fields(pod["mainContainer"], set(k8s["container"]), f"{name}.mainContainer")
            for env in svc.get("envs", []):
                _check_fields(env, set(k8s["env_var"]), f"{name}.envs")
            if "resources" in svc:
                _check_fields(svc["resources"], structs["Resources"], f"{name}.resources")
                _check_fields(svc["resources"]["limits"], structs["ResourceItem"], f"{name}.limits")
            for vol in pod.get("volumes", []):
                _check_fields(vol, set(k8s["volume"]), f"{name}.volumes")
            for mount in pod["mainContainer"].get("volumeMounts", []):
                _check_fields(mount, set(k8s["volume_mount"]), f"{name}.volumeMounts")


def test_graph_deployment_is_laid_out_as_dynamos_examples(ws):
    """Component types, the router variable, the worker command: as in examples/backends/trtllm/deploy."""
    agg_example = UP["examples"]["agg_router.yaml"]["doc"]["spec"]["services"]
    disagg_example = UP["examples"]["disagg.yaml"]["doc"]["spec"]["services"]
    doc = manifests.graph_deployment(gpu_spec(), ws)["spec"]["services"]
    assert doc["Frontend"]["componentType"] == agg_example["Frontend"]["componentType"] == "frontend"
    assert {"name": "DYN_ROUTER_MODE", "value": "kv"} in doc["Frontend"]["envs"]
    assert agg_example["Frontend"]["envs"][0] == {"name": "DYN_ROUTER_MODE", "value": "kv"}
    worker = doc["TRTLLMWorker"]
    example_worker = agg_example["TRTLLMWorker"]
    assert worker["componentType"] == example_worker["componentType"] == "worker"
    assert worker["replicas"] == 2 and worker["resources"]["limits"]["gpu"] == "2"
    main = worker["extraPodSpec"]["mainContainer"]
    assert main["command"] == example_worker["extraPodSpec"]["mainContainer"]["command"]
    assert main["args"][main["args"].index("--extra-engine-args") + 1] == "/config/engine-args.yaml"
    assert set(_flags(["dynamo.trtllm", *main["args"]], "dynamo.trtllm")) <= _known("trtllm_worker")
    disagg = manifests.graph_deployment(gpu_spec("dynamo.disaggregated=true"), ws)["spec"]["services"]
    example_roles = {s.get("subComponentType") for s in disagg_example.values()} - {None}
    assert {s.get("subComponentType") for s in disagg.values()} - {None} == example_roles == {"prefill", "decode"}


def test_manifests_are_written_atomically_and_the_config_map_holds_the_llmapi_yaml(ws, tmp_path):
    spec = gpu_spec()
    out = tmp_path / "k8s"
    paths = manifests.write_manifests(spec, ws, out)
    assert sorted(p.name for p in paths) == sorted(manifests.FILES.values())
    cm = yaml.safe_load((out / manifests.FILES["config"]).read_text())
    assert yaml.safe_load(cm["data"][manifests.ENGINE_ARGS]) == serve_config(spec)
    graph = yaml.safe_load((out / manifests.FILES["graph"]).read_text())
    volumes = graph["spec"]["services"]["TRTLLMWorker"]["extraPodSpec"]["volumes"]
    assert {"name": "engine-args", "configMap": {"name": cm["metadata"]["name"]}} in volumes
    (out / "stray.txt").write_text("x")
    with pytest.raises(ToolchainError, match="holds other files"):
        manifests.write_manifests(spec, ws, out)


# -- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (("target=cpu",), "engine path"),
    (("build.kv_cache_reuse=false",), "kv_cache_reuse"),
    (("dynamo.disaggregated=true",), "KV-cache transfer"),
    (("target=llmapi", "parallelism.tp=8", "gpu.per_node=4"), "spans hosts"),
    (("llmapi.options={tensor_parallel_size: 2}",), "parallelism.tp"),
    # A beta argument of 1.2.1 may differ in the TensorRT-LLM Dynamo 1.6.1 runs (1.3.0rc29).
    (("target=llmapi", "llmapi.options={cuda_graph_config: {max_batch_size: 8}}"), "1.3.0rc29"),
])
def test_bad_combinations_fail_in_one_line(overrides, needle):
    spec = load_spec(SPEC, list(overrides))
    with pytest.raises(ToolchainError) as err:
        checks.check(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_graph_deployment_refuses_a_port_the_operator_does_not_serve(ws):
    """The operator runs the frontend on its fixed port 8000 (container port, DYN_HTTP_PORT, Service, probes):
    a DynamoGraphDeployment for another dynamo.http_port is refused, not rendered as if it were honoured."""
    assert manifests.graph_deployment(gpu_spec(), ws)["spec"]["services"]["Frontend"]
    for port in (9000, 8090, 0):
        with pytest.raises(ToolchainError) as err:
            manifests.graph_deployment(gpu_spec(f"dynamo.http_port={port}"), ws)
        assert f"dynamo.http_port {port}" in str(err.value) and "8000" in err.value.hint and "\n" not in str(err.value)
    # The shell lines for GPU hosts honour it (--http-port).
    argv = render.frontend_command(gpu_spec("dynamo.http_port=9000"))
    assert argv[argv.index("--http-port") + 1] == "9000"


def test_engine_args_for_the_release_dynamo_runs_keep_committed_and_dynamo_set_keys():
    """Dynamo 1.6.1 runs TensorRT-LLM 1.3.0rc29: the YAML keeps committed LLM() arguments and the keys Dynamo's worker
    and its disaggregated configs set themselves, on target llmapi only (llmapi-cpu runs the CPU stand-in)."""
    llm = upstream.facts("llmapi")["llm_args"]["fields"]
    for overrides in ((), ("dynamo.disaggregated=true",), ("llmapi.options={kv_cache_config: {enable_partial_reuse: "
                                                          "false}, enable_attention_dp: false}",)):
        assert checks.runtime_release_problem(gpu_spec(*overrides)) is None
    # The defaults the toolchain writes include non-committed keys only where Dynamo sets them itself.
    derived = serve_config(gpu_spec())
    assert {k for k in derived if llm[k].get("status")} <= checks.DYNAMO_WORKER_KEYS
    cpu = load_spec(SPEC, ["llmapi.options={cuda_graph_config: {max_batch_size: 8}}"])
    assert cpu.target == "llmapi-cpu" and checks.problems(cpu) == []


def test_missing_dynamo_is_one_line_naming_make_dynamo(monkeypatch, capsys):
    import importlib.metadata

    from toolchain.cli import main

    def absent(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(install, "_version", absent)
    rc = main(["dynamo", str(SPEC), "--set", "dynamo.http_port=0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "not installed" in err and "make dynamo" in err and "--no-deps" in err


def test_cli_prints_gpu_lines_and_refuses_manifests_off_llmapi(tmp_path, capsys):
    from toolchain.cli import main

    assert main(["--root", str(tmp_path), "dynamo", str(SPEC), "--set", "target=llmapi", "--print"]) == 0
    out = capsys.readouterr().out
    assert "python3 -m dynamo.frontend" in out and out.count("python3 -m dynamo.trtllm") == 2
    assert main(["dynamo", str(SPEC), "--manifests", str(tmp_path / "m")]) == 2
    assert "--manifests is for target llmapi" in capsys.readouterr().err
