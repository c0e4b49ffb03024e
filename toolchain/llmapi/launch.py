"""Launch lines of the LLM-API path.

Target llmapi (a GPU host with TensorRT-LLM 1.2.1):

* `trtllm-serve MODEL --host H --port P --extra_llm_api_options FILE`: the OpenAI server; FILE
  (model_repo/<name>/trtllm-serve.yaml) holds the same LLM() arguments as model.yaml.
* Triton: upstream's launcher (`launch_triton_server.py`) on the rendered repository. On this path
  one tritonserver process runs `LLM()`, which starts its own worker per TP/PP rank, so on one host
  the launcher runs with world size 1.
* Several hosts (tp x pp above gpu.per_node): one Slurm task per GPU under
  `srun --mpi=pmix`, each running `trtllm-llmapi-launch` in front of the server. That wrapper runs
  the server on rank 0 and an MPI worker on every other rank, which is how LLM() finds GPUs on
  other hosts (upstream's launcher puts the same prefix in front of tritonserver: fact
  rules.llmapi_launch_prefix).

Target llmapi-cpu: the tritonserver this host runs and the CPU OpenAI server.

Every launcher flag is looked up in the facts read from upstream (facts/llmapi.json launch_flags)
before it is emitted, and every trtllm-serve option in trtllm_serve.options.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from toolchain import upstream
from toolchain.spec import DeploymentSpec
from toolchain.targets import target_of
from toolchain.triton import cluster, exposure
from toolchain.triton.cluster import ALL_INTERFACES, multi_node, node_count, pyxis_image, tasks_per_node, world_size
from toolchain.triton.endpoints import endpoints
from toolchain.workspace import Workspace
from toolchain.llmapi.stage import served_model_dir
from toolchain.triton.server import TritonServer

__all__ = ["ALL_INTERFACES", "multi_node", "node_count", "pyxis_image", "tasks_per_node", "world_size"]

SERVE_CONFIG = "trtllm-serve.yaml"
LAUNCHER = "triton_backend/scripts/launch_triton_server.py"  # in a TensorRT-LLM 1.2.1 checkout
LLMAPI_LAUNCH = "trtllm-llmapi-launch"  # tensorrt_llm/llmapi/trtllm-llmapi-launch, on PATH in the image
TRTLLM_SERVE = "trtllm-serve"

# The LLM() argument YAML option. Upstream's 1.2-line serve.py declares it as
# click.option("--config", "--extra_llm_api_options", "extra_llm_api_options"): --config is the newer
# alias (NVIDIA/TensorRT-LLM#9104); --extra_llm_api_options is the name every 1.x release has, so it
# is the one emitted.
SERVE_CONFIG_OPTION = "--extra_llm_api_options"


# tritonserver arguments that upstream's launcher gives rank 0 (launch_triton_server.py get_cmd);
# the multi-host Triton line runs tritonserver directly, so it repeats them.
_SHM_PREFIX = "--backend-config=python,shm-region-prefix-name=prefix0_"


def launch_flag(name: str) -> str:
    """`name` if upstream's launcher declares it (facts launch_flags); a LookupError otherwise,
    which is a bug here, not a user error."""
    if name not in upstream.facts("llmapi")["launch_flags"]:
        raise LookupError(f"launch_triton_server.py has no flag {name} (facts/llmapi.json launch_flags)")
    return name


def serve_options() -> dict[str, dict]:
    """Every name trtllm-serve's `serve` command accepts (aliases included) -> its upstream entry
    (facts/llmapi.json trtllm_serve.options, read from tensorrt_llm/commands/serve.py)."""
    out = {}
    for name, entry in upstream.facts("llmapi")["trtllm_serve"]["options"].items():
        for n in (name, *entry["aliases"]):
            out[n] = entry
    return out


def serve_option(name: str) -> str:
    """`name` if upstream's trtllm-serve declares it; a LookupError otherwise, which is a bug here."""
    if name not in serve_options():
        raise LookupError(f"trtllm-serve has no option {name} (facts/llmapi.json trtllm_serve.options)")
    return name


def serve_config_path(spec: DeploymentSpec, workspace: Workspace) -> Path:
    """Where model-repo writes the trtllm-serve config: beside the Triton models (tritonserver
    ignores plain files at the repository root)."""
    return workspace.model_repo_dir(spec) / SERVE_CONFIG


def served_model_name(spec: DeploymentSpec) -> str:
    return spec.llmapi.served_model_name or spec.name


# -- command lines -------------------------------------------------------------------------------------------


