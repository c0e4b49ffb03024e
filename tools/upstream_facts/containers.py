"""Which TensorRT-LLM each Triton `YY.MM-trtllm-python-py3` container ships.

tensorrtllm_backend keeps one `rYY.MM` branch per Triton release; its
dockerfile/Dockerfile.triton.trt_llm_backend pins the TensorRT-LLM branch it
builds (`TENSORRTLLM_REPO_TAG`) and, from r25.09 on, the version
(`TENSORRTLLM_VER`). Engines deserialize only in the TensorRT-LLM that built
them, so the serving image is chosen from this table, not from memory. Each
branch also pins its `tensorrt_llm` submodule (the repository in .gitmodules):
the TensorRT-LLM source commit that release names.
"""

from __future__ import annotations

import re
import subprocess

from tools.upstream_facts.common import document, line_of

SOURCES = {"backend": "r26.04"}
DOCKERFILE = "dockerfile/Dockerfile.triton.trt_llm_backend"
ARGS = ("BASE_IMAGE", "TENSORRTLLM_REPO_TAG", "TENSORRTLLM_VER", "TRT_VER")


def _args(text: str) -> dict[str, dict]:
    found = {}
    for name in ARGS:
        m = re.search(rf"^ARG {name}=(\S+)", text, re.M)
        if m:
            found[name] = {"value": m.group(1), "line": line_of(text, m.start())}
    return found


def _submodule(src) -> dict | None:
    commit = src.gitlink("tensorrt_llm")
    if commit is None:
        return None
    m = re.search(r"url\s*=\s*(\S+)", src.read(".gitmodules"))
    url = m.group(1) if m else None
    repository = re.sub(r"^https://github\.com/|\.git$", "", url) if url else None
    return {"repository": repository, "commit": commit, "path": ".gitmodules"}


def extract(sources, previous=None):
    backend = sources["backend"]
    releases = {}
    for branch in backend.branches(r"r\d\d\.\d\d"):
        src = backend.at(branch)
        try:
            text = src.read(DOCKERFILE)
        except subprocess.CalledProcessError:
            continue
        args = _args(text)
        if "TENSORRTLLM_VER" not in args:
            continue  # before r25.09 the version is not pinned in the Dockerfile
        releases[branch[1:]] = {
            "image": f"nvcr.io/nvidia/tritonserver:{branch[1:]}-trtllm-python-py3",
            "tensorrt_llm": args["TENSORRTLLM_VER"]["value"],
            "tensorrt_llm_branch": args.get("TENSORRTLLM_REPO_TAG", {}).get("value"),
            "tensorrt": args.get("TRT_VER", {}).get("value"),
            "base_image": args.get("BASE_IMAGE", {}).get("value"),
            "tensorrt_llm_submodule": _submodule(src),
            "source": "backend", "ref": branch, "commit": src.commit, "path": DOCKERFILE,
            "line": args["TENSORRTLLM_VER"]["line"],
        }
    about = ("Triton release -> the TensorRT-LLM its trtllm-python-py3 container builds, from each rYY.MM branch's "
             "Dockerfile (ARG TENSORRTLLM_VER).")
    return document(about, sources, {"releases": releases})
