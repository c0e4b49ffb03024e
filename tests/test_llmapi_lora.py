"""LoRA on the LLM-API path: the spec's lora section as LLM()'s lora_config / peft_cache_config (upstream's names,
in model.yaml and the trtllm-serve YAML), upstream's LoRARequest, and the CPU stand-in for LLM() serving several
PEFT adapters in one generate call, each token for token what PEFT's merged model (merge_and_unload) generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import write_spec
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY = [*ATTN, "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
NEW_TOKENS = 8


def make_adapter(base: Path, out: Path, targets: list[str], seed: int, r: int = 4):
    """A random PEFT adapter (rank r, alpha 8) on the checkpoint in `base`, saved to `out`; returns PEFT's merged model.
    lora_B is scaled up so the adapter changes what greedy decoding picks."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, r=r, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(8.0)
    peft_model.save_pretrained(str(out))
    return peft_model.merge_and_unload().eval()


def greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def make_adapters(root: Path, base: Path) -> dict:
    """{"attn": (dir, PEFT's greedy tokens per prompt), "every": ..., None: the base's}: adapters on attention only
    and on every projection, made with PEFT under `root` for the checkpoint in `base`."""
    from transformers import LlamaForCausalLM

    made: dict = {}
    for seed, (name, targets) in enumerate((("attn", ATTN), ("every", EVERY))):
        merged = make_adapter(base, root / name, targets, seed)
        made[name] = (root / name, [greedy(merged, p) for p in PROMPTS])
    model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    made[None] = (None, [greedy(model, p) for p in PROMPTS])
    return made


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_llama_words):
    return make_adapters(tmp_path_factory.mktemp("llmapi-lora"), hf_llama_words)


def lora_spec(tmp_path, checkpoint, adapters, target="llmapi-cpu", **lora):
    data = {"adapters": {"attn": str(adapters["attn"][0]), "every": str(adapters["every"][0])}, **lora}
    return load_spec(write_spec(tmp_path / "spec.yaml", checkpoint, target=target, lora=data,
                                limits={"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                        "max_num_tokens": 256},
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0}))


# ---- LLM() arguments ------------------------------------------------------------------------------------------
def test_lora_spec_reaches_llm_args_model_yaml_and_trtllm_serve_yaml_under_upstreams_names(
        tmp_path, hf_llama_words, adapters):
    from toolchain.llmapi.args import llm_args, llm_args_problem
    from toolchain.llmapi.launch import gpu_launch_lines, serve_config_path
    from toolchain.llmapi.lora import LORA_CONFIG_FIELDS, PEFT_CACHE_CONFIG_FIELDS
    from toolchain.llmapi.repo import run_model_repo_llmapi
    from toolchain.workspace import Workspace

    spec = lora_spec(tmp_path, hf_llama_words, adapters, cache={"max_loras": 2, "gpu_memory_fraction": 0.1})
    args = llm_args(spec, hf_llama_words)
    every = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]  # module-id order
    assert args["lora_config"] == {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 4,
                                   "lora_target_modules": every, "max_loras": 2}
    assert args["peft_cache_config"] == {"host_cache_size": 1 << 30, "device_cache_percent": 0.1,
                                         "optimal_adapter_size": 8, "max_adapter_size": 64}
    assert set(args["lora_config"]) <= set(LORA_CONFIG_FIELDS)
    assert set(args["peft_cache_config"]) <= set(PEFT_CACHE_CONFIG_FIELDS)
    assert llm_args_problem(args) is None

    ws = Workspace(tmp_path / "ws")
    run_model_repo_llmapi(spec, ws)
    repo = ws.model_repo_dir(spec)
    served = yaml.safe_load(serve_config_path(spec, ws).read_text())
    model = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    for data in (served, model):
        assert data["lora_config"] == args["lora_config"] and data["peft_cache_config"] == args["peft_cache_config"]
    # Triton's llmapi model cannot pick an adapter (JIRA-4040): the repository says so rather than pretend.
    assert "JIRA-4040" in (repo / "README.md").read_text()
    # The printed trtllm-serve line passes that YAML (what the release needs to serve adapters per request).
    (tmp_path / "gpu").mkdir()
    gpu = lora_spec(tmp_path / "gpu", hf_llama_words, adapters, target="llmapi")
    assert f"--extra_llm_api_options {serve_config_path(gpu, ws)}" in gpu_launch_lines(gpu, ws)["trtllm_serve"]


