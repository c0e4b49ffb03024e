"""The round trip: the imported spec's repository, rendered by the toolchain's own model-repo stage into a
temporary workspace, compared with the original model by model and parameter by parameter; and the trtllm-build
flags the spec gives (engine/trtllm.py build_flags, what `toolchain build-engine --dry-run` prints) compared with
what each engine's config.json records.

Values compare by effect (importer/values.py): an unset parameter equals the value its model applies where it is
unset. Every difference is a row: `inexpressible` where the spec has no field for it (with the reason), `added`
where the toolchain writes what the original left out and nothing changes by it, `relocated` for the engine
directory (the toolchain serves engines/<name>/engine), `mismatch` for anything else (a bug of the import).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from toolchain.errors import ToolchainError
from toolchain.engine.trtllm import FLAGS, TRITON_DEFAULTS, TRITON_UNSET, build_flags
from toolchain.importer.engine import NOT_RECORDED, Engine, default_opt_num_tokens, recorded_flags
from toolchain.importer.repo import ENGINE_MODEL, Model, read_repository, templates
from toolchain.importer.to_spec import Deployment
from toolchain.importer.values import effective, same_effect
from toolchain.quant.formats import KV_CACHE, METHODS
from toolchain.spec import DeploymentSpec
from toolchain.triton.repo import run_model_repo
from toolchain.workspace import Workspace

EQUAL, DEFAULT, EQUIVALENT, ADDED, RELOCATED, INEXPRESSIBLE, MISMATCH, NOT_COMPARED = (
    "equal", "default", "equivalent", "added", "relocated", "inexpressible", "mismatch", "not recorded")
ALWAYS = "the toolchain always writes this value (triton/templates.py); the spec has no field for it"
DOCUMENTED = "the toolchain writes the backend's documented default (engine/trtllm.py TRITON_DEFAULTS)"
MULTIMODAL = "multimodal models are not rendered by the toolchain (no spec field)"
# (template, field) -> why the spec cannot hold the original's value.
REASONS: dict[tuple[str, str], str] = {
    **{(ENGINE_MODEL, k): DOCUMENTED for k in TRITON_DEFAULTS},
    **{(ENGINE_MODEL, k): f"the spec has no field for it ({why})" for k, why in TRITON_UNSET.items()},
    (ENGINE_MODEL, "max_attention_window_size"): "the spec has no attention-window field: the toolchain leaves it "
                                                 "unset, so the engine's max_seq_len applies",
    (ENGINE_MODEL, "gpu_device_ids"): "the spec places the engines of draft_target only "
                                      "(speculative.target_gpu_device_ids, draft_gpu_device_ids); MPI ranks place "
                                      "the others",
    (ENGINE_MODEL, "gpt_model_type"): "the toolchain always writes inflight_fused_batching",
    (ENGINE_MODEL, "normalize_log_probs"): ALWAYS, (ENGINE_MODEL, "cancellation_check_period_ms"): ALWAYS,
    (ENGINE_MODEL, "stats_check_period_ms"): ALWAYS, (ENGINE_MODEL, "executor_worker_path"): ALWAYS,
    (ENGINE_MODEL, "FORCE_CPU_ONLY_INPUT_TENSORS"): ALWAYS,
    (ENGINE_MODEL, "num_nodes"): "derived from tp x pp and gpu.per_node",
    (ENGINE_MODEL, "decoding_mode"): "derived from speculative.mode and build.max_beam_width",
    (ENGINE_MODEL, "backend"): "target trtllm serves tensorrt_llm on the C++ tensorrtllm backend",
    ("preprocessing", "add_special_tokens"): ALWAYS, ("postprocessing", "skip_special_tokens"): ALWAYS,
    ("preprocessing", "multimodal_model_path"): MULTIMODAL, ("preprocessing", "max_num_images"): MULTIMODAL,
    ("preprocessing", "hf_model_path"): MULTIMODAL, ("tensorrt_llm_bls", "multimodal_encoders_name"): MULTIMODAL,
    ("*", "instance_group.count"): "the spec holds one serving.instance_count for preprocessing, postprocessing "
                                   "and the BLS, and the toolchain runs one tensorrt_llm instance",
    ("*", "data_type"): "the toolchain writes logits FP32, encoder features and prompt tables FP16 "
                        "(triton/templates.py RepoOptions); the spec has no field for them",
    ("*", "dynamic_batching"): "the toolchain's batching of each model is fixed (triton/templates.py)",
}
DRAFT = ("the draft copies the target's parameters (triton/templates.py), only its engine, KV-cache fraction and "
         "GPU differ; the spec has no field for another draft setting")
# Written by the toolchain where the original left the parameter unset, with no effect on serving.
ADDED_REASONS: dict[tuple[str, str], str] = {
    (ENGINE_MODEL, "tokenizer_dir"): "the backend reads it for guided decoding only, which is off",
    ("preprocessing", "gpt_model_path"): "the toolchain's preprocessing names its engine (read by upstream's "
                                         "preprocessing for multimodal models only, UNVERIFIED)",
    ("preprocessing", "end_id"): "the toolchain's preprocessing defaults end_id from generation_config.json",
    ("preprocessing", "stop_token_ids"): "the toolchain's preprocessing adds the model's other EOS ids as stop words",
    ("preprocessing", "trust_remote_code"): "model.trust_remote_code, read by the toolchain's preprocessing",
    ("postprocessing", "trust_remote_code"): "model.trust_remote_code, read by the toolchain's postprocessing",
    ("tensorrt_llm_bls", "exclude_input_in_output"): "the toolchain's BLS reads tensorrt_llm's default",
}
PATHS = ("gpt_model_path",)
PLUGIN_FLAGS = ("--gemm_plugin", "--gpt_attention_plugin")
FIXED_FLAGS = {"--remove_input_padding": "enable", "--kv_cache_type": "paged"}
ABSENT = {"--opt_num_tokens": None, "--speculative_decoding_mode": None, "--max_draft_len": 0,
          "--gather_context_logits": False, "--gather_generation_logits": False, "--lora_plugin": "disable"}


@dataclass
class Row:
    where: str  # model name, or "engine" / "draft engine"
    field: str
    original: Any
    rendered: Any
    status: str
    reason: str = ""

    def line(self) -> str:
        text = f"{self.where}.{self.field}: {self.status}: original {self.original!r}, toolchain {self.rendered!r}"
        return f"{text} ({self.reason})" if self.reason else text


@dataclass
class Report:
    layout: str
    rows: list[Row] = field(default_factory=list)
    skipped: str | None = None  # why the repository was not rendered

    def of(self, status: str) -> list[Row]:
        return [r for r in self.rows if r.status == status]

    @property
    def inexpressible(self) -> list[str]:
        return [f"{r.where}.{r.field}" for r in self.of(INEXPRESSIBLE)]

    def lines(self) -> list[str]:
        counts = {s: len(self.of(s)) for s in (EQUAL, DEFAULT, EQUIVALENT, ADDED, RELOCATED, INEXPRESSIBLE, MISMATCH,
                                               NOT_COMPARED)}
        out = [f"round trip ({self.layout} layout): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
        if self.skipped:
            out.append(f"repository not rendered: {self.skipped}")
        out += [r.line() for r in self.rows if r.status not in (EQUAL, DEFAULT)]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "skipped": self.skipped, "inexpressible": self.inexpressible,
                "mismatches": [f"{r.where}.{r.field}" for r in self.of(MISMATCH)],
                "rows": [asdict(r) for r in self.rows]}


def _reason(model: Model, key: str, draft: bool) -> str | None:
    if draft and key not in ("gpt_model_path", "kv_cache_free_gpu_mem_fraction", "gpu_device_ids"):
        return DRAFT
    return REASONS.get((model.template, key)) or REASONS.get(("*", key.split(".")[-1] if "data_type" in key
                                                                 else key))


def _classify(model: Model, key: str, o: Any, r: Any, unset: tuple[bool, bool], draft: bool) -> tuple[str, str]:
    if o == r:
        return (DEFAULT if unset[0] != unset[1] else EQUAL), ""
    if same_effect(model.template, key, o, r):
        return EQUIVALENT, "another spelling of the same setting to the model that reads it (importer/values.py)"
    if unset[0] and (model.template, key) in ADDED_REASONS:
        return ADDED, ADDED_REASONS[(model.template, key)]
    reason = _reason(model, key, draft)
    return (INEXPRESSIBLE, reason) if reason else (MISMATCH, "")


def _model_fields(m: Model) -> dict[str, Any]:
    c = m.config
    out: dict[str, Any] = {"backend": c.backend or c.platform, "max_batch_size": c.max_batch_size,
                           "decoupled": m.decoupled, "instance_group.count": m.instance_count,
                           "dynamic_batching": c.HasField("dynamic_batching")}
    if c.HasField("dynamic_batching"):
        db = c.dynamic_batching
        out |= {"dynamic_batching.preferred_batch_size": list(db.preferred_batch_size),
                "dynamic_batching.max_queue_delay_microseconds": db.max_queue_delay_microseconds,
                "dynamic_batching.default_queue_policy.max_queue_size": db.default_queue_policy.max_queue_size}
    tpl = templates()[m.template]
    chosen = {(k, t["name"]) for k in ("inputs", "outputs") for t in tpl[k] if str(t["data_type"]).startswith("${")}
    for kind, tensors in (("inputs", c.input), ("outputs", c.output)):
        for t in tensors:
            if (kind, t.name) in chosen:
                out[f"{kind[:-1]}.{t.name}.data_type"] = json_format.MessageToDict(t).get("dataType", "TYPE_FP32")
    return out


def compare_model(orig: Model, rend: Model, dep: Deployment, engine_dirs: dict[str, str], draft: bool) -> list[Row]:
    rows: list[Row] = []
    fo, fr = _model_fields(orig), _model_fields(rend)
    for key in fo:
        status, reason = _classify(orig, key, fo[key], fr.get(key), (False, False), False)
        rows.append(Row(orig.name, key, fo[key], fr.get(key), status, reason))
    allowed = templates()[orig.template]["parameters"]
    for key in sorted(set(orig.raw) | set(rend.raw)):
        o, r = (effective(m, key, dep.beam_width, dep.max_seq_len) for m in (orig, rend))
        unset = (orig.param(key) is None, rend.param(key) is None)
        if key not in allowed:
            rows.append(Row(orig.name, key, None, r, ADDED, ADDED_REASONS.get((orig.template, key), "")
                            or "a parameter of the toolchain's own model, not in upstream's template"))
            continue
        if key in PATHS and not unset[0] and r == engine_dirs.get(orig.name):
            rows.append(Row(orig.name, key, o, r, RELOCATED, "the toolchain serves the engine `toolchain "
                            "build-engine` writes at engines/<name>/engine: build it there, or copy the original"))
            continue
        status, reason = _classify(orig, key, o, r, unset, draft)
        rows.append(Row(orig.name, key, orig.param(key), rend.param(key), status, reason))
    return rows


def _render(spec: DeploymentSpec, root: Path) -> tuple[Path, Path]:
    ws = Workspace(root)
    run_model_repo(spec, ws)
    return ws.model_repo_dir(spec), ws.engine_dir(spec).resolve()


def compare_repository(dep: Deployment, spec: DeploymentSpec) -> list[Row]:
    """Every field and parameter of every original model against the toolchain's rendering of `spec`."""
    with tempfile.TemporaryDirectory(prefix="toolchain-import-") as tmp:
        repo_dir, engine_dir = _render(spec, Path(tmp))
        rendered = read_repository(repo_dir, strict=False)
        dirs = {ENGINE_MODEL: str(engine_dir), "preprocessing": str(engine_dir)}
        if dep.repo.draft:
            dirs[dep.repo.draft] = str(engine_dir / "draft" / "engine")
        rows: list[Row] = []
        for name, orig in dep.repo.models.items():
            rend = rendered.models.get(name)
            if rend is None:
                rows.append(Row(name, "model", name, None, MISMATCH, "the toolchain renders no such model"))
                continue
            rows += compare_model(orig, rend, dep, dirs, name == dep.repo.draft)
        for name in sorted(set(rendered.models) - set(dep.repo.models)):
            rows.append(Row(name, "model", None, name, ADDED, "the toolchain renders every model of the templates"))
        real = os.path.realpath(tmp)
        for row in rows:  # the temporary workspace's paths as the user's workspace holds them (engines/<name>/...)
            if isinstance(row.rendered, str) and row.rendered.startswith((tmp + os.sep, real + os.sep)):
                row.rendered = os.path.relpath(os.path.realpath(row.rendered), real)
        return rows


