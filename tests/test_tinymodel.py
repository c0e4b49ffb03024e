"""The embedded default model: `toolchain tiny-model` output and the shipped
models/tiny-llama."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from conftest import TINY_TRAINED
from toolchain.cli import cli
from toolchain.errors import ToolchainError
from toolchain.tinymodel import build_tiny_model
from toolchain.tinymodel.corpus import EXCLUDED_DIRS, load_corpus, read_text

SAMPLE = "def f(x):\n    return {'a': x ** 2}  # héllo ✓\n\tpass\n"


def load_hf(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    result = CliRunner().invoke(cli, ["tiny-model", str(out), "--quick", "--seed", "3"])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_quick_run_is_a_loadable_gqa_llama(quick_model):
    out, output = quick_model
    tok, model = load_hf(out)
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == len(tok)
    ids = tok(SAMPLE)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == SAMPLE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    record = json.loads((out / "training.json").read_text())
    assert record["seed"] == 3 and record["quick"] and "--quick" in record["command"]
    assert "held-out perplexity" in output and "uniform model" in output
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary directory left behind"


def test_same_seed_gives_same_weights(quick_model, tmp_path):
    out, _ = quick_model
    again = tmp_path / "again"
    build_tiny_model(again, seed=3, quick=True, log=lambda _: None)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ToolchainError, match="not written by"):
        build_tiny_model(tmp_path, quick=True, log=lambda _: None)
    assert (tmp_path / "precious.txt").exists()


def test_corpus_split_is_deterministic_and_excludes_tests():
    corpus = load_corpus()
    files = corpus.train + corpus.heldout
    assert not any(EXCLUDED_DIRS.intersection(p.relative_to(corpus.root).parts[:-1]) for p in files)
    assert len(corpus.heldout) == math.ceil(len(files) / 20)
    assert load_corpus() == corpus


def test_shipped_model_loads_with_expected_config():
    assert (TINY_TRAINED / "config.json").is_file(), "models/tiny-llama is missing; run `toolchain tiny-model models/tiny-llama`"
    tok, model = load_hf(TINY_TRAINED)
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (4, 2, 4)
    assert cfg.vocab_size == len(tok) == 4096
    assert tok.decode(tok(SAMPLE)["input_ids"], skip_special_tokens=True) == SAMPLE
    size = sum(p.stat().st_size for p in TINY_TRAINED.rglob("*") if p.is_file())
    assert size <= 9_000_000


def test_shipped_model_beats_uniform_on_heldout_code():
    tok, model = load_hf(TINY_TRAINED)
    heldout = max(load_corpus().heldout, key=lambda p: p.stat().st_size)
    ids = torch.tensor(tok(read_text(heldout)[:10_000])["input_ids"])
    windows = min(8, len(ids) // 256)
    ids = ids[: windows * 256].reshape(windows, 256)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    assert math.exp(nll.item()) < model.config.vocab_size / 10


def test_draft_of_shares_the_models_tokenizer(tmp_path):
    out = tmp_path / "draft"
    result = CliRunner().invoke(cli, ["tiny-model", str(out), "--quick", "--draft-of", str(TINY_TRAINED)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"] == \
        json.loads((TINY_TRAINED / "tokenizer.json").read_text())["model"]["vocab"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 4096
    record = json.loads((out / "training.json").read_text())
    assert record["draft_of"] == str(TINY_TRAINED) and f"--draft-of {TINY_TRAINED}" in record["command"]
    with pytest.raises(ToolchainError, match="no tokenizer.json"):
        build_tiny_model(tmp_path / "x", quick=True, draft_of=tmp_path, log=lambda _: None)


def test_shipped_draft_speaks_the_targets_vocabulary():
    draft = TINY_TRAINED.parent / "tiny-llama-draft"
    tok, model = load_hf(draft)
    target_tok, target = load_hf(TINY_TRAINED)
    assert tok.get_vocab() == target_tok.get_vocab() and model.config.vocab_size == target.config.vocab_size
    assert sum(p.numel() for p in model.parameters()) * 4 < sum(p.numel() for p in target.parameters())
    size = sum(p.stat().st_size for p in draft.rglob("*") if p.is_file())
    assert size <= 3_000_000
