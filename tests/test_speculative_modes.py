"""The speculative-mode rows (toolchain/speculative.py): each runtime name is one the pinned release has, the
spec admits exactly the rows' modes, every target a mode does not run on is refused with the row's reason, and
every row reaches the stage that carries it (trtllm-build's flags, config.pbtxt, model.yaml, convert, the draft
engine's model) on every target it runs on."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from conftest import write_eagle_draft, write_medusa_heads, write_spec
from toolchain import upstream
from toolchain.checkpoint.stage import plan_convert, run_convert
from toolchain.checks.preflight import FAIL, build_context, run_checks
from toolchain.engine import trtllm
from toolchain.engine.build import planned_commands
from toolchain.llmapi.args import model_yaml
from toolchain.spec import SpeculativeSection, load_spec
from toolchain.speculative import CHECKPOINT, CPU, DRAFT_ENGINE, MODES, NOTHING, refusal
from toolchain.targets import ENGINE, LLMAPI, TARGETS, Target
from toolchain.triton.launch import trtllm_models
from toolchain.triton.repo import repo_options
from toolchain.triton.templates import build_models
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]


def test_the_spec_admits_the_rows_modes():
    assert set(typing.get_args(SpeculativeSection.model_fields["mode"].annotation)) == set(MODES)


def test_build_modes_are_trtllm_build_choices():
    choices = upstream.facts("trtllm_build")["flags"]["--speculative_decoding_mode"]["choices"]
    for name, row in MODES.items():
        assert row.build_mode is None or row.build_mode in choices, name


def test_decoding_modes_are_the_backends():
    params = {p["name"]: p for p in upstream.facts("backend_parameters")["parameters"]}
    for name, row in MODES.items():
        assert row.decoding_mode is None or row.decoding_mode in params["decoding_mode"]["values"], name


def test_decoding_types_are_llm_api_configs_of_the_pytorch_backend():
    types = upstream.facts("llmapi")["speculative"]["types"]
    for name, row in MODES.items():
        if row.decoding_type is not None:
            allows = types[row.decoding_type]["supports_backend"]["allows"]
            assert allows == "all" or "pytorch" in allows, name


@pytest.mark.parametrize("name", [m for m in MODES if m != "none"])
def test_every_gap_has_its_reason(name):
    row = MODES[name]
    gaps = [p for p in (ENGINE, LLMAPI) if p not in row.paths]
    if ENGINE in row.paths and ENGINE not in row.cpu:
        gaps.append(CPU)
    assert all(row.why_not.get(g) for g in gaps), (name, gaps, row.why_not)
    for target in TARGETS.values():
        why = refusal(name, target)
        assert (why is None) == row.runs_on(target), (name, target.name)
        assert why is None or why.startswith(f"speculative.mode={name} "), why


def test_refusals_name_where_to_go():
    assert refusal("eagle3", TARGETS["cpu"]) == (
        "speculative.mode=eagle3 cannot run on target cpu: EAGLE-3 drafts run on the PyTorch backend only "
        "(speculative_config decoding_type Eagle); use target llmapi")
    assert refusal("eagle", TARGETS["cpu"]).endswith("use target trtllm, or speculative.mode ngram or medusa on cpu")
    assert refusal("medusa", TARGETS["llmapi"]).endswith("use target trtllm, or speculative.mode draft_target or ngram")
    assert refusal("ngram", TARGETS["llmapi-cpu"]).startswith(
        "speculative.mode=ngram is not run by the CPU stand-in of the LLM API yet; use target cpu")
    assert refusal("none", TARGETS["llmapi-cpu"]) is None


# docs/architecture.md, "How to add ... A speculative mode": every row reaches the stage that carries it on every
# target it runs on, and is refused with its reason on every other, through the functions the stages call.
# What drafts for a mode whose `draft` is speculative.heads: the networks convert attaches (checkpoint/<mode>.py).
HEADS_WRITERS = {"medusa": write_medusa_heads, "eagle": write_eagle_draft}
TREE = "{0}, {1}, {0, 0}"  # tree modes (length_in_checkpoint): 3 nodes over 2 levels


def mode_spec(root: Path, hf_dir: Path, name: str, target: Target):
    row = MODES[name]
    sp: dict = {"mode": name, "max_draft_len": 0 if row.length_in_checkpoint or name == "none" else 4}
    if row.draft == "draft_model":
        sp["draft_model"] = str(hf_dir)  # the same tiny model stands in as its own draft (same tokenizer)
    elif row.draft == "heads":
        assert name in HEADS_WRITERS, f"{name} drafts from speculative.heads: add the writer of its heads here"
        sp["heads"] = str(HEADS_WRITERS[name](root / "heads", hf_dir))
    if row.length_in_checkpoint:
        sp["choices"] = TREE
    root.mkdir(parents=True, exist_ok=True)
    return load_spec(write_spec(root / "spec.yaml", hf_dir, target=target.name, speculative=sp,
                                **({"gpu": {"name": "H100 80GB"}} if target.on_gpu else {})))


def tensor_names(plan) -> set[str]:
    return {t.name for rank in plan.ranks for t in rank}


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_row_reaches_its_stage(name, tmp_path, hf_llama_words):
    row = MODES[name]
    for target in TARGETS.values():
        spec = mode_spec(tmp_path / target.name, hf_llama_words, name, target)
        ws = Workspace(tmp_path / target.name / "ws")
        if not row.runs_on(target):
            results = run_checks(build_context(spec, "plan", ws))
            refused = [r for r in results if r.status == FAIL and r.message == refusal(name, target)]
            assert refused, (name, target.name, [(r.id, r.message) for r in results if r.status == FAIL])
            why = row.why_not.get(target.path if target.path not in row.paths else CPU)
            assert why is None or why in refused[0].message
            continue
        if target.llmapi_path:
            # model.yaml (and trtllm-serve's options, the same arguments) carry speculative_config.
            config = model_yaml(spec, spec.model.checkpoint).get("speculative_config")
            assert (config or {}).get("decoding_type") == row.decoding_type, (name, target.name, config)
            if row.draft == "draft_model":
                assert config["speculative_model_dir"] == str(spec.speculative.draft_model)
            continue
        # Engine path. convert: networks in the checkpoint for `adds` checkpoint (stage.py calls the mode's
        # module), the same tensors as without speculation otherwise; a draft engine's checkpoint beside it.
        plain = spec.model_copy(update={"speculative": SpeculativeSection()})
        added = tensor_names(plan_convert(spec)) - tensor_names(plan_convert(plain))
        assert bool(added) == (row.adds == CHECKPOINT), (name, sorted(added)[:3])
        run_convert(spec, ws)
        assert ws.draft_checkpoint_dir(spec).is_dir() == (row.adds == DRAFT_ENGINE)
        # build-engine: trtllm-build's --speculative_decoding_mode, and a second, draft build.
        if not target.engine_builder.python_model:
            main, *draft = [trtllm.validate(cmd[1:]) for cmd in planned_commands(spec, ws)]
            assert main.get("--speculative_decoding_mode") == row.build_mode, (name, main)
            assert len(draft) == (row.adds == DRAFT_ENGINE)
            assert all("--speculative_decoding_mode" not in d for d in draft)
        # model-repo: config.pbtxt's decoding_mode, the draft engine's model, the BLS's own drafts.
        models = build_models(repo_options(spec, ws))
        decoding = row.decoding_mode or "top_k_top_p"
        assert models["tensorrt_llm"].parameters["decoding_mode"] == decoding
        assert f'string_value: "{decoding}"' in models["tensorrt_llm"].render()
        has_draft_model = "tensorrt_llm_draft" in models
        assert has_draft_model == (row.adds == DRAFT_ENGINE) == ("tensorrt_llm_draft" in trtllm_models(spec))
        prompt_lookup = "draft_ngram_size" in models["tensorrt_llm_bls"].parameters
        assert prompt_lookup == (row.external_drafts and row.adds == NOTHING), name


def test_the_how_to_add_a_mode_recipe_names_files_and_tests_that_exist():
    """docs/architecture.md's "A speculative mode" recipe lists the files to touch: each exists, and each test
    it names is in this file."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    recipe = doc[doc.index("**A speculative mode**"):].split("\n\n")[0]
    files = re.findall(r"`((?:toolchain|tests)/[\w/]+\.py)`", recipe)
    assert {"toolchain/speculative.py", "tests/test_speculative_modes.py"} <= set(files)
    assert all((REPO / f).is_file() for f in files), files
    tests = re.findall(r"`(test_\w+)`", recipe)
    assert tests and all(f"def {t}(" in Path(__file__).read_text() for t in tests)
