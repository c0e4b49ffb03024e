"""The LLM-API path's spec -> LLM() arguments, its plan checks, the Triton llmapi repository it
renders, and the CPU stand-in for tensorrt_llm.LLM, each held against the facts read from
TensorRT-LLM's own source (toolchain/upstream/facts/llmapi.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import write_spec
from toolchain import upstream
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

FACTS = upstream.facts("llmapi")


def llmapi_spec(tmp_path, checkpoint, target="llmapi-cpu", **sections):
    sections.setdefault("limits", {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                   "max_num_tokens": 256})
    sections.setdefault("serving", {"http_port": 0, "grpc_port": 0, "metrics_port": 0})
    return load_spec(write_spec(tmp_path / "spec.yaml", checkpoint, target=target, **sections))


def all_keys(args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        out.append(key)
        if isinstance(value, dict) and key in ("kv_cache_config", "scheduler_config"):
            out += [f"{key}.{sub}" for sub in value]
    return out


# ---- spec -> LLM() arguments ---------------------------------------------------------------------------------
def test_every_argument_the_spec_derives_is_a_field_of_the_pinned_release(tmp_path, hf_llama):
    from toolchain.llmapi.args import llm_args, llm_args_problem

    spec = llmapi_spec(tmp_path, hf_llama, target="llmapi", quantization={"kv_cache": "fp8"},
                       serving={"max_tokens_in_paged_kv_cache": 4096, "batch_scheduler_policy": "max_utilization"},
                       speculative={"mode": "ngram", "max_draft_len": 4, "ngram_size": 3})
    args = llm_args(spec, hf_llama)
    fields = {"": FACTS["llm_args"]["fields"], "kv_cache_config": FACTS["kv_cache_config"]["fields"],
              "scheduler_config": FACTS["scheduler_config"]["fields"]}
    for key in all_keys(args):
        section, _, name = key.rpartition(".")
        assert name in fields[section], key
    assert FACTS["llm_args"]["extra_forbidden"]  # why an unknown key must never reach a GPU host
    assert args["tensor_parallel_size"] == 1 and args["max_num_tokens"] == 256
    assert args["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "enable_block_reuse": True,
                                       "tokens_per_block": 32, "max_tokens": 4096, "dtype": "fp8"}
    policies = FACTS["scheduler_config"]["policies"]["CapacitySchedulerPolicy"]["members"]
    assert args["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION" in policies
    spec_cfg = args["speculative_config"]
    ngram = FACTS["speculative"]["types"]["NGram"]
    assert spec_cfg["decoding_type"] == "NGram" and "pytorch" in ngram["supports_backend"]["allows"]
    assert set(spec_cfg) - {"decoding_type"} <= set(ngram["fields"]) | set(FACTS["speculative"]["base_fields"])
    assert llm_args_problem(args) is None


def test_draft_target_maps_onto_the_draft_target_decoding_config(tmp_path, hf_llama, hf_llama_tied):
    from toolchain.llmapi.args import llm_args, llm_args_problem

    spec = llmapi_spec(tmp_path, hf_llama, target="llmapi",
                       speculative={"mode": "draft_target", "max_draft_len": 5, "draft_model": str(hf_llama_tied)})
    cfg = llm_args(spec, hf_llama)["speculative_config"]
    assert cfg == {"decoding_type": "DraftTarget", "max_draft_len": 5, "speculative_model_dir": str(hf_llama_tied)}
    assert "speculative_model_dir" in FACTS["speculative"]["base_fields"]
    assert FACTS["speculative"]["types"]["DraftTarget"]["supports_backend"]["allows"] == ["pytorch"]
    assert llm_args_problem(llm_args(spec, hf_llama)) is None


def test_engine_only_modes_are_the_ones_upstream_keeps_off_the_pytorch_backend():
    from toolchain.speculative import MODES

    types = FACTS["speculative"]["types"]
    for name in ("Medusa", "Lookahead"):
        assert "pytorch" in types[name]["supports_backend"]["excludes"], name
    engine_only = {m for m, row in MODES.items() if row.decoding_type is None and m != "none"}
    assert {"medusa", "lookahead"} <= engine_only
    for mode, row in MODES.items():
        if row.decoding_type is not None:
            allows = types[row.decoding_type]["supports_backend"]["allows"]
            assert allows == "all" or "pytorch" in allows, mode


GEMMA3_1B = Path(__file__).resolve().parents[1] / "build" / "configs" / "gemma-3-1b-it"  # config.json only


def _plan(tmp_path, checkpoint, **sections):
    from toolchain.checks.preflight import build_context, run_checks

    spec = llmapi_spec(tmp_path, checkpoint, target="llmapi", gpu={"name": "H100 80GB"}, **sections)
    ctx = build_context(spec, "plan", Workspace(tmp_path))
    return spec, ctx, {r.id: r for r in run_checks(ctx)}


@pytest.mark.parametrize("model", ["gemma3", "mistral", "llama"])
def test_sliding_windows_reach_kv_cache_config_as_the_plan_counts_them(tmp_path, request, model):
    """The plan gives each window its own share of the KV pool (memory.window_share) and caps a sequence at a
    window all layers share (memory.sequence_tokens); the PyTorch backend does so only when LLM() gets
    kv_cache_config.max_attention_window (resource_manager.py: unset, every layer gets [max_seq_len]). So what
    model.yaml / trtllm-serve.yaml carry is the windows the plan used, clamped as the backend clamps them."""
    import math

    from toolchain.llmapi.args import llm_args, llm_args_problem, serve_config
    from toolchain.plan import memory as mem

    checkpoint = {"gemma3": GEMMA3_1B, "mistral": request.getfixturevalue("hf_mistral"),
                  "llama": request.getfixturevalue("hf_llama")}[model]
    spec, ctx, results = _plan(tmp_path, checkpoint, build={"kv_cache_reuse": model != "gemma3"},
                               limits={"max_batch_size": 4, "max_input_len": 2048, "max_seq_len": 4096,
                                       "max_num_tokens": 4096})
    assert results["memory.fits"].status == "pass"
    kv = llm_args(spec, checkpoint)["kv_cache_config"]
    assert serve_config(spec)["kv_cache_config"] == kv
    p, plan = ctx.model.params, ctx.memory
    if model == "llama":
        assert "max_attention_window" not in kv and plan.sequence_tokens == 4096
        return
    windows = kv["max_attention_window"]
    assert FACTS["kv_cache_config"]["fields"]["max_attention_window"]["type"] == "Optional[List[int]]"
    assert llm_args_problem(llm_args(spec, checkpoint)) is None
    layers = p.num_hidden_layers
    per_layer = [min(windows[i % len(windows)], spec.limits.max_seq_len) for i in range(layers)]
    if model == "gemma3":  # layer i is global when (i + 1) % 6 == 0: one pool of 512-token windows, one of 4096
        assert len(windows) == layers and per_layer == [4096 if (i + 1) % 6 == 0 else 512 for i in range(layers)]
        full = mem.kv_bytes_per_token(p, tp=1, stage_layer_count=layers, kv_bytes=4)
        seq = plan.sequence_tokens
        share = sum(min(w, seq) for w in per_layer) / (layers * seq)  # 27/52 of a full-length sequence
        assert plan.ranks[0].kv_bytes_per_token == math.ceil(full * share) < full
    else:  # one window for every layer: a sequence holds only its last 8 tokens (one 32-token block)
        assert windows == [8] and plan.sequence_tokens == 32


def test_gemma3_runs_without_kv_cache_reuse_on_the_llmapi_path(tmp_path):
    """Upstream runs Gemma 3 on the PyTorch backend with block and partial reuse off (test_llm_api_pytorch.py,
    TestGemma3_1BInstruct): build.kv_cache_reuse (on by default) is refused for it with the fix, and with it off
    model.yaml turns partial reuse off too (upstream's default is on); llmapi.options cannot turn it back on."""
    from toolchain.llmapi.args import llm_args

    _, _, results = _plan(tmp_path, GEMMA3_1B)
    got = results["llmapi.kv-reuse"]
    assert got.status == "fail" and "set build.kv_cache_reuse: false" in got.message and "\n" not in got.message
    assert "TestGemma3_1BInstruct" in got.message
    spec, _, results = _plan(tmp_path, GEMMA3_1B, build={"kv_cache_reuse": False})
    assert results["llmapi.kv-reuse"].status == "pass"
    kv = llm_args(spec, GEMMA3_1B)["kv_cache_config"]
    assert kv["enable_block_reuse"] is False and kv["enable_partial_reuse"] is False
    assert FACTS["kv_cache_config"]["fields"]["enable_partial_reuse"]["default"] is True
    _, _, results = _plan(tmp_path, GEMMA3_1B, build={"kv_cache_reuse": False},
                          llmapi={"options": {"kv_cache_config": {"enable_partial_reuse": True}}})
    assert results["llmapi.kv-reuse"].status == "fail" and "remove it from llmapi.options" in \
        results["llmapi.kv-reuse"].message


def test_max_beam_width_reaches_llm_args_and_the_stand_ins_cpu_build(tmp_path, hf_llama):
    """build.max_beam_width > 1 is LLM()'s max_beam_width (BaseLlmArgs), which the stand-in builds the CPU engine
    with; one beam leaves upstream's default (None) alone; llmapi.options may not set it behind the spec's back."""
    from toolchain.llmapi.args import llm_args, llm_args_problem, options_problem
    from toolchain.llmapi.cpu_llm import engine_spec

    args = llm_args(llmapi_spec(tmp_path, hf_llama, build={"max_beam_width": 3}), hf_llama)
    assert args["max_beam_width"] == 3 and "max_beam_width" in FACTS["llm_args"]["fields"]
    assert llm_args_problem(args) is None and engine_spec(args).build.max_beam_width == 3
    assert "max_beam_width" not in llm_args(llmapi_spec(tmp_path, hf_llama), hf_llama)
    spec = llmapi_spec(tmp_path, hf_llama, llmapi={"options": {"max_beam_width": 2}})
    assert "derived from build.max_beam_width" in options_problem(spec)


def test_other_families_keep_kv_cache_reuse_on_the_llmapi_path(tmp_path, hf_llama):
    from toolchain.llmapi.args import llm_args

    spec, _, results = _plan(tmp_path, hf_llama)
    assert results["llmapi.kv-reuse"].status == "pass"
    kv = llm_args(spec, hf_llama)["kv_cache_config"]
    assert kv["enable_block_reuse"] is True and "enable_partial_reuse" not in kv


@pytest.mark.parametrize("options, fragment", [
    ({"tensor_paralel_size": 2}, "did you mean 'tensor_parallel_size'"),
    ({"kv_cache_config": {"enable_partial_reus": True}}, "kv_cache_config.enable_partial_reus"),
    ({"tensor_parallel_size": 2}, "derived from parallelism.tp"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 0.5}}, "serving.kv_cache_free_gpu_mem_fraction"),
    ({"kv_cache_config": {"max_attention_window": [16]}}, "derived from model.checkpoint"),
    ({"guided_decoding_backend": "xgrammar"}, "derived from serving.guided_decoding_backend"),
])
def test_bad_llmapi_options_fail_the_plan_in_one_line(tmp_path, hf_llama, options, fragment):
    from toolchain.checks.preflight import build_context, run_checks

    spec = llmapi_spec(tmp_path, hf_llama, llmapi={"options": options})
    results = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}
    assert results["llmapi.options"].status == "fail" and fragment in results["llmapi.options"].message
    assert "\n" not in results["llmapi.options"].message


