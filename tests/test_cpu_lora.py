"""LoRA adapters in the CPU engine (engine/cpu/lora.py): requests under adapter A, adapter B and no adapter in one
batch give PEFT's merged model's tokens and logits, at tp 1 and 2, and the cache behaves as TensorRT-LLM's
PeftCacheManager: put once then task id only, unknown ids, resent weights ignored, LRU eviction, a full cache, the
rank and module checks, and KV prefix blocks never shared across adapters.

The base is a tiny GQA Llama built by transformers; the adapters are made by PEFT on it and converted with the
project's convert_adapter, as the engine path's convert stage does."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_hf_llama
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, make_engine_dir  # noqa: F401

from toolchain.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE, convert_adapter
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.engine.cpu.beams import children
from toolchain.engine.cpu.lora import lora_build_config, parse_lora_config
from toolchain.errors import ToolchainError

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]
MAX_RANK = 8
PROMPTS = {1: [1, 5, 9, 33, 200, 7, 12], 2: [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], None: [1, 249, 3, 8]}
NEW = 6


def make_adapter(base: Path, out: Path, targets: list[str], rank: int, seed: int):
    """A random PEFT adapter on `base` saved to `out`, and PEFT's merged model (merge_and_unload)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, r=rank, lora_alpha=2 * rank,
                                                  target_modules=targets))
    with torch.no_grad():  # PEFT's random init is mild on this scaled-up base: make each adapter change the output
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    merged = peft_model.merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    return merged


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("cpu-lora")
    base = make_hf_llama(root / "base")
    made = {"attn": make_adapter(base, root / "attn", ["q_proj", "v_proj"], 4, seed=1),
            "every": make_adapter(base, root / "every", EVERY, 8, seed=2),
            "wide": make_adapter(base, root / "wide", ["q_proj"], 16, seed=3)}
    converted = {name: convert_adapter(root / name, root / "converted" / name, "float32") for name in made}
    base_model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    base_model.generation_config.eos_token_id = None
    return {"root": root, "base": base, "merged": {**made, None: base_model}, "converted": converted}


def tensors(world, name: str) -> tuple[np.ndarray, np.ndarray]:
    directory = world["converted"][name]
    return np.load(directory / WEIGHTS_FILE), np.load(directory / CONFIG_FILE)


def lora_engine(world, tmp: Path, tp: int = 1, modules=ALL_MODULES, rank: int = MAX_RANK, **load) -> CpuEngine:
    engine_dir = make_engine_dir(world["base"], tmp, tp, plugin_config={"lora_plugin": "float32"},
                                 lora_config=lora_build_config(modules, rank))
    return CpuEngine.load(engine_dir, **load)


def greedy(task: int | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, lora_task_id=task)