def _wanted(spec: DeploymentSpec, engine: Engine, draft: bool) -> dict[str, object]:
    flags = dict(build_flags(spec, draft=draft))
    dtype = str(engine.pretrained.get("dtype"))
    for name in PLUGIN_FLAGS:
        if flags.get(name, "auto") == "auto":
            flags[name] = dtype
    for name, value in ABSENT.items():
        flags.setdefault(name, value)
    for name in ("--max_beam_width", "--tokens_per_block", "--context_fmha", "--multiple_profiles",
                 "--reduce_fusion"):
        flags.setdefault(name, FLAGS[name].default)
    if flags["--opt_num_tokens"] is None and not flags["--multiple_profiles"] == "enable":
        flags["--opt_num_tokens"] = default_opt_num_tokens(int(flags["--max_num_tokens"]),  # type: ignore[call-overload]
                                                           int(flags["--max_batch_size"]),  # type: ignore[call-overload]
                                                           int(flags["--max_beam_width"]))  # type: ignore[call-overload]
    if "--lora_target_modules" in flags:
        flags["--lora_target_modules"] = tuple(sorted(flags["--lora_target_modules"]))  # type: ignore[call-overload]
    return flags


def compare_flags(dep: Deployment, spec: DeploymentSpec) -> list[Row]:
    """build_flags(spec) (and the draft's) against the flags each engine's config.json records."""
    rows: list[Row] = []
    pairs = [("engine", dep.engine, False)] + ([("draft engine", dep.draft_engine, True)] if dep.draft_engine else [])
    for where, engine, draft in pairs:
        assert engine is not None
        want, have = _wanted(spec, engine, draft), recorded_flags(engine)
        for name, value in have.items():
            if name == "--opt_num_tokens" and want.get(name) is None:
                continue  # multiple profiles: trtllm-build picks the profiles
            got = want.get(name)
            if got == value:
                rows.append(Row(where, name, value, got, EQUAL))
            elif name in FIXED_FLAGS:
                rows.append(Row(where, name, value, got, INEXPRESSIBLE,
                                f"the toolchain always builds with {name} {FIXED_FLAGS[name]}"))
            elif draft:
                rows.append(Row(where, name, value, got, INEXPRESSIBLE, "the draft is built with the target's limits "
                                "and plugins (engine/trtllm.py build_flags draft=True); the spec has no field for it"))
            else:
                rows.append(Row(where, name, value, got, MISMATCH))
        for name, why in NOT_RECORDED.items():
            if name in want:
                rows.append(Row(where, name, None, want[name], NOT_COMPARED, why))
        rows += _checkpoint_rows(where, engine, spec, draft)
    return rows