def test_guided_decoding_backend_reaches_llm_args_from_the_serving_field(tmp_path, hf_llama):
    """LLM()'s guided_decoding_backend (default None: off) is written from serving.guided_decoding_backend, into
    model.yaml and the trtllm-serve config alike; left out when the spec leaves it unset."""
    import yaml

    from toolchain.llmapi.args import llm_args, llm_args_problem, model_yaml, serve_config

    fact = FACTS["llm_args"]["fields"]["guided_decoding_backend"]
    assert fact["default"] is None and "'xgrammar'" in fact["type"]
    spec = llmapi_spec(tmp_path, hf_llama, serving={"guided_decoding_backend": "xgrammar"})
    args = llm_args(spec, hf_llama)
    assert args["guided_decoding_backend"] == "xgrammar" and llm_args_problem(args) is None
    assert model_yaml(spec, hf_llama)["guided_decoding_backend"] == "xgrammar"
    assert yaml.safe_load(yaml.safe_dump(serve_config(spec)))["guided_decoding_backend"] == "xgrammar"
    assert "guided_decoding_backend" not in llm_args(llmapi_spec(tmp_path, hf_llama), hf_llama)


def test_known_options_pass_and_reach_model_yaml(tmp_path, hf_llama):
    from toolchain.llmapi.args import llm_args, options_problem

    options = {"kv_cache_config": {"enable_partial_reuse": False}, "cuda_graph_config": {"max_batch_size": 4},
               "stream_interval": 2}
    spec = llmapi_spec(tmp_path, hf_llama, llmapi={"options": options})
    assert options_problem(spec) is None
    args = llm_args(spec, hf_llama)
    assert args["kv_cache_config"]["enable_partial_reuse"] is False and args["kv_cache_config"]["tokens_per_block"] == 32
    assert args["cuda_graph_config"] == {"max_batch_size": 4} and args["stream_interval"] == 2