def trtllm_serve_command(spec: DeploymentSpec, workspace: Workspace, host: str | None = None) -> list[str]:
    """trtllm-serve on the served checkpoint with the rendered LLM() arguments (no prefix)."""

    return [TRTLLM_SERVE, str(served_model_dir(spec, workspace)),
            serve_option("--host"), host or endpoints(spec).openai.bind,
            serve_option("--port"), str(endpoints(spec).openai.port),
            serve_option(SERVE_CONFIG_OPTION), str(serve_config_path(spec, workspace)), *parser_options(spec)]


def parser_options(spec: DeploymentSpec) -> list[str]:
    """--tool_parser / --reasoning_parser as the spec sets them (llmapi.tool_parser, llmapi.reasoning_parser):
    trtllm-serve's options, which the CPU OpenAI server takes under the same names."""
    out = []
    for option, value in (("--tool_parser", spec.llmapi.tool_parser), ("--reasoning_parser", spec.llmapi.reasoning_parser)):
        if value is not None:
            out += [serve_option(option), value]
    return out


def triton_launch_command(spec: DeploymentSpec, workspace: Workspace) -> list[str]:
    """Upstream's launcher, one host. World size 1: LLM() inside the one tritonserver spawns the
    TP/PP workers itself; a launcher world size above 1 would start that many servers.

    Off loopback the launcher cannot pass the address and restricted-API options (it forwards no
    tritonserver arguments), so the line is the command it would run for world size 1
    (`mpirun --allow-run-as-root -n 1 <tritonserver ...>`, get_cmd) with them added."""
    if exposure.restricted(spec.serving):
        return ["mpirun", "--allow-run-as-root", "-n", "1", *tritonserver_command(spec, workspace)]
    ports = endpoints(spec).triton.ports
    return ["python3", LAUNCHER, f"{launch_flag('--model_repo')}={workspace.model_repo_dir(spec)}",
            f"{launch_flag('--world_size')}=1",
            *(f"{launch_flag(f'--{kind}_port')}={port}" for kind, port in ports.items())]


def tritonserver_command(spec: DeploymentSpec, workspace: Workspace, bind: str | None = None) -> list[str]:
    """The tritonserver argument list upstream's launcher builds for rank 0 (get_cmd): the repository,
    the ports, no auto-complete (the rendered config is the whole truth), its own shared-memory prefix.
    Off loopback also the bind addresses (metrics on loopback unless asked) and the administrative APIs
    behind the key, exposure.PLACEHOLDER standing for it until the line is printed. `bind`: the address
    every endpoint binds (a container's, which publishes the ports on the spec's addresses); the key
    still follows the spec."""
    triton = endpoints(spec).triton
    binary = upstream.facts("llmapi")["launch_flags"][launch_flag("--tritonserver")]["default"]
    argv = [binary, f"--model-repository={workspace.model_repo_dir(spec)}", f"--grpc-port={triton.grpc.port}",
            f"--http-port={triton.http.port}", f"--metrics-port={triton.metrics.port}",
            "--disable-auto-complete-config", _SHM_PREFIX]
    if bind is not None or exposure.restricted(spec.serving):
        binds = triton.binds if bind is None else dict.fromkeys(triton.binds, bind)
        argv += [f"--{kind}-address={host}" for kind, host in binds.items()]
    if exposure.restricted(spec.serving):
        argv += exposure.restriction_args(exposure.PLACEHOLDER)
    return argv


def printable(spec: DeploymentSpec, argv: list[str]) -> str:
    """A command line to print: the admin key (if any) as a shell reference, never the secret."""
    return shlex.join(argv).replace(exposure.PLACEHOLDER, exposure.shell_reference(spec.serving))


def container_mounts(spec: DeploymentSpec, workspace: Workspace) -> list[str]:
    """Host paths the server reads, mounted at the same place so the absolute paths in model.yaml and
    trtllm-serve.yaml hold inside the container (on several hosts: a shared filesystem)."""

    paths = {served_model_dir(spec, workspace), Path(workspace.model_repo_dir(spec)).resolve()}
    if spec.model.tokenizer is not None:
        paths.add(Path(spec.model.tokenizer).resolve())
    # trtllm-serve reads an adapter from the lora_path a request names, on the server's filesystem.
    paths.update(Path(p).resolve() for p in spec.lora.adapters.values())
    return sorted(str(p) for p in paths)