def test_printed_gpu_lines_mount_each_adapter_and_name_its_lora_request(tmp_path, hf_llama_words, adapters):
    """trtllm-serve reads an adapter from the lora_path a request names, on its own filesystem: the container
    mounts each adapter directory, and the printout gives each adapter's `lora_request` body field."""
    import json

    from toolchain.llmapi.launch import container_mounts, lora_requests
    from toolchain.pipeline import print_gpu_launch
    from toolchain.workspace import Workspace

    spec = lora_spec(tmp_path, hf_llama_words, adapters, target="llmapi")
    ws = Workspace(tmp_path / "ws")
    mounts = container_mounts(spec, ws)
    for name in ("attn", "every"):
        assert str(adapters[name][0].resolve()) in mounts
    assert lora_requests(spec)["every"] == {"lora_name": "every", "lora_int_id": 2,
                                            "lora_path": str(adapters["every"][0].resolve())}
    printed: list[str] = []
    print_gpu_launch(spec, ws, printed.append)
    text = "\n".join(printed)
    assert f'"lora_request": {json.dumps(lora_requests(spec)["attn"])}' in text
    docker = next(line for line in printed if line.startswith("# in a container, the OpenAI server"))
    assert f"-v {adapters['attn'][0].resolve()}:{adapters['attn'][0].resolve()}" in docker


def test_spec_without_lora_keeps_its_llm_args(tmp_path, hf_llama_words):
    from toolchain.llmapi.args import llm_args

    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_llama_words, target="llmapi-cpu"))
    assert not {"lora_config", "peft_cache_config"} & set(llm_args(spec, hf_llama_words))


@pytest.mark.parametrize("args, fragment", [
    ({"lora_config": {"max_lora_rank": 8, "lora_target_module": ["attn_q"]}},
     "unknown key 'lora_config.lora_target_module'"),
    ({"peft_cache_config": {"host_cache_bytes": 1}}, "unknown key 'peft_cache_config.host_cache_bytes'"),
])
def test_unknown_lora_keys_are_refused_as_upstreams_classes_refuse_them(args, fragment):
    from toolchain.llmapi.args import llm_args_problem

    assert fragment in llm_args_problem({"model": "m", **args})


def test_llmapi_options_cannot_set_lora_beside_the_spec(tmp_path, hf_llama_words):
    from toolchain.llmapi.args import options_problem

    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_llama_words, target="llmapi-cpu",
                                llmapi={"options": {"lora_config": {"max_lora_rank": 8}}}))
    assert "derived from lora" in options_problem(spec)


def test_dynamo_refuses_a_lora_spec_in_one_line(tmp_path, hf_llama_words, adapters):
    from toolchain.dynamo.checks import check

    spec = lora_spec(tmp_path, hf_llama_words, adapters)
    with pytest.raises(ToolchainError) as err:
        check(spec)
    assert "do not serve LoRA" in str(err.value) and "\n" not in str(err.value)


# ---- LoRARequest and the stand-in's LoRA arguments ------------------------------------------------------------
def test_lora_request_checks_as_upstreams(tmp_path):
    from toolchain.llmapi.lora import LoRARequest

    req = LoRARequest("a", 3, str(tmp_path))
    assert (req.adapter_id, req.name, req.path, req.ckpt_source) == (3, "a", str(tmp_path), "hf")
    with pytest.raises(ValueError, match=r"^lora_path \(/nope\) does not exist\.$"):
        LoRARequest("a", 1, "/nope")
    with pytest.raises(ValueError, match=r"^lora_path \(\) does not exist\.$"):
        LoRARequest("a", 1)
    with pytest.raises(ValueError, match="lora_ckpt_source must be 'hf' or 'nemo', got 'peft'"):
        LoRARequest("a", 1, str(tmp_path), "peft")


@pytest.mark.parametrize("lora_config, fragment", [
    ({"max_lora_rank": 8, "bogus": 1}, "unknown key 'lora_config.bogus'"),
    ({"max_lora_rank": 8}, "lora_config needs lora_target_modules"),
    ({"max_lora_rank": 8, "lora_target_modules": ["attn_q"], "lora_ckpt_source": "nemo"}, "Hugging Face PEFT"),
    ({"max_lora_rank": 8, "lora_target_modules": ["moe_h_to_4h"]}, "lora"),
])
def test_the_stand_in_refuses_lora_arguments_it_cannot_run(hf_llama_words, tmp_path, lora_config, fragment):
    from toolchain.llmapi.cpu_llm import LlmArgsError, engine_spec

    with pytest.raises(LlmArgsError) as err:
        engine_spec({"model": str(hf_llama_words), "lora_config": lora_config})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_one_lora_dir_gives_the_target_modules_with_qkv_completed(hf_llama_words, adapters):
    from toolchain.llmapi.cpu_llm import engine_spec
    from toolchain.llmapi.lora import LoraConfig

    spec = engine_spec({"model": str(hf_llama_words), "lora_config": LoraConfig(lora_dir=[str(adapters["attn"][0])],
                                                                                 max_lora_rank=8),
                        "peft_cache_config": {"host_cache_size": 1 << 20}})
    assert spec.lora.target_modules == ["attn_q", "attn_k", "attn_v", "attn_dense"]
    assert spec.lora.max_lora_rank == 8 and spec.lora.cache.host_memory_bytes == 1 << 20