@pytest.mark.parametrize("target, sections, check, fragment", [
    ("llmapi", {"speculative": {"mode": "medusa", "max_draft_len": 4}}, "llmapi.speculative", "engine"),
    ("llmapi", {"speculative": {"mode": "lookahead"}}, "llmapi.speculative", "engine runtime"),
    ("llmapi", {"quantization": {"method": "smoothquant"}}, "llmapi.quantization", "PyTorch backend"),
    ("llmapi", {"quantization": {"method": "int4_wo"}}, "llmapi.quantization", "awq"),
    ("llmapi", {"quantization": {"kv_cache": "int8"}}, "llmapi.quantization", "fp8"),
    ("llmapi-cpu", {"speculative": {"mode": "ngram", "max_draft_len": 4}}, "llmapi.speculative", "CPU stand-in"),
])
def test_what_the_pytorch_backend_cannot_run_is_refused_at_plan_time(tmp_path, hf_llama, target, sections, check,
                                                                     fragment):
    from toolchain.checks.preflight import build_context, run_checks

    spec = llmapi_spec(tmp_path, hf_llama, target=target, gpu={"name": "H100 80GB"} if target == "llmapi" else {},
                       **sections)
    results = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}
    assert results[check].status == "fail" and fragment in results[check].message, results[check]
    # Engine-only rules are no finding on this path.
    assert not {"spec.mode-runnable", "triton.engine-dir", "build.multiple-profiles"} & set(results)


