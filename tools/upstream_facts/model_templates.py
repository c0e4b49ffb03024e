"""The inflight-batching model templates: each model's tensors, parameters and
fields left as `${placeholders}` for fill_template.py.

Unquoted placeholders (max_batch_size, decoupled, data_type, queue sizes) are
swapped for a typed stand-in before the text is parsed with Triton's own
ModelConfig protobuf, and recorded by field so the facts say which values a
deployment must fill.
"""

from __future__ import annotations

import json
import re

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from tools.upstream_facts.common import document, line_of

SOURCES = {"trtllm": "0c8de69a1ca6213eebb20a51873890ff128666c2"}
PREFIX = "triton_backend/all_models/inflight_batcher_llm/"
MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# Unquoted placeholder fields and the stand-in that keeps the text parseable.
STAND_INS = {"decoupled": "false", "data_type": "TYPE_INVALID"}


def _parse(text: str, path: str) -> tuple[pb.ModelConfig, list[dict]]:
    filled, unquoted = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if '"' not in line and PLACEHOLDER.search(line):
            field = line.split(":", 1)[0].strip().lstrip("{").strip()
            for m in PLACEHOLDER.finditer(line):
                unquoted.append({"field": field, "placeholder": m.group(1), "line": lineno})
            line = PLACEHOLDER.sub(STAND_INS.get(field, "1"), line)
        filled.append(line)
    cfg = pb.ModelConfig()
    text_format.Parse("\n".join(filled), cfg)
    return cfg, unquoted


def _tensor(t, text: str, kind: str, unquoted: list[dict]) -> dict:
    # outputs are declared after the inputs: search from the section's start
    start = text.find("output [") if kind == "output" else 0
    m = re.search(rf'name:\s*"{re.escape(t.name)}"', text[start:])
    m_start = start + m.start() if m else None
    line = line_of(text, m_start) if m else None
    entry = {"name": t.name, "data_type": pb.DataType.Name(t.data_type), "dims": list(t.dims),
             "reshape": list(t.reshape.shape) if t.HasField("reshape") else None, "line": line}
    if kind == "input":
        entry.update(optional=t.optional, allow_ragged_batch=t.allow_ragged_batch)
    if entry["data_type"] == "TYPE_INVALID" and line is not None:
        # the placeholder sits on the data_type line after the name
        after = [u for u in unquoted if u["field"] == "data_type" and u["line"] > line]
        entry["data_type"] = "${%s}" % after[0]["placeholder"] if after else None
    return entry


def extract(sources, previous=None):
    src = sources["trtllm"]
    models = {}
    for name in MODELS:
        path = f"{PREFIX}{name}/config.pbtxt"
        text = src.read(path)
        cfg, unquoted = _parse(text, path)
        params = {}
        for key, value in cfg.parameters.items():
            m = re.search(rf'key:\s*"{re.escape(key)}"', text)
            params[key] = {"value": value.string_value, "line": line_of(text, m.start()) if m else None}
        # protobuf maps (input_map, output_map) iterate in no fixed order: sort them for stable facts
        steps = [json.loads(json.dumps(json_format.MessageToDict(s, preserving_proto_field_name=True),
                                       sort_keys=True)) for s in cfg.ensemble_scheduling.step]
        models[name] = {
            "source": "trtllm", "path": path, "commit": src.commit_of(path),
            "backend": cfg.backend or None, "platform": cfg.platform or None,
            "placeholders": [u for u in unquoted if u["field"] != "data_type"],
            "inputs": [_tensor(t, text, "input", unquoted) for t in cfg.input],
            "outputs": [_tensor(t, text, "output", unquoted) for t in cfg.output],
            "parameters": dict(sorted(params.items())),
            "instance_group": [json_format.MessageToDict(g, preserving_proto_field_name=True)
                               for g in cfg.instance_group],
            "ensemble_steps": steps,
        }
    about = ("The inflight_batcher_llm model templates parsed as inference.ModelConfig. `placeholders` are "
             "unquoted fields fill_template.py must fill (max_batch_size, decoupled, queue sizes); a tensor "
             "data_type of '${name}' is chosen per deployment; parameter values are the template text, most of "
             "them '${name}'.")
    return document(about, sources, {"models": models})