def _checkpoint_rows(where: str, engine: Engine, spec: DeploymentSpec, draft: bool) -> list[Row]:
    """What the engine records of the checkpoint it was built from: the split and the format."""
    q = spec.quantization
    world = 1 if draft else spec.parallelism.world_size
    pairs: list[tuple[str, Any, Any]] = [("pretrained_config.mapping.world_size", engine.mapping.get("world_size", 1), world)]
    if not draft:
        pairs += [("pretrained_config.mapping.tp_size", engine.mapping.get("tp_size", 1), spec.parallelism.tp),
                  ("pretrained_config.mapping.pp_size", engine.mapping.get("pp_size", 1), spec.parallelism.pp),
                  ("pretrained_config.quantization.quant_algo", engine.quantization.get("quant_algo"),
                   METHODS[q.method].quant_algo),
                  ("pretrained_config.quantization.kv_cache_quant_algo",
                   engine.quantization.get("kv_cache_quant_algo"), KV_CACHE[q.kv_cache].quant_algo)]
        if spec.model.dtype != "auto":
            pairs.append(("pretrained_config.dtype", engine.pretrained.get("dtype"), spec.model.dtype))
    return [Row(where, k, o, r, EQUAL if o == r else MISMATCH) for k, o, r in pairs]


def round_trip(dep: Deployment, spec: DeploymentSpec) -> Report:
    report = Report(dep.repo.layout)
    try:
        report.rows += compare_repository(dep, spec)
    except ToolchainError as err:  # e.g. the tokenizer lives on the GPU host only
        report.skipped = str(err)
    report.rows += compare_flags(dep, spec)
    return report

