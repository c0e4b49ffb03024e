"""Shared fixtures: small random Hugging Face Llama checkpoints made locally
(no download), and spec files pointing at them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY_TRAINED = REPO / "models" / "tiny-llama"


def make_hf_llama(out: Path, *, vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, seed=0,
                  dtype=torch.float32, **extra) -> Path:
    """Write a random LlamaForCausalLM (config.json + model.safetensors) to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, **extra)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; scale weights up so greedy decoding
    # is decisive and parity tests are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    """GQA Llama (4 heads, 2 KV heads), vocab 250 (not divisible by 4), untied."""
    return make_hf_llama(tmp_path_factory.mktemp("hf-llama"))


@pytest.fixture(scope="session")
def hf_llama_tied(tmp_path_factory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("hf-llama-tied"), tie_word_embeddings=True, seed=1)


def write_spec(path: Path, checkpoint: Path, **sections) -> Path:
    """Write a spec YAML for `checkpoint`; keyword arguments are top-level sections."""
    data = {"name": sections.pop("name", "test-model"), "model": {"checkpoint": str(checkpoint), "dtype": "float32"}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
