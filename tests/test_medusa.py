"""Medusa end to end below Triton: heads written in Medusa's Hugging Face layout, converted
into a MedusaForCausalLM checkpoint under upstream's names and tp split, and verified by the
CPU engine's tree attention with output identical to plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import MEDUSA_TREE
from conftest import write_medusa_heads as write_heads
from conftest import write_spec
from toolchain.checkpoint.medusa import read_heads
from toolchain.checkpoint.stage import run_convert
from toolchain.draft_tree import build_tree, choices_text, parse_choices, tree_problem
from toolchain.engine.build import run_build
from toolchain.engine.cpu.engine import CpuEngine
from toolchain.engine.cpu.sampling import SamplingParams
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.upstream import facts
from toolchain.workspace import Workspace

NAMES = facts("medusa")["names"]
TREE = MEDUSA_TREE


@pytest.fixture(scope="module")
def heads(tmp_path_factory, hf_llama_words) -> Path:
    return write_heads(tmp_path_factory.mktemp("heads"), hf_llama_words)


def medusa_spec(root: Path, hf_dir: Path, heads_dir: Path, tp=1, pp=1, **extra):
    root.mkdir(parents=True, exist_ok=True)
    return load_spec(write_spec(root / "spec.yaml", hf_dir, parallelism={"tp": tp, "pp": pp},
                                limits={"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128,
                                        "max_num_tokens": 256},
                                build={"tokens_per_block": 16},
                                speculative={"mode": "medusa", "heads": str(heads_dir)}, **extra))


def test_tree_helpers_round_trip_and_refuse_broken_trees():
    text = choices_text(TREE)
    assert text == "{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}"
    assert parse_choices(text) == TREE
    assert tree_problem(TREE, 3) is None
    assert "no parent" in tree_problem([[0], [1, 0]])
    assert "twice" in tree_problem([[0], [0]])
    assert "only 2 heads" in tree_problem(TREE, 2)
    with pytest.raises(ValueError):
        parse_choices("0, 1")
    # Best-first by the product of accuracies: [0,0] (0.5*0.6) beats [1] (0.2), every parent is in.
    acc = [[0.5, 0.2, 0.1], [0.6, 0.1, 0.05]]
    assert build_tree(acc, 3) == [[0], [1], [0, 0]]
    assert build_tree(acc, 2) == [[0], [0, 0]]


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_checkpoint_has_upstream_names_config_and_tp_slices(tmp_path, hf_llama_words, heads, tp):
    spec = medusa_spec(tmp_path, hf_llama_words, heads, tp=tp)
    ws = Workspace(tmp_path)
    run_convert(spec, ws)
    ckpt = ws.checkpoint_dir(spec)
    cfg = json.loads((ckpt / "config.json").read_text())
    upstream = facts("medusa")
    assert cfg["architecture"] == upstream["architecture"] == "MedusaForCausalLM"
    for key in ("num_heads", "num_layers", "max_draft_len"):
        assert upstream["config_keys"][key] in upstream["config_params"]  # MedusaConfig.__init__ takes it
    assert (cfg["num_medusa_heads"], cfg["num_medusa_layers"], cfg["max_draft_len"]) == (3, 1, len(TREE))
    src = {}
    with safe_open(str(heads / "medusa_lm_head.safetensors"), "pt") as fh:
        src = {k: fh.get_tensor(k).float() for k in fh.keys()}
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    padded = -(-vocab // tp) * tp
    ranks = []
    for r in range(tp):
        with safe_open(str(ckpt / f"rank{r}.safetensors"), "pt") as fh:
            ranks.append({k: fh.get_tensor(k) for k in fh.keys() if k.startswith("medusa_heads")})
    expected = {NAMES["trt_linear"].format(h=h, l=0, part=p) for h in range(3) for p in ("weight", "bias")}
    expected |= {NAMES["trt_lm_head"].format(h=h) for h in range(3)}
    assert set(ranks[0]) == expected
    for h in range(3):
        w = NAMES["trt_linear"].format(h=h, l=0, part="weight")
        lm = NAMES["trt_lm_head"].format(h=h)
        assert ranks[0][w].shape == (hidden // tp, hidden) and ranks[0][lm].shape == (padded // tp, hidden)
        # Column-parallel: the rank slices on dim 0, concatenated, are the heads file's tensor.
        full = torch.cat([r[w] for r in ranks]).float()
        assert torch.equal(full, src[NAMES["hf_linear"].format(h=h, l=0, part="weight")])
        full_lm = torch.cat([r[lm] for r in ranks]).float()
        assert torch.equal(full_lm[:vocab], src[NAMES["hf_lm_head"].format(h=h, L=1)])
        assert not full_lm[vocab:].any()  # vocab padding rows are zero


@pytest.mark.parametrize("base", ["hf_llama_words", "hf_qwen2", "hf_mistral"])
def test_config_names_the_base_model_type_medusa_picks_its_class_from(tmp_path, request, base):
    """MedusaForCausalLm builds on QWen when model_type names qwen and on LLaMA otherwise
    (facts medusa.json, rules base_from_model_type / config_from_model_type): the checkpoint
    carries the base's Hugging Face model_type, and a Qwen2 base its qwen_type, as
    examples/medusa/convert_checkpoint.py writes them."""
    from toolchain.checkpoint.stage import plan_convert

    hf_dir = request.getfixturevalue(base)
    spec = medusa_spec(tmp_path, hf_dir, write_heads(tmp_path / "heads", hf_dir))
    cfg = plan_convert(spec).config
    hf_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    assert cfg[facts("medusa")["config_keys"]["model_type"]] == hf_type
    assert ("qwen" in cfg["model_type"]) == (base == "hf_qwen2")
    if base == "hf_qwen2":
        assert cfg["qwen_type"] == "qwen2"


def test_quantized_base_keeps_the_heads_unquantized(tmp_path, hf_llama_words, heads):
    spec = medusa_spec(tmp_path, hf_llama_words, heads, quantization={"method": "int8_wo"})
    ws = Workspace(tmp_path)
    run_convert(spec, ws)
    cfg = json.loads((ws.checkpoint_dir(spec) / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "W8A16" and "*medusa_heads*" in cfg["quantization"]["exclude_modules"]
    with safe_open(str(ws.checkpoint_dir(spec) / "rank0.safetensors"), "pt") as fh:
        assert fh.get_tensor(NAMES["trt_linear"].format(h=0, l=0, part="weight")).dtype == torch.float32


def test_heads_that_do_not_fit_are_refused_before_any_write(tmp_path, hf_llama_words, hf_llama):
    wrong = write_heads(tmp_path / "wrong", hf_llama)  # another model's hidden size / vocab
    other_hidden = json.loads((hf_llama / "config.json").read_text())["hidden_size"]
    ours = json.loads((hf_llama_words / "config.json").read_text())["hidden_size"]
    if other_hidden != ours:
        with pytest.raises(ToolchainError, match="hidden size"):
            read_heads(wrong, hidden_size=ours)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "medusa_lm_head.pt").write_bytes(b"\x80\x04")
    with pytest.raises(ToolchainError, match="pickle"):
        read_heads(pickled)
    deep = write_heads(tmp_path / "deep", hf_llama_words, num_heads=2, choices=TREE)
    spec = medusa_spec(tmp_path / "a", hf_llama_words, deep)
    with pytest.raises(ToolchainError, match="only 2 heads"):
        run_convert(spec, Workspace(tmp_path / "a"))
    spec = medusa_spec(tmp_path / "b", hf_llama_words, write_heads(tmp_path / "h2", hf_llama_words),
                       pp=2)
    with pytest.raises(ToolchainError, match="pp"):
        run_convert(spec, Workspace(tmp_path / "b"))
    assert not (tmp_path / "a" / "engines").exists() or not any((tmp_path / "a" / "engines").rglob("rank*"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, hf_llama_words, heads):
    root = tmp_path_factory.mktemp("medusa-engines")
    ws = Workspace(root)
    spec = medusa_spec(root, hf_llama_words, heads, tp=2)
    run_convert(spec, ws)
    run_build(spec, ws)
    plain_root = tmp_path_factory.mktemp("plain-engine")
    plain = load_spec(write_spec(plain_root / "spec.yaml", hf_llama_words, parallelism={"tp": 2},
                                 limits={"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128,
                                         "max_num_tokens": 256}, build={"tokens_per_block": 16}))
    pws = Workspace(plain_root)
    run_convert(plain, pws)
    run_build(plain, pws)
    return CpuEngine.load(ws.engine_dir(spec), medusa_choices=TREE), CpuEngine.load(pws.engine_dir(plain))


PROMPTS = [[0, 5, 6, 7, 8], [0, 100, 3, 77], [0] + list(range(10, 40))]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_medusa_output_is_plain_decoding(engines, prompt):
    medusa, plain = engines
    greedy = SamplingParams(max_new_tokens=40)
    assert medusa.generate(prompt, greedy) == plain.generate(prompt, greedy)
    sampled = SamplingParams(max_new_tokens=30, temperature=0.8, top_k=20, seed=11)
    assert medusa.generate(prompt, sampled) == plain.generate(prompt, sampled)


def test_accepted_tree_nodes_keep_their_kv_in_sequence_order(engines, monkeypatch):
    """An oracle proposing plain decoding's continuation along path {0, 0, 0}: every step accepts
    three nodes from the middle of the tree, so the accepted keys must be moved into place for
    later steps to agree with plain decoding."""
    medusa, plain = engines
    prompt = PROMPTS[2]
    want = plain.generate(prompt, SamplingParams(max_new_tokens=40))
    tree = medusa.medusa
    real = type(tree).propose

    def oracle(self, head_logits):
        tokens = real(self, head_logits)
        ahead = want[len(seq.output):]  # the target's tokens after the last one emitted (the root)
        for i, p in enumerate(self.paths):
            if p == [0] * len(p) and len(p) <= len(ahead):
                tokens[i] = ahead[len(p) - 1]
        return tokens

    monkeypatch.setattr(type(tree), "propose", oracle)
    seq = medusa.start(prompt, SamplingParams(max_new_tokens=40))
    medusa.add(seq)
    try:
        steps = 0
        while not seq.finished:
            medusa.step([(seq, seq.pending)])
            steps += 1
    finally:
        medusa.release(seq)
    assert seq.output == want
    assert seq.accepted_draft >= 20 and steps <= 15, (seq.accepted_draft, steps)


def test_engine_refuses_a_tree_it_cannot_run(engines, tmp_path):
    medusa, plain = engines
    with pytest.raises(ToolchainError, match="needs its draft tree"):
        type(medusa)(medusa.config, medusa.dims, medusa.limits, medusa.model, medusa.kv, None)
    with pytest.raises(ToolchainError, match="3 Medusa heads"):
        type(medusa)(medusa.config, medusa.dims, medusa.limits, medusa.model, medusa.kv, [[0], [0, 0], [0, 0, 0],
                                                                                          [0, 0, 0, 0]])
    with pytest.raises(ToolchainError, match="without Medusa heads"):
        type(plain)(plain.config, plain.dims, plain.limits, plain.model, plain.kv, TREE)


def test_medusa_heads_command_trains_heads_the_converter_reads(tmp_path):
    """`toolchain medusa-heads` on the embedded default (quick): Medusa's layout, both spellings of
    the head count, a usable measured tree, and heads that fit the target."""
    from toolchain.cli import main

    repo = Path(__file__).resolve().parents[1]
    target = repo / "models" / "tiny-llama"
    out = tmp_path / "heads"
    assert main(["medusa-heads", str(target), str(out), "--quick", "--heads", "2", "--tree-size", "5"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    target_cfg = json.loads((target / "config.json").read_text())
    assert cfg["medusa_num_heads"] == cfg["num_medusa_heads"] == 2 and cfg["medusa_num_layers"] == 1
    assert len(cfg["medusa_choices"]) == 5 and tree_problem(cfg["medusa_choices"], 2) is None
    assert len(cfg["heldout_topk_accuracy"]) == 2
    heads = read_heads(out, hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"])
    assert heads.choices == cfg["medusa_choices"] and heads.num_params > 0
    # Another run into a directory it did not write is refused.
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert main(["medusa-heads", str(target), str(other), "--quick"]) == 2


def test_the_memory_plan_counts_the_heads_on_every_rank(tmp_path, hf_llama_words, heads):
    """The heads' bytes per rank (column slices, lm_head padded), as convert writes them."""
    from toolchain.checks.preflight import build_context

    with_heads = build_context(medusa_spec(tmp_path / "m", hf_llama_words, heads, tp=2)).memory
    plain = build_context(load_spec(write_spec(tmp_path / "p.yaml", hf_llama_words, parallelism={"tp": 2},
                                               limits={"max_batch_size": 4, "max_input_len": 32,
                                                       "max_seq_len": 128, "max_num_tokens": 256},
                                               build={"tokens_per_block": 16}))).memory
    spec = medusa_spec(tmp_path / "m2", hf_llama_words, heads, tp=2)
    ws = Workspace(tmp_path / "m2")
    run_convert(spec, ws)
    written = 0
    with safe_open(str(ws.checkpoint_dir(spec) / "rank1.safetensors"), "pt") as fh:
        for k in fh.keys():
            if k.startswith("medusa_heads"):
                t = fh.get_tensor(k)
                written += t.numel() * t.element_size()
    for a, b in zip(with_heads.ranks, plain.ranks):
        assert a.weights_bytes - b.weights_bytes == written
