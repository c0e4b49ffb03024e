"""A Triton model repository filled from upstream's inflight_batcher_llm templates, read as it is.

Every model's config.pbtxt is parsed with Triton's own ModelConfig protobuf (as tools/upstream_facts does for the
templates). A parameter whose value is "" or still starts with "${" is unset: fill_template.py
(NVIDIA/TensorRT-LLM triton_backend/tools/fill_template.py) leaves a placeholder it was given no value for as
`${name}` (string.Template.safe_substitute), and the tensorrt_llm model and the Python models treat such a value,
or an empty one, as "not given" (their default applies).

What counts as made from the templates: the models ensemble, preprocessing, tensorrt_llm and postprocessing
(tensorrt_llm_bls and a draft copy of tensorrt_llm optional), each with only the parameters its template has
(toolchain/upstream/facts/model_templates.json), tensorrt_llm on the tensorrtllm or python backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from toolchain.errors import ToolchainError
from toolchain.upstream import facts as upstream_facts

REQUIRED = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
BLS = "tensorrt_llm_bls"
ENGINE_MODEL = "tensorrt_llm"
ENGINE_BACKENDS = ("tensorrtllm", "python")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
HOW = "fill the templates with fill_template.py (tensorrtllm_backend docs) and import again"

PLAIN, WITH_BLS, DRAFT_TARGET = "ensemble", "bls", "draft-target"


def unset(value: str | None) -> bool:
    """fill_template.py's rule as the models read it: no value, "", or a placeholder left unfilled."""
    return value is None or value == "" or value.startswith("${")


def templates() -> dict[str, dict]:
    return upstream_facts("model_templates")["models"]


@dataclass(frozen=True)
class Model:
    """One model directory: its config.pbtxt parsed, and which upstream template it was filled from."""

    name: str
    path: Path  # its config.pbtxt
    config: pb.ModelConfig
    template: str

    @property
    def raw(self) -> dict[str, str]:
        return {k: v.string_value for k, v in self.config.parameters.items()}

    def param(self, key: str) -> str | None:
        """The parameter's value, or None where it is unset (absent, "", or `${...}`)."""
        value = self.raw.get(key)
        return None if unset(value) else value

    def where(self, what: str) -> str:
        return f"{self.path}: {what}"

    @property
    def decoupled(self) -> bool:
        return bool(self.config.model_transaction_policy.decoupled)

    @property
    def instance_count(self) -> int:
        return sum(g.count for g in self.config.instance_group) or 1


@dataclass
class Repository:
    root: Path
    models: dict[str, Model] = field(default_factory=dict)
    draft: str | None = None  # the draft model's name (draft-target layout)

    @property
    def layout(self) -> str:
        if self.draft:
            return DRAFT_TARGET
        return WITH_BLS if BLS in self.models else PLAIN

    def __getitem__(self, name: str) -> Model:
        return self.models[name]