# ---- the Triton llmapi repository --------------------------------------------------------------------------
def test_repository_has_upstreams_tensors_and_model_yaml_from_the_spec(tmp_path, hf_llama):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    from toolchain.pipeline import convert_for, model_repo_for

    spec = llmapi_spec(tmp_path, hf_llama, parallelism={"tp": 2})
    ws = Workspace(tmp_path)
    assert convert_for(spec)(spec, ws).outputs["model_dir"] == str(hf_llama.resolve())  # served as it is
    model_repo_for(spec)(spec, ws)
    repo = ws.model_repo_dir(spec)
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["tensorrt_llm"]
    cfg = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig())
    tm = FACTS["triton_model"]
    got_inputs = {i.name: (pb.DataType.Name(i.data_type), list(i.dims), i.optional) for i in cfg.input}
    assert got_inputs == {n: (e["data_type"], e["dims"], e["optional"]) for n, e in tm["inputs"].items()}
    assert {o.name for o in cfg.output} == set(tm["outputs"])
    assert cfg.backend == tm["backend"] == "python"
    data = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    triton = data.pop("triton_config")
    # Written in config.pbtxt too: the launcher's --disable-auto-complete-config skips auto_complete_config.
    assert cfg.max_batch_size == triton["max_batch_size"] == 0
    assert cfg.model_transaction_policy.decoupled is triton["decoupled"] is True
    rules = FACTS["triton_model_code"]["rules"]
    assert rules["triton_config_decoupled_required"]["value"]["key"] in triton
    assert rules["triton_config_max_batch_size_required"]["value"]["key"] in triton
    assert data["model"] == str(hf_llama.resolve()) and data["tensor_parallel_size"] == 2
    assert set(all_keys(data)) <= set(FACTS["llm_args"]["fields"]) | {
        f"{s}.{k}" for s in ("kv_cache_config", "scheduler_config") for k in FACTS[s]["fields"]}
    serve = yaml.safe_load((repo / "trtllm-serve.yaml").read_text())
    assert serve == {k: v for k, v in data.items() if k != "model"}


