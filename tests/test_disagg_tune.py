"""Disaggregated candidates end to end: the spec's per-role Dynamo settings (validated, hashed as before when
unused), their rendering (dynamo.trtllm's own flags and --override-engine-args, the DynamoGraphDeployment's GPUs
per role, held against Dynamo 1.6.1's facts and, where installed, its own merge of the worker's arguments), and
`toolchain tune` proposing splits beside aggregated candidates, writing the chosen one as a spec whose
`toolchain dynamo --manifests` is the graph with each role's settings."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import pytest
import yaml

from toolchain import upstream
from toolchain.checks.preflight import build_context, run_checks
from toolchain.cli import main
from toolchain.dynamo import manifests, render
from toolchain.errors import ToolchainError
from toolchain.llmapi.args import serve_config
from toolchain.slo import thresholds
from toolchain.spec import load_spec
from toolchain.tune.disagg import search_with_disagg
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
DYNAMO_SPEC = REPO / "build" / "tiny-llama-dynamo.yaml"
LLAMA_8B_LLMAPI = REPO / "build" / "llama3-8b-llmapi-h100.yaml"
LLAMA_70B_ENGINE = REPO / "build" / "llama3-70b-tp4pp2.yaml"
PLAIN = ["llmapi.options={}", "speculative.mode=none"]
WORKER_FLAGS = upstream.facts("dynamo")["trtllm_worker"]["flags"]
ROLES = ["target=llmapi", "dynamo.http_port=8000", "parallelism.tp=2", "dynamo.disaggregated=true",
         "dynamo.prefill_workers=2", "dynamo.decode_workers=1", "dynamo.prefill.tp=1",
         "dynamo.prefill.max_num_tokens=4096", "dynamo.decode.max_batch_size=128",
         "dynamo.decode.kv_cache_free_gpu_mem_fraction=0.5"]


# -- the spec -------------------------------------------------------------------------------------------------


def test_role_settings_need_disaggregation_and_fit_the_stated_gpus():
    with pytest.raises(ToolchainError) as err:
        load_spec(DYNAMO_SPEC, ["dynamo.decode.tp=2"])
    assert "dynamo.decode.tp" in str(err.value) and "dynamo.disaggregated" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ToolchainError) as err:  # 2 x tp 1 + 1 x tp 4 = 6 GPUs of 4
        load_spec(DYNAMO_SPEC, ["target=llmapi", "parallelism.gpus=4", "dynamo.disaggregated=true",
                                "dynamo.prefill_workers=2", "dynamo.prefill.tp=1", "dynamo.decode.tp=4"])
    assert "take 6 GPUs but parallelism.gpus is 4" in str(err.value) and "\n" not in str(err.value)
    load_spec(DYNAMO_SPEC, ["target=llmapi", "parallelism.gpus=6", "dynamo.disaggregated=true",
                            "dynamo.prefill_workers=2", "dynamo.prefill.tp=1", "dynamo.decode.tp=4"])


def test_a_spec_without_role_settings_hashes_as_before_they_existed():
    """spec_hash over every field but the unused role sections (as the unused lora section): a spec that sets
    none hashes what it hashed before the roles existed, and setting one changes it."""
    spec = load_spec(DYNAMO_SPEC)
    data = spec.model_dump(mode="json")
    data.pop("lora")
    data["dynamo"].pop("prefill")
    data["dynamo"].pop("decode")
    for key in ("target_gpu_device_ids", "draft_gpu_device_ids"):  # unset GPU placements hash as before, too
        data["speculative"].pop(key)
    data["serving"].pop("accumulate_tokens")  # and a BLS that does not accumulate
    before = hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert spec.spec_hash() == before
    roles = load_spec(DYNAMO_SPEC, ["target=llmapi", "dynamo.disaggregated=true", "dynamo.decode.max_batch_size=64"])
    plain = load_spec(DYNAMO_SPEC, ["target=llmapi", "dynamo.disaggregated=true"])
    assert roles.spec_hash() != plain.spec_hash()


# -- rendering ------------------------------------------------------------------------------------------------


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_role_carries_its_settings_as_flags_and_overrides(tmp_path):
    spec = load_spec(DYNAMO_SPEC, ROLES)
    ws = Workspace(tmp_path)
    groups = {g.role: g for g in render.worker_groups(spec, ws)}
    pre, dec = groups["prefill"].argv, groups["decode"].argv
    known = {n for flag, e in WORKER_FLAGS.items() for n in (flag, *e["aliases"])}
    assert {a for a in pre + dec if a.startswith("--")} <= known
    assert _after(pre, "--tensor-parallel-size") == "1" and _after(pre, "--max-num-tokens") == "4096"
    assert "--max-batch-size" not in pre and "--free-gpu-memory-fraction" not in pre  # the shared ones
    assert "--tensor-parallel-size" not in dec  # tp 2 is the shared tp
    assert _after(dec, "--max-batch-size") == "128" and _after(dec, "--free-gpu-memory-fraction") == "0.5"
    pre_over, dec_over = json.loads(_after(pre, "--override-engine-args")), json.loads(_after(dec, "--override-engine-args"))
    assert pre_over["tensor_parallel_size"] == 1 and pre_over["max_num_tokens"] == 4096
    assert pre_over["disable_overlap_scheduler"] is True and "cache_transceiver_config" in pre_over
    assert dec_over["max_batch_size"] == 128 and dec_over["kv_cache_config"] == {"free_gpu_memory_fraction": 0.5}
    assert groups["prefill"].gpus == 1 and groups["decode"].gpus == 2 and render.gpus_needed(spec) == 2 * 1 + 2
    lines = render.gpu_commands(spec, ws)[1:]
    assert [shlex.split(line)[0] for line in lines] == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1",
                                                         "CUDA_VISIBLE_DEVICES=2,3"]
    graph = manifests.graph_deployment(spec, ws)["spec"]["services"]
    assert graph["TRTLLMPrefillWorker"]["resources"]["limits"]["gpu"] == "1"
    assert graph["TRTLLMPrefillWorker"]["replicas"] == 2
    assert graph["TRTLLMDecodeWorker"]["resources"]["limits"]["gpu"] == "2"
    assert "--max-batch-size" in graph["TRTLLMDecodeWorker"]["extraPodSpec"]["mainContainer"]["args"]


def test_the_role_settings_survive_dynamos_own_merge_of_the_shared_yaml(tmp_path):
    """Dynamo's worker merges the --extra-engine-args YAML over its flags, then deep-merges the overrides
    (llm_worker.py): with its own functions, the role's values win and the YAML's other KV settings stay."""
    pytest.importorskip("dynamo.trtllm", reason="NVIDIA Dynamo is not installed (make dynamo)")
    from dynamo.trtllm.utils.trtllm_utils import deep_update

    spec = load_spec(DYNAMO_SPEC, ROLES)
    args = serve_config(spec)  # what the YAML holds: the shared values
    assert args["max_batch_size"] != 128 and args["tensor_parallel_size"] == 2
    for group in render.worker_groups(spec, Workspace(tmp_path)):
        merged = json.loads(json.dumps(args))
        deep_update(merged, json.loads(_after(group.argv, "--override-engine-args")))
        if group.role == "decode":
            assert merged["max_batch_size"] == 128 and merged["tensor_parallel_size"] == 2
            assert merged["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5
            assert merged["kv_cache_config"]["tokens_per_block"] == args["kv_cache_config"]["tokens_per_block"]
        else:
            assert merged["tensor_parallel_size"] == 1 and merged["max_num_tokens"] == 4096


def test_the_role_flags_parse_with_dynamos_own_parser(tmp_path, monkeypatch):
    """dynamo.trtllm's own argparse group (Dynamo 1.6.1 backend_args.py) reads each role's flags as the values
    the spec gives, typed as the worker uses them."""
    pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
    from dynamo_helpers import dynamo_parsers

    spec = load_spec(DYNAMO_SPEC, ROLES)
    with dynamo_parsers(monkeypatch) as (_, worker):
        parsed = {g.role: worker.parse_args(g.argv[3:]) for g in render.worker_groups(spec, Workspace(tmp_path))}
    assert (parsed["prefill"].tensor_parallel_size, parsed["prefill"].max_num_tokens) == (1, 4096)
    assert (parsed["decode"].max_batch_size, parsed["decode"].free_gpu_memory_fraction) == (128, 0.5)
    assert parsed["decode"].tensor_parallel_size == 1  # the flag's default: the shared YAML's tp 2 goes over it


def test_a_roles_tp_that_does_not_split_the_model_fails_its_check():
    spec = load_spec(LLAMA_8B_LLMAPI, [*PLAIN, "dynamo.disaggregated=true", "dynamo.decode.tp=3"])
    result = {r.id: r for r in run_checks(build_context(spec, "plan"))}["dynamo.roles"]
    assert result.status == "fail" and result.message.startswith("dynamo.decode.tp=3 does not split")
    assert "use tp 1, 2, 4, 8" in result.message and "\n" not in result.message


# -- tune -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned():
    """Llama-3-8B on 8 H100s with a 9 ms TPOT bound at ISL 4000: aggregated replicas meet it only at small
    batches, a split keeps prompts off the decode workers."""
    spec = load_spec(LLAMA_8B_LLMAPI, [*PLAIN, "validation.workload.input_tokens=4000",
                                       "validation.workload.output_tokens=200", "validation.slo.ttft_p99_ms=3000",
                                       "validation.slo.tpot_p99_ms=9"])
    return spec, search_with_disagg(spec, [spec], 8, thresholds(spec.validation.slo, []), by_cost=False)


def test_tune_ranks_splits_beside_aggregated_candidates(tuned):
    spec, result = tuned
    split = [e for e in result.ranked if e.candidate.spec.dynamo.disaggregated]
    agg = [e for e in result.ranked if not e.candidate.spec.dynamo.disaggregated]
    assert split and agg
    assert all(e.candidate.label.startswith("H100 disagg P") and "xTP" in e.candidate.label for e in split)
    per_gpu = [e.per_gpu() for e in result.ranked]
    assert per_gpu == sorted(per_gpu, reverse=True)  # one objective over both kinds
    for e in split:
        p, d = e.performance, e.performance["disaggregated"]
        used = d["prefill"]["gpus"] + d["decode"]["gpus"]
        assert used <= 8 and e.candidate.gpu_count == used
        assert p["per_gpu_output_tokens_per_s"] == pytest.approx(p["max_output_tokens_per_s"] / used, rel=1e-3)
        assert e.full_load["tpot_ms"] <= 9 and e.kept
    # the dropped splits say why per role or miss the SLO
    dropped = [e for e in result.dropped if e.candidate.spec.dynamo.disaggregated]
    assert all(e.slo_misses or all(f.split(":")[0] in ("prefill", "decode", "disagg") for f in e.failed)
               for e in dropped)


def test_tune_writes_the_chosen_split_as_a_dynamo_graph(tmp_path, capsys):
    args = ["--root", str(tmp_path), "tune", str(LLAMA_8B_LLMAPI), "--gpus", "8", "--out", str(tmp_path / "out"),
            "--top", "2"]
    for s in [*PLAIN, "validation.workload.input_tokens=4000", "validation.workload.output_tokens=200",
              "validation.slo.ttft_p99_ms=3000", "validation.slo.tpot_p99_ms=9"]:
        args += ["--set", s]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert doc["top"][0].startswith("H100 disagg P") and doc["top"][0] in out
    first = Path(doc["specs"][0])
    text = first.read_text()
    assert "# disaggregated (NVIDIA Dynamo)" in text and "predicted KV transfer" in text
    spec = load_spec(first)
    d = spec.dynamo
    assert d.disaggregated and d.prefill.tp and d.decode.tp and d.decode.max_batch_size
    row = next(c for c in doc["candidates"] if c["label"] == doc["top"][0])
    assert row["disaggregated"] and row["decode_workers"] == d.decode_workers
    # `toolchain plan` of the written spec predicts the split, as the row has it
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "plan", str(first), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["performance"]
    for key in ("per_gpu_output_tokens_per_s", "ttft_ms", "tpot_ms", "batch_size_at_max"):
        assert planned[key] == row["performance"][key], key
    assert planned["disaggregated"]["bottleneck"] == row["performance"]["disaggregated"]["bottleneck"]
    assert main(["--root", str(tmp_path), "dynamo", str(first), "--print", "--manifests",
                 str(tmp_path / "graph")]) == 0
    graph = yaml.safe_load((tmp_path / "graph" / manifests.FILES["graph"]).read_text())["spec"]["services"]
    for role, name in (("prefill", "TRTLLMPrefillWorker"), ("decode", "TRTLLMDecodeWorker")):
        service = graph[name]
        assert service["subComponentType"] == role
        assert service["replicas"] == getattr(d, f"{role}_workers")
        assert service["resources"]["limits"]["gpu"] == str(d.role(role).tp or spec.parallelism.tp)
    decode_args = graph["TRTLLMDecodeWorker"]["extraPodSpec"]["mainContainer"]["args"]
    assert _after(decode_args, "--max-batch-size") == str(d.decode.max_batch_size)


def test_no_split_where_dynamo_does_not_run_the_target(tmp_path):
    """The engine path (target trtllm) has no Dynamo worker: no split is proposed, and the note says why once."""
    spec = load_spec(LLAMA_70B_ENGINE, ["gpu.name=H200 141GB", "gpu.memory_gib=null", "gpu.sm=null"])
    result = search_with_disagg(spec, [spec], 8, thresholds(spec.validation.slo, []), by_cost=False)
    assert not [e for e in [*result.ranked, *result.dropped] if e.candidate.spec.dynamo.disaggregated]
    notes = [n for n in result.notes if n.startswith("disaggregated candidates not proposed")]
    assert len(notes) == 1 and "LLM-API path" in notes[0]


def test_splits_are_tried_where_no_aggregated_candidate_meets_the_slo():
    """A 3.0 ms TPOT bound at ISL 4000 is missed by every aggregated deployment on 8 H100s (its prompts' chunks
    ride beside the decode steps), so the splits take the formats of the fastest that fits and are the ranking."""
    spec = load_spec(LLAMA_8B_LLMAPI, [*PLAIN, "validation.workload.input_tokens=4000",
                                       "validation.workload.output_tokens=200", "validation.slo.ttft_p99_ms=3000",
                                       "validation.slo.tpot_p99_ms=3.0"])
    result = search_with_disagg(spec, [spec], 8, thresholds(spec.validation.slo, []), by_cost=False)
    assert result.ranked and all(e.candidate.spec.dynamo.disaggregated for e in result.ranked)
    assert any(not e.candidate.spec.dynamo.disaggregated and e.slo_misses and not e.failed for e in result.dropped)
    assert all(e.full_load["tpot_ms"] <= 3.0 for e in result.ranked)
