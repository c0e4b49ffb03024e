"""The command line upstream's launcher gives tritonserver, rank by rank.

triton_backend/scripts/launch_triton_server.py is loaded (not as __main__) and
its `get_cmd` called for one and two ranks with the launcher's own defaults,
so the facts are the argv upstream itself would run, split at the `:` that
separates mpirun's per-rank segments.
"""

from __future__ import annotations

import argparse
import types

from tools.upstream_facts.common import document, line_of

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PATH = "triton_backend/scripts/launch_triton_server.py"
REPO = "/models"


def _segments(argv: list[str]) -> list[list[str]]:
    out, cur = [], []
    for arg in argv:
        if arg == ":":
            out.append(cur)
            cur = []
        else:
            cur.append(arg)
    if cur:
        out.append(cur)
    return out


def extract(sources, previous=None):
    src = sources["trtllm"]
    text = src.read(PATH)
    module = types.ModuleType("launch_triton_server")
    exec(compile(text, PATH, "exec"), module.__dict__)  # defines functions only; __name__ is not __main__
    # get_cmd reads the global `args` for the multi-model options; plain serving leaves them off.
    module.args = argparse.Namespace(multi_model=False, disable_spawn_processes=False)
    defaults = {"tritonserver": "/opt/tritonserver/bin/tritonserver", "grpc_port": "8001", "http_port": "8000",
                "metrics_port": "8002", "model_repo": REPO, "log": False, "log_file": "triton_log.txt",
                "tensorrt_llm_model_name": "tensorrt_llm", "oversubscribe": False,
                "multimodal_gpu0_cuda_mem_pool_bytes": 0, "no_mpi": False, "trtllm_llmapi_launch": False}
    commands = {}
    for world in (1, 2):
        argv = module.get_cmd(world, **defaults)
        head_len = argv.index("-n")
        commands[str(world)] = {"mpirun": argv[:head_len],
                                "ranks": [seg[2:] if seg[:2] == ["-n", "1"] else seg
                                          for seg in _segments(argv[head_len:])]}
    at = text.find("def get_cmd(")
    orchestrator = text.find("TRTLLM_ORCHESTRATOR")
    facts = {
        "model_repo": REPO,
        "defaults": defaults,
        "world_size": commands,
        "get_cmd": {"source": "trtllm", "path": PATH, "commit": src.commit_of(PATH), "line": line_of(text, at)},
        "multi_model_env": {"TRTLLM_ORCHESTRATOR": "1", "source": "trtllm", "path": PATH,
                            "commit": src.commit_of(PATH), "line": line_of(text, orchestrator)},
    }
    about = ("The tritonserver argv that launch_triton_server.py's get_cmd builds with its defaults, for world "
             "sizes 1 and 2: the mpirun head, then each rank's arguments (after `-n 1`). `--multi-model` "
             "(orchestrator mode) sets TRTLLM_ORCHESTRATOR=1.")
    return document(about, sources, facts)