def test_target_llmapi_needs_upstreams_model_py_and_copies_it(tmp_path, hf_llama):
    from toolchain.llmapi.repo import run_model_repo_llmapi as run_model_repo

    spec = llmapi_spec(tmp_path, hf_llama, target="llmapi")
    ws = Workspace(tmp_path)
    with pytest.raises(ToolchainError, match="--python-models"):
        run_model_repo(spec, ws)
    upstream_dir = tmp_path / "llmapi" / "tensorrt_llm" / "1"
    upstream_dir.mkdir(parents=True)
    (upstream_dir / "model.py").write_text("# upstream model\n")
    (upstream_dir / "helpers.py").write_text("# upstream helpers\n")
    run_model_repo(spec, ws, python_models=tmp_path / "llmapi")
    version = ws.model_repo_dir(spec) / "tensorrt_llm" / "1"
    assert (version / "model.py").read_text() == "# upstream model\n"
    assert (version / "helpers.py").read_text() == "# upstream helpers\n"


def test_build_engine_is_a_clear_no_op_on_this_path(tmp_path, hf_llama, capsys):
    from toolchain.cli import main as cli_main
    from toolchain.engine.build import run_build

    spec = llmapi_spec(tmp_path, hf_llama)
    with pytest.raises(ToolchainError, match="no engine to build"):
        run_build(spec, Workspace(tmp_path), converted=True)
    assert cli_main(["--root", str(tmp_path), "build-engine", str(spec.source)]) == 0
    assert "no engine to build" in capsys.readouterr().out


# ---- the CPU stand-in for tensorrt_llm.LLM -------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_llm(hf_llama_words):
    from toolchain.llmapi.cpu_llm import CpuLLM

    llm = CpuLLM(model=str(hf_llama_words), backend="pytorch", tensor_parallel_size=2, max_batch_size=4,
                 max_seq_len=128, max_num_tokens=256, kv_cache_config={"free_gpu_memory_fraction": 0.5,
                                                                       "max_tokens": 2048})
    yield llm
    llm.shutdown()


def run(llm, prompt, streaming=False, **sampling):
    import threading

    from toolchain.llmapi.cpu_llm import SamplingParams

    seen, done = [], threading.Event()

    def on_output(out):
        c = out.outputs[0]
        seen.append((c.text, c.text_diff, out.finished, list(c.token_ids)))
        if out.finished:
            done.set()

    llm.generate_async(prompt, SamplingParams.from_kwargs(sampling), streaming, on_output=on_output)
    assert done.wait(60)
    return seen


@pytest.mark.slow
def test_greedy_text_equals_the_engine_paths_cpu_engine(cpu_llm, hf_llama_words, tmp_path):
    from toolchain.engine.cpu import CpuEngine, SamplingParams

    prompt = "w5 w6 w7 w8"
    ids = cpu_llm.encode(prompt)
    want = cpu_llm.engine.generate(ids, SamplingParams(max_new_tokens=10, end_id=-1))
    seen = run(cpu_llm, prompt, max_tokens=10, ignore_eos=True, top_k=1)
    assert seen[-1][0] == cpu_llm.tokenizer.decode(want, skip_special_tokens=True)
    assert isinstance(cpu_llm.engine, CpuEngine) and cpu_llm.spec.parallelism.tp == 2