def lora_requests(spec: DeploymentSpec) -> dict[str, dict]:
    """Each adapter's `lora_request` body field, the one way trtllm-serve 1.2 picks an adapter per request
    (tensorrt_llm/serve/openai_server.py @0c8de69 passes request.lora_request to generate_async; the field is
    executor/request.py's LoRARequest): lora_int_id is the adapter's place in lora.adapters, from 1."""
    return {name: {"lora_name": name, "lora_int_id": spec.lora.task_id(name), "lora_path": str(Path(path).resolve())}
            for name, path in spec.lora.adapters.items()}


def srun_command(spec: DeploymentSpec, workspace: Workspace, *, container: bool = True) -> list[str]:
    """srun with one task per rank over the hosts the world needs (PMIx, so trtllm-llmapi-launch
    and mpi4py see one MPI world), in the pinned image through pyxis when `container`."""
    return cluster.srun_command(spec, container_mounts(spec, workspace), container=container)


def multi_node_serve_command(spec: DeploymentSpec, workspace: Workspace, *, container: bool = True) -> list[str]:
    """trtllm-serve across hosts: every rank runs trtllm-llmapi-launch, which serves on rank 0."""
    return [*srun_command(spec, workspace, container=container), LLMAPI_LAUNCH,
            *trtllm_serve_command(spec, workspace, host=ALL_INTERFACES)]


def multi_node_triton_command(spec: DeploymentSpec, workspace: Workspace, *, container: bool = True) -> list[str]:
    """tritonserver across hosts, as upstream's launcher does with --trtllm_llmapi_launch (the prefix
    right before tritonserver, rules.llmapi_launch_prefix), but under srun instead of mpirun."""
    return [*srun_command(spec, workspace, container=container), LLMAPI_LAUNCH,
            *tritonserver_command(spec, workspace)]


def gpu_launch_lines(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str]:
    """The lines `toolchain serve --print` shows for target llmapi: trtllm-serve and Triton, plus the
    srun forms when the world spans several hosts."""
    lines = {"trtllm_serve": shlex.join(trtllm_serve_command(spec, workspace)),
             "triton": printable(spec, triton_launch_command(spec, workspace))}
    if multi_node(spec):
        lines["trtllm_serve_multi_node"] = shlex.join(multi_node_serve_command(spec, workspace))
        lines["triton_multi_node"] = printable(spec, multi_node_triton_command(spec, workspace))
    return lines


def openai_engine_args(spec: DeploymentSpec) -> tuple[str, ...]:
    """The OpenAI server's engine flags: the CPU engine stepped with the torch threads Triton's llmapi
    model gets (serving.engine_threads, a config.pbtxt parameter there), not torch's default of every core,
    which on a small host also takes the core the server's event loop needs; and spec.lora.adapters as
    `--lora-adapter NAME=DIR` in spec order (lora_int_id 1..N), served by `model` name. They are flags, not keys
    of the --config YAML, which is trtllm-serve's own and forbids keys LLM() does not know."""
    adapters = [arg for name, path in spec.lora.adapters.items()
                for arg in ("--lora-adapter", f"{name}={Path(path).resolve()}")]
    return ("--engine-threads", str(spec.serving.engine_threads), *adapters)


def openai_cpu_command(spec: DeploymentSpec, workspace: Workspace) -> list[str]:
    """The OpenAI server's line for this host, with this interpreter (the venv's), as serve and deploy start it:
    a bare `python` is another interpreter, without the toolchain, until the venv is activated."""
    return [sys.executable, "-m", "toolchain.openai", str(served_model_dir(spec, workspace)),
            "--config", str(serve_config_path(spec, workspace)), "--served-model-name", served_model_name(spec),
            "--host", endpoints(spec).openai.bind, "--port", str(endpoints(spec).openai.port),
            *openai_engine_args(spec), *parser_options(spec)]


def planned_launch(spec: DeploymentSpec, workspace: Workspace) -> dict:
    """The launch lines `toolchain plan` prints."""
    if target_of(spec).gpu_launch is not None:  # launched on a GPU host; else this host's CPU stand-in
        triton = (multi_node_triton_command if multi_node(spec) else triton_launch_command)(spec, workspace)
        serve = (multi_node_serve_command if multi_node(spec) else trtllm_serve_command)(spec, workspace)
    else:
        line = TritonServer.from_spec(spec, workspace.model_repo_dir(spec)).command_line()
        triton = shlex.split(line) if isinstance(line, str) else line
        serve = openai_cpu_command(spec, workspace)
    return {"launch_command": printable(spec, triton), "openai_command": shlex.join(serve)}
