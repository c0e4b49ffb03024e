"""LeaderWorkerSet (kubernetes-sigs/lws): the v1 API's JSON field names and enums, the labels and
environment variables the controller gives every pod, and how the project's own TensorRT-LLM
example starts ranks in other pods.

Read from a git checkout at a release tag (`fetch` brings one): the Go types of
api/leaderworkerset/v1 (json tags, `+kubebuilder:validation:Enum` and `+kubebuilder:default`
markers) and docs/examples/tensorrt-llm (its mpirun's rsh agent and the RBAC the agent needs).
"""

from __future__ import annotations

import re

import yaml

from tools.upstream_facts.common import document, line_of

SOURCES = {"lws": "v0.10.0"}
TYPES = "api/leaderworkerset/v1/leaderworkerset_types.go"
GROUP_VERSION = "api/leaderworkerset/v1/groupversion_info.go"
EXAMPLE = "docs/examples/tensorrt-llm"
STRUCTS = ["LeaderWorkerSet", "LeaderWorkerSetSpec", "LeaderWorkerTemplate", "RolloutStrategy", "SubGroupPolicy",
           "NetworkConfig", "RollingUpdateConfiguration"]
CONSTANTS = ["SetNameLabelKey", "GroupIndexLabelKey", "WorkerIndexLabelKey", "GroupUniqueHashLabelKey",
             "LwsLeaderAddress", "LwsGroupSize", "LwsWorkerIndex"]

_FIELD = re.compile(r'^\s*(?P<go>\w+)?\s+(?P<type>[\w.*\[\]]+)?\s*`json:"(?P<json>[^"]*)"`', re.M)
_MARKER = re.compile(r"//\s*\+kubebuilder:(?P<kind>validation:Enum|default)=\{?(?P<value>[^}\n]*)\}?")


def _structs(text: str) -> dict:
    out = {}
    for name in STRUCTS:
        m = re.search(rf"^type {name} struct \{{\n(?P<body>.*?)^\}}", text, re.M | re.S)
        if m is None:
            raise SystemExit(f"{TYPES}: no struct {name}")
        start = m.start("body")
        fields: dict = {}
        markers: dict = {}
        for line_no, line in enumerate(m.group("body").splitlines(), line_of(text, start)):
            marker = _MARKER.search(line)
            if marker:
                key = "enum" if marker.group("kind") == "validation:Enum" else "default"
                markers[key] = marker.group("value").split(",") if key == "enum" else marker.group("value")
                continue
            f = _FIELD.match(line)
            if f is None:
                if not line.strip().startswith("//"):
                    markers = {}
                continue
            json_name, _, opts = f.group("json").partition(",")
            if json_name:  # inline members (TypeMeta) have none
                fields[json_name] = {"go": f.group("go"), "type": f.group("type"), "line": line_no,
                                     "required": "omitempty" not in opts and "default" not in markers, **markers}
            markers = {}
        out[name] = {"line": line_of(text, m.start()), "fields": fields}
    return out


def _constants(text: str) -> dict:
    out = {}
    for name in CONSTANTS:
        m = re.search(rf'^\s*{name}\s+string\s*=\s*"([^"]+)"', text, re.M)
        if m is None:
            raise SystemExit(f"{TYPES}: no constant {name}")
        out[name] = {"value": m.group(1), "line": line_of(text, m.start())}
    return out


def _quote_line(text: str, quote: str, path: str) -> int:
    at = text.find(quote)
    if at < 0:
        raise SystemExit(f"{path}: quote not found: {quote!r}")
    return line_of(text, at)


def _example(src) -> dict:
    server = f"{EXAMPLE}/build/server.py"
    dockerfile = f"{EXAMPLE}/build/Dockerfile"
    rbac = f"{EXAMPLE}/rbac.yaml"
    server_text, docker_text, rbac_text = src.read(server), src.read(dockerfile), src.read(rbac)
    role = next(d for d in yaml.safe_load_all(rbac_text) if d and d.get("kind") == "Role")
    return {
        "rsh_agent": {"mca": "plm_rsh_agent", "path": server, "line": _quote_line(server_text, '"plm_rsh_agent"', server)},
        "kubectl_in_image": {"path": dockerfile, "line": _quote_line(docker_text, "Install kubectl", dockerfile),
                             "base": re.search(r"BASE_CONTAINER_IMAGE=(\S+)", docker_text).group(1)},
        "role_rules": {"path": rbac, "rules": [{"apiGroups": r.get("apiGroups", []), "resources": r["resources"],
                                                "verbs": r["verbs"]} for r in role["rules"]]},
    }


def extract(sources, previous=None):
    src = sources["lws"]
    text = src.read(TYPES)
    gv = re.search(r'GroupVersion\{Group: "([^"]+)", Version: "([^"]+)"\}', src.read(GROUP_VERSION))
    facts = {
        "api_version": {"value": f"{gv.group(1)}/{gv.group(2)}", "path": GROUP_VERSION},
        "kind": "LeaderWorkerSet",
        "types": {"path": TYPES, "structs": _structs(text), "constants": _constants(text)},
        "example": _example(src),
    }
    return document(__doc__.split("\n\n")[0].replace("\n", " "), sources, facts)