def test_max_cpu_loras_sizes_the_host_cache_for_that_many_adapters(hf_llama_words):
    from toolchain.llmapi.cpu_llm import engine_spec

    spec = engine_spec({"model": str(hf_llama_words), "lora_config": {
        "lora_target_modules": ["attn_q", "attn_dense"], "max_lora_rank": 8, "max_cpu_loras": 3}})
    # q, k, v (completed), dense of hidden 64, 4 heads, 2 KV heads of 16: (64+64) + 2 (64+32) + (64+64) per rank,
    # rank 8, 2 layers, float32.
    assert spec.lora.cache.host_memory_bytes == 3 * 2 * 8 * (128 + 96 + 96 + 128) * 4


# ---- CpuLLM serving adapters ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_adapters_in_one_generate_equal_pefts_merged_models(hf_llama_words, adapters, tp, tmp_path):
    from toolchain.llmapi.cpu_llm import CpuLLM, SamplingParams
    from toolchain.llmapi.lora import LoRARequest

    llm = CpuLLM(model=str(hf_llama_words), work_dir=tmp_path, tensor_parallel_size=tp, max_batch_size=4,
                 max_seq_len=128, max_num_tokens=256,
                 lora_config={"lora_target_modules": ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h",
                                                      "mlp_gate", "mlp_4h_to_h"], "max_lora_rank": 8})
    try:
        attn = LoRARequest("attn", 1, str(adapters["attn"][0]))
        every = LoRARequest("every", 2, str(adapters["every"][0]))
        assert not llm.engine.lora.has(1)  # nothing read before a request names it
        sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, top_k=1)
        outs = llm.generate(PROMPTS, sp, lora_request=[attn, every, None])
        want = [adapters["attn"][1][0], adapters["every"][1][1], adapters[None][1][2]]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert adapters["attn"][1][0] != adapters[None][1][0]  # the adapter changes the answer: the test can fail
        assert adapters["every"][1][1] != adapters[None][1][1]
        # Each adapter read once, on first use; a later request by the same id reuses it.
        assert llm.lora.loads == 2
        outs = llm.generate(PROMPTS, sp, lora_request=[every, attn, every])
        assert [o.outputs[0].token_ids for o in outs] == [adapters["every"][1][0], adapters["attn"][1][1],
                                                          adapters["every"][1][2]]
        assert llm.lora.loads == 2
        one = llm.generate(PROMPTS[0], sp, lora_request=attn)  # one prompt, one adapter: one output
        assert one.outputs[0].token_ids == adapters["attn"][1][0]
        with pytest.raises(ValueError, match="lora_request has 2 entries for 3 prompts"):
            llm.generate(PROMPTS, sp, lora_request=[attn, every])
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_lora_request_to_an_llm_without_lora_config_is_refused(hf_llama_words, adapters, tmp_path):
    from toolchain.llmapi.cpu_llm import CpuLLM, LlmArgsError, SamplingParams
    from toolchain.llmapi.lora import LoRARequest

    with CpuLLM(model=str(hf_llama_words), work_dir=tmp_path, max_batch_size=2, max_seq_len=64) as llm:
        with pytest.raises(LlmArgsError, match="created without lora_config"):
            llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=2),
                               lora_request=LoRARequest("attn", 1, str(adapters["attn"][0])))


@pytest.mark.slow
def test_an_adapter_evicted_from_the_host_cache_is_read_again_from_its_path(hf_llama_words, adapters, tmp_path):
    from toolchain.llmapi.cpu_llm import CpuLLM, SamplingParams
    from toolchain.llmapi.lora import LoRARequest

    every = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    with CpuLLM(model=str(hf_llama_words), work_dir=tmp_path, max_batch_size=2, max_seq_len=64,
                lora_config={"lora_target_modules": every, "max_lora_rank": 4, "max_cpu_loras": 1}) as llm:
        sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, top_k=1)
        order = ["attn", "every", "attn"]
        for i, name in enumerate(order):
            req = LoRARequest(name, 1 + (name == "every"), str(adapters[name][0]))
            assert llm.generate(PROMPTS[i], sp, lora_request=req).outputs[0].token_ids == adapters[name][1][i]
        assert llm.lora.loads == 3  # room for one adapter: "attn" went out for "every" and came back from disk