@pytest.mark.slow
def test_streamed_text_is_cumulative_and_text_diff_is_the_new_part(cpu_llm):
    seen = run(cpu_llm, "w9 w10 w11", streaming=True, max_tokens=6, ignore_eos=True)
    texts = [t for t, _, _, _ in seen]
    assert len(seen) == 6 and seen[-1][2] and not any(s[2] for s in seen[:-1])
    assert all(texts[i + 1].startswith(texts[i]) for i in range(5))
    assert "".join(s[1] for s in seen) == texts[-1]


@pytest.mark.slow
def test_defaults_and_options_follow_the_llm_apis_sampling_params(cpu_llm):
    # max_tokens defaults to 32; exclude_input_from_output=False puts the prompt's tokens in the output.
    assert len(run(cpu_llm, "w20 w21", ignore_eos=True)[-1][3]) == 32
    echoed = run(cpu_llm, "w20 w21", max_tokens=3, ignore_eos=True, exclude_input_from_output=False)[-1]
    prompt = cpu_llm.encode("w20 w21")
    assert echoed[3][:len(prompt)] == prompt and len(echoed[3]) == len(prompt) + 3 and echoed[0].startswith("w20 w21")


@pytest.mark.slow
def test_unseeded_sampled_requests_differ_as_the_pytorch_backends(cpu_llm):
    # The PyTorch backend samples unseeded requests from one generator seeded 42 per LLM(): they differ.
    def sampled(**extra):
        return tuple(run(cpu_llm, "w40 w41", max_tokens=12, ignore_eos=True, temperature=1.0, top_p=1.0,
                         **extra)[-1][3])

    assert len({sampled() for _ in range(4)}) > 1
    assert sampled(seed=99) == sampled(seed=99)


@pytest.mark.slow
def test_a_stop_string_ends_generation_and_is_left_out(cpu_llm):
    full = run(cpu_llm, "w30 w31", max_tokens=8, ignore_eos=True)[-1][3]
    words = [cpu_llm.tokenizer.decode([t]) for t in full]
    cut = next(i for i in range(2, 8) if full[i] > 2)  # an ordinary word, not a special token
    seen = run(cpu_llm, "w30 w31", max_tokens=8, ignore_eos=True, stop=[words[cut]])
    first = full.index(full[cut])
    assert seen[-1][3] == full[:first]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tensor_parallel_size": 2, "not_a_field": 1}, "unknown LLM-API argument 'not_a_field'"),
    ({"backend": "tensorrt"}, "backend 'tensorrt'"),
    ({"scheduler_config": {"capacity_scheduler_policy": "STATIC_BATCH"}}, "STATIC_BATCH"),
    ({"speculative_config": {"decoding_type": "Medusa", "max_draft_len": 4}}, "speculative_config"),
    ({"kv_cache_config": {"max_attention_window": [16]}}, "not the model's own windows"),
    ({"kv_cache_config": {"max_attention_window": [0]}}, "list of positive integers"),
    ({"guided_decoding_backend": "llguidance"}, "XGrammar only; set guided_decoding_backend: xgrammar"),
    ({"guided_decoding_backend": "outlines"}, "must be 'xgrammar' or 'llguidance'"),
])
def test_the_stand_in_refuses_what_the_real_llm_refuses_or_cannot_run(hf_llama_words, kwargs, fragment):
    from toolchain.llmapi.cpu_llm import CpuLLM, LlmArgsError

    with pytest.raises(LlmArgsError, match=fragment):
        CpuLLM(model=str(hf_llama_words), **kwargs)


@pytest.mark.slow
def test_a_guided_request_needs_guided_decoding_backend(cpu_llm):
    """This LLM() was made without guided_decoding_backend: a guided request is refused in one line saying how to
    turn it on, before anything is queued, and the LLM keeps serving."""
    from toolchain.llmapi.cpu_llm import LlmArgsError, SamplingParams
    from toolchain.llmapi.guided import GuidedDecodingParams

    with pytest.raises(LlmArgsError) as err:
        cpu_llm.generate_async("w5 w6", SamplingParams(max_tokens=2, guided_decoding=GuidedDecodingParams(regex="w+")))
    message = str(err.value)
    assert message.startswith("Guided decoding is not enabled for this LLM; ") and "\n" not in message
    assert "guided_decoding_backend='xgrammar'" in message and "serving.guided_decoding_backend" in message
    assert cpu_llm.engine.guided is None and len(run(cpu_llm, "w5 w6", max_tokens=2, ignore_eos=True)[-1][3]) == 2