def run_mixed(engine: CpuEngine) -> dict:
    """Adapter 1 (attn), adapter 2 (every) and the base model in one batch; the base joins two steps later, so
    context chunks and decoding rows of different adapters share steps. Returns task -> (tokens, logits rows)."""
    seqs = {}

    def start(task):
        seq = engine.start(PROMPTS[task], greedy(task))
        seq.generation_logits = []
        engine.add(seq)
        seqs[task] = seq

    start(1)
    start(2)
    steps = 0
    while any(not s.finished for s in seqs.values()):
        if steps == 2:
            start(None)
        live = [(s, s.pending) for s in seqs.values() if not s.finished]
        engine.step(live)
        steps += 1
    for seq in seqs.values():
        engine.release(seq)
    return {task: (seq.output, torch.cat(seq.generation_logits)) for task, seq in seqs.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_batch_matches_peft_merged(lora_world, tmp_path, tp):
    engine = lora_engine(lora_world, tmp_path, tp)
    for task, name in ((1, "attn"), (2, "every")):
        engine.lora.put(task, *tensors(lora_world, name))
    results = run_mixed(engine)
    outputs = set()
    for task, name in ((1, "attn"), (2, "every"), (None, None)):
        model = lora_world["merged"][name]
        tokens, logits = results[task]
        full = PROMPTS[task] + tokens
        expected = hf_logits(model, full[:-1])[len(PROMPTS[task]) - 1:]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert tokens == expected.argmax(-1).tolist()
        outputs.add(tuple(hf_logits(model, PROMPTS[1])[-1].argsort(descending=True)[:3].tolist()))
    assert len(outputs) > 1, "the adapters must change what the model computes"
    # The same adapter alone gives the same logits as in the mixed batch.
    alone = engine.forward_logits(PROMPTS[2] + results[2][0][:-1], lora_task_id=2)[len(PROMPTS[2]) - 1:]
    torch.testing.assert_close(alone, results[2][1], atol=1e-5, rtol=0)


def test_put_once_then_task_id_only(lora_world, tmp_path):
    engine = lora_engine(lora_world, tmp_path)
    prompt = PROMPTS[1]
    assert engine.request_problem(prompt, greedy(1)) == \
        "LoRA task 1 not found in cache. Please send LoRA weights with request"
    with pytest.raises(ToolchainError, match=r"^LoRA task 1 not found in cache\. Please send LoRA weights with request$"):
        engine.start(prompt, greedy(1))
    engine.lora.put(1, *tensors(lora_world, "attn"))
    first = engine.generate(prompt, greedy(1))
    again = engine.generate(prompt, greedy(1))  # by task id alone
    assert first == again == hf_greedy(lora_world["merged"]["attn"], prompt, NEW)
    # Weights sent again for a cached id are ignored: the old adapter stays.
    engine.lora.put(1, *tensors(lora_world, "every"))
    torch.testing.assert_close(engine.forward_logits(prompt, lora_task_id=1),
                               hf_logits(lora_world["merged"]["attn"], prompt), atol=1e-4, rtol=0)
    # Children of an n > 1 request keep the task id.
    assert {p.lora_task_id for p in children(SamplingParams(max_new_tokens=2, num_return_sequences=3,
                                                            lora_task_id=1))} == {1}


def test_eviction_is_lru_and_full_cache_refuses(lora_world, tmp_path):
    one = sum(r * (64 + out) for r, out in [(4, 64), (4, 32)]) * 2 * 4  # attn adapter: q and v rows, 2 layers, fp32
    engine = lora_engine(lora_world, tmp_path, lora_host_bytes=2 * one)
    cache = engine.lora
    weights = tensors(lora_world, "attn")
    cache.put(1, *weights)
    cache.put(2, *weights)
    assert cache.used_bytes == 2 * one
    cache.bump(1)  # 2 is now the least recently used
    cache.put(3, *weights)
    assert cache.task_ids() == [1, 3] and not cache.has(2)
    seq1 = engine.start(PROMPTS[1], greedy(1))  # requests in flight pin their adapters
    seq3 = engine.start(PROMPTS[1], greedy(3))
    with pytest.raises(ToolchainError) as err:
        cache.put(4, *weights)
    assert str(err.value) == "PEFT Cache is full. Could not store taskId=4"
    engine.release(seq1)
    cache.put(4, *weights)  # 1 is done now: evicted
    assert cache.task_ids() == [3, 4]
    engine.release(seq3)
    with pytest.raises(ToolchainError, match="PEFT Cache is full. Could not store taskId=5"):
        cache.put(5, *tensors(lora_world, "every"))  # larger than the whole cache


def test_rank_and_module_checks(lora_world, tmp_path):
    engine = lora_engine(lora_world, tmp_path / "a")
    with pytest.raises(ToolchainError, match=re.escape("Invalid low_rank (16). low_rank must be smaller than "
                                                       "mMaxLowRank (8)")):
        engine.lora.put(1, *tensors(lora_world, "wide"))
    weights, config = tensors(lora_world, "attn")
    with pytest.raises(ToolchainError, match="Expected lora weights to be the same data type as base model"):
        engine.lora.put(1, weights.astype(np.float16), config)
    attention_only = lora_engine(lora_world, tmp_path / "b", modules=["attn_q", "attn_k", "attn_v"])
    attention_only.lora.put(1, weights, config)
    with pytest.raises(ToolchainError, match=r"lora module (attn_dense|mlp_\w+) not enabled for this model"):
        attention_only.lora.put(2, *tensors(lora_world, "every"))
    assert not attention_only.lora.has(2)


def test_engine_without_lora_refuses_task(lora_world, tmp_path):
    engine = CpuEngine.load(make_engine_dir(lora_world["base"], tmp_path))
    assert engine.lora is None
    problem = engine.request_problem(PROMPTS[1], greedy(1))
    assert problem is not None and problem.startswith("this engine was built without LoRA")
    assert engine.request_problem(PROMPTS[1], greedy(-1)).startswith("lora_task_id must be a non-negative integer")


def test_prefetch_dir_and_config(lora_world, tmp_path):
    prefetch = tmp_path / "prefetch"
    for task, name in (("1", "attn"), ("2", "every")):
        (prefetch / task).mkdir(parents=True)
        for f in (WEIGHTS_FILE, CONFIG_FILE):
            (prefetch / task / f).write_bytes((lora_world["converted"][name] / f).read_bytes())
    (prefetch / "adapters").mkdir()  # not digits: skipped
    engine = lora_engine(lora_world, tmp_path / "e", lora_prefetch_dir=prefetch)
    assert engine.lora.task_ids() == [1, 2]
    torch.testing.assert_close(engine.forward_logits(PROMPTS[2], lora_task_id=2),
                               hf_logits(lora_world["merged"]["every"], PROMPTS[2]), atol=1e-4, rtol=0)
    build = {"plugin_config": {"lora_plugin": "float16"}, "lora_config": lora_build_config(["attn_q"], 8)}
    assert parse_lora_config(build, "x").target_modules == ("attn_q",)
    assert parse_lora_config({"plugin_config": {"lora_plugin": None}, "lora_config": build["lora_config"]}, "x") is None
    assert parse_lora_config({**build, "lora_config": {"max_lora_rank": 8}}, "x") is None  # no modules: off


def test_prefix_blocks_not_shared_across_adapters(lora_world, tmp_path):
    engine = lora_engine(lora_world, tmp_path)
    engine.lora.put(1, *tensors(lora_world, "attn"))
    engine.lora.put(2, *tensors(lora_world, "every"))
    tpb = engine.kv.tokens_per_block
    prompt = [(7 * i) % 250 for i in range(tpb + 5)]
    engine.generate(prompt, greedy(1))
    kv = engine.kv
    assert kv.matched_tokens(prompt, kv.reuse_root(1)) >= tpb
    assert kv.matched_tokens(prompt, kv.reuse_root(2)) == 0
    assert kv.matched_tokens(prompt, kv.reuse_root(None)) == 0
    # Adapter 2 after adapter 1 over the same prompt computes its own blocks: PEFT's tokens, not adapter 1's.
    seq = engine.start(prompt, greedy(2))
    engine.add(seq)
    assert seq.table.reused == 0
    engine.release(seq)
    expected = hf_logits(lora_world["merged"]["every"], prompt)[-1].argmax().item()
    assert engine.generate(prompt, greedy(2))[0] == expected


def test_build_records_lora_and_engine_loads_it(lora_world, tmp_path):
    import json

    from conftest import write_spec
    from toolchain.cli import main

    adapters = {"attn": str(lora_world["root"] / "attn"), "every": str(lora_world["root"] / "every")}
    spec = write_spec(tmp_path / "s.yaml", lora_world["base"], lora={"adapters": adapters})
    assert main(["--root", str(tmp_path / "ws"), "build-engine", str(spec)]) == 0
    engine_dir = tmp_path / "ws" / "engines" / "test-model" / "engine"
    build = json.loads((engine_dir / "config.json").read_text())["build_config"]
    assert build["plugin_config"]["lora_plugin"] == "float32"
    assert build["lora_config"]["max_lora_rank"] == 8 and build["lora_config"]["lora_dir"] == []
    assert build["lora_config"]["lora_target_modules"] == ALL_MODULES
    assert build["lora_config"]["trtllm_modules_to_hf_modules"]["mlp_h_to_4h"] == "gate_proj"
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["inputs"]["lora"] == {"max_lora_rank": 8, "target_modules": ALL_MODULES}
    engine = CpuEngine.load(engine_dir, lora_host_bytes=1 << 20)
    assert engine.lora is not None and engine.lora.target_modules == tuple(ALL_MODULES)
    assert engine.lora.host_bytes == 1 << 20
    # A spec without LoRA records nothing of it: its engine's manifest inputs are those it had before.
    plain = write_spec(tmp_path / "p.yaml", lora_world["base"], name="plain")
    assert main(["--root", str(tmp_path / "ws"), "build-engine", str(plain)]) == 0
    plain_dir = tmp_path / "ws" / "engines" / "plain" / "engine"
    assert set(json.loads((plain_dir / "manifest.json").read_text())["inputs"]) == {"checkpoint", "target", "format"}
    assert "lora_config" not in json.loads((plain_dir / "config.json").read_text())["build_config"]


def test_inflight_batcher_serves_adapters_side_by_side(lora_world, tmp_path):
    import threading

    from toolchain.engine.cpu import InflightBatcher

    engine = lora_engine(lora_world, tmp_path)
    engine.lora.put(1, *tensors(lora_world, "attn"))
    engine.lora.put(2, *tensors(lora_world, "every"))
    results: dict = {}
    finished_ids: set = set()
    done = threading.Event()

    def callback(rid):
        def on_tokens(tokens, finished, error):
            got = results.setdefault(rid, [[], None])
            got[0].extend(tokens)
            if finished:
                got[1] = error
                finished_ids.add(rid)
                if len(finished_ids) == 4:
                    done.set()
        return on_tokens

    with InflightBatcher(engine) as batcher:
        for rid, task in (("a", 1), ("b", 2), ("base", None), ("unknown", 9)):
            batcher.submit(rid, PROMPTS[task if task != 9 else 1], greedy(task), callback(rid))
        assert done.wait(120)
    assert results["unknown"] == [[], "LoRA task 9 not found in cache. Please send LoRA weights with request"]
    for rid, task, name in (("a", 1, "attn"), ("b", 2, "every"), ("base", None, None)):
        assert results[rid] == [hf_greedy(lora_world["merged"][name], PROMPTS[task], NEW), None], rid
    assert engine.lora._holders == {}  # finished requests no longer pin their adapters


def test_beam_search_keeps_the_adapter(lora_world, tmp_path):
    from test_engine_cpu_beams import hf_beams

    from toolchain.engine.cpu.beam_search import generate_sequences

    engine_dir = make_engine_dir(lora_world["base"], tmp_path, max_beam_width=2,
                                 plugin_config={"lora_plugin": "float32"},
                                 lora_config=lora_build_config(ALL_MODULES, MAX_RANK))
    engine = CpuEngine.load(engine_dir)
    engine.lora.put(2, *tensors(lora_world, "every"))
    params = SamplingParams(max_new_tokens=6, beam_width=2, num_return_sequences=2, lora_task_id=2)
    ours = generate_sequences(engine, PROMPTS[2], params)
    theirs = hf_beams(lora_world["merged"]["every"], PROMPTS[2], 2, 6, 0, 1.0, True, 2)
    assert [r.tokens for r in ours] == [t for t, _ in theirs]
    assert [r.score for r in ours] == pytest.approx([s for _, s in theirs], abs=1e-4)
    assert engine.lora._holders == {}


def test_float16_engine_and_refusals_at_load(lora_world, tmp_path):
    from toolchain.engine.cpu.lora import engine_problem

    engine_dir = make_engine_dir(lora_world["base"], tmp_path, dtype="float16", plugin_config={"lora_plugin": "float16"},
                                 lora_config=lora_build_config(ALL_MODULES, MAX_RANK))
    engine = CpuEngine.load(engine_dir)
    half = convert_adapter(lora_world["root"] / "every", tmp_path / "half", "float16")
    weights, config = np.load(half / WEIGHTS_FILE), np.load(half / CONFIG_FILE)
    with pytest.raises(ToolchainError, match="Expected lora weights to be the same data type as base model"):
        engine.lora.put(1, weights.astype(np.float32), config)
    engine.lora.put(1, weights, config)
    assert engine.lora.used_bytes == 8 * 1024 * 2 * 2  # rank 8 x (in + out) summed over modules, 2 layers, 2 bytes
    assert len(engine.generate(PROMPTS[1], greedy(1))) == NEW
    assert engine_problem(engine.dims, ALL_MODULES, ranks_apart=True).startswith(
        "LoRA is not run across rank processes")