def parse_config(path: Path) -> pb.ModelConfig:
    """config.pbtxt through Triton's protobuf; one line naming the file and line where it is not one."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ToolchainError(f"cannot read {path}: {err.strerror}", "check the repository path") from None
    cfg = pb.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as err:
        line = getattr(err, "GetLine", lambda: None)()
        row = text.splitlines()[line - 1] if line and line <= len(text.splitlines()) else ""
        left = PLACEHOLDER.search(row)
        if left:
            raise ToolchainError(f"{path} line {line}: placeholder ${{{left.group(1)}}} was never filled",
                                 f"fill it: fill_template.py -i {path} {left.group(1)}:VALUE") from None
        raise ToolchainError(f"{path} is not a Triton model config: {err}", HOW) from None
    return cfg


def _template_of(name: str, cfg: pb.ModelConfig, path: Path) -> str:
    known = templates()
    if name in known:
        return name
    # A copy of tensorrt_llm under another name (the draft of draft-target: speculative-decoding.md copies the
    # directory and renames the model); known by its engine parameter.
    if "gpt_model_path" in cfg.parameters and "gpt_model_type" in cfg.parameters:
        return ENGINE_MODEL
    raise ToolchainError(f"{path}: model '{name}' is not one of upstream's inflight_batcher_llm models "
                         f"({', '.join(known)}, or a copy of tensorrt_llm)",
                         "remove it from the repository, or import a repository filled from the templates only")


def _check_against_template(model: Model) -> None:
    tpl = templates()[model.template]
    allowed = set(tpl["parameters"])
    extra = sorted(set(model.raw) - allowed)
    if extra:
        raise ToolchainError(model.where(f"parameter '{extra[0]}' is not in upstream's {model.template} template "
                                         f"({tpl['path']} @ {tpl['commit'][:8]})"),
                             "remove it, or render this repository from its spec with `toolchain model-repo`")
    if model.template == ENGINE_MODEL:
        backend = model.config.backend
        if backend not in ENGINE_BACKENDS:
            raise ToolchainError(model.where(f"backend '{backend}' of model '{model.name}' is neither tensorrtllm "
                                             "nor python"),
                                 "fill it with triton_backend:tensorrtllm (or python)")
    elif tpl["backend"] and model.config.backend != tpl["backend"]:
        raise ToolchainError(model.where(f"backend '{model.config.backend}' of model '{model.name}', the template "
                                         f"has '{tpl['backend']}'"), HOW)
    elif tpl["platform"] and model.config.platform != tpl["platform"]:
        raise ToolchainError(model.where(f"platform '{model.config.platform}' of model '{model.name}', the "
                                         f"template has '{tpl['platform']}'"), HOW)


def read_repository(root: Path | str, *, strict: bool = True) -> Repository:
    """Every model of the repository at `root`, checked against upstream's templates, with its layout;
    `strict=False` reads a repository the toolchain rendered (parameters beyond the templates' allowed)."""
    root = Path(root)
    if not root.is_dir():
        raise ToolchainError(f"model repository {root} is not a directory",
                             "pass the directory holding ensemble/, preprocessing/, tensorrt_llm/, postprocessing/")
    repo = Repository(root)
    for path in sorted(root.glob("*/config.pbtxt")):
        cfg = parse_config(path)
        name = cfg.name or path.parent.name
        if name != path.parent.name:
            raise ToolchainError(f"{path}: name '{cfg.name}' differs from its directory '{path.parent.name}'",
                                 "Triton loads a model only from the directory of its name: rename one of them")
        model = Model(name, path, cfg, _template_of(name, cfg, path))
        if strict:
            _check_against_template(model)
        repo.models[name] = model
    missing = [m for m in REQUIRED if m not in repo.models]
    if not strict:
        return repo
    if missing:
        raise ToolchainError(f"{root} has no {missing[0]}/config.pbtxt: not a repository made from upstream's "
                             "inflight_batcher_llm templates", HOW)
    _find_draft(repo)
    return repo


def _find_draft(repo: Repository) -> None:
    bls = repo.models.get(BLS)
    copies = [m.name for m in repo.models.values() if m.template == ENGINE_MODEL and m.name != ENGINE_MODEL]
    draft = bls.param("tensorrt_llm_draft_model_name") if bls else None
    if bls is not None:
        target = bls.param("tensorrt_llm_model_name") or ENGINE_MODEL
        if target != ENGINE_MODEL:
            raise ToolchainError(bls.where(f"parameter tensorrt_llm_model_name '{target}': the engine model of the "
                                           "templates is tensorrt_llm"),
                                 "fill tensorrt_llm_model_name:tensorrt_llm")
    if draft is None:
        if copies:
            raise ToolchainError(repo[copies[0]].path.parent.as_posix() + f": a copy of tensorrt_llm ('{copies[0]}') "
                                 "that no tensorrt_llm_bls names as its draft",
                                 f"fill tensorrt_llm_bls with tensorrt_llm_draft_model_name:{copies[0]}, or remove it")
        return
    if draft not in repo.models or repo[draft].template != ENGINE_MODEL:
        assert bls is not None
        raise ToolchainError(bls.where(f"parameter tensorrt_llm_draft_model_name names '{draft}', which is not a "
                                       f"copy of tensorrt_llm in {repo.root}"),
                             "copy tensorrt_llm to that name and fill it with the draft engine "
                             "(TensorRT-LLM docs speculative-decoding.md, draft-target with Triton)")
    repo.draft = draft