@pytest.mark.parametrize("sampling, fragment", [
    ({"best_of": 2}, "Greedy decoding in the LLM API does not allow multiple returns"),
    ({"n": 2, "best_of": 1}, "best_of (1) cannot be less than n (2)"),
    ({"use_beam_search": True, "n": 2, "logprobs": 1}, "use_beam_search with logprobs above 0"),
    ({"logprobs": -1}, "logprobs must be a non-negative integer"),
    ({"guided_decoding": {"regex": "a+", "json_object": True}}, "Only one guide can be used for a request, but got 2."),
    ({"max_tokens": 0}, "max_tokens"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_sampling_params_the_llm_api_refuses(sampling, fragment):
    from toolchain.llmapi.cpu_llm import LlmArgsError, SamplingParams

    with pytest.raises(LlmArgsError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams.from_kwargs(sampling)


def test_eagle3_and_mtp_map_onto_the_pytorch_backends_decoding_configs(tmp_path, hf_llama, hf_llama_tied):
    from toolchain.llmapi.args import llm_args, llm_args_problem
    from toolchain.checks.preflight import build_context, run_checks

    spec = llmapi_spec(tmp_path, hf_llama, target="llmapi",
                       speculative={"mode": "eagle3", "max_draft_len": 3, "draft_model": str(hf_llama_tied)})
    args = llm_args(spec, hf_llama)
    assert args["speculative_config"] == {"decoding_type": "Eagle", "max_draft_len": 3,
                                          "speculative_model_dir": str(hf_llama_tied)}
    assert llm_args_problem(args) is None and FACTS["speculative"]["types"]["Eagle"]["fields"]["eagle3_one_model"]
    mtp = llmapi_spec(tmp_path, hf_llama, target="llmapi", speculative={"mode": "mtp"})
    assert llm_args(mtp, hf_llama)["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    assert "num_nextn_predict_layers" in FACTS["speculative"]["types"]["MTP"]["fields"]
    results = {r.id: r for r in run_checks(build_context(mtp, "plan", Workspace(tmp_path)))}
    assert results["llmapi.speculative"].status == "fail" and "no multi-token" not in results["llmapi.speculative"].message
    assert "multi-token prediction layers" in results["llmapi.speculative"].message  # a Llama has none


def test_engine_path_refuses_the_llmapi_only_modes(tmp_path, hf_llama, hf_llama_tied):
    from toolchain.checks.preflight import build_context, run_checks

    spec = load_spec(write_spec(tmp_path / "e.yaml", hf_llama, target="trtllm", gpu={"name": "H100 80GB"},
                                speculative={"mode": "eagle3", "max_draft_len": 3, "draft_model": str(hf_llama_tied)}))
    results = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}
    assert results["spec.mode-runnable"].status == "fail" and "target llmapi" in results["spec.mode-runnable"].message


@pytest.mark.parametrize("installed, status", [(None, "fail"), ("1.1.0", "fail"), ("1.2.1", "pass"), ("1.2.0rc8", "pass")])
def test_serving_target_llmapi_needs_the_pinned_tensorrt_llm(tmp_path, hf_llama, monkeypatch, installed, status):
    """Read from the environment's installed distributions, as importlib.metadata finds them."""
    import sys

    from toolchain.checks.preflight import build_context, run_checks

    site = tmp_path / "site"
    site.mkdir()
    if installed:
        dist = site / f"tensorrt_llm-{installed}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {installed}\n")
    monkeypatch.setattr(sys, "path", [str(site)] + [p for p in sys.path if "site-packages" not in p])
    spec = llmapi_spec(tmp_path, hf_llama, target="llmapi")
    result = {r.id: r for r in run_checks(build_context(spec, "serve", Workspace(tmp_path)))}["llmapi.runtime-version"]
    assert result.status == status, result.message
