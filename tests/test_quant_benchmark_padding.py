"""benchmarks/quantization.py make_tile_model: the tile-padded variant FP8 block scales are measured on keeps the
model's function (zero heads, zero MLP channels) and has whole tiles, on a tiny random Llama shaped like SmolLM2-135M
(query heads 3 per KV head, q and k/v rows and intermediate_size not whole tiles)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from toolchain.quant.recipe import ModelShape, tile_problems

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quantization as Q  # noqa: E402

TILE = 32


def _shape(config: dict) -> ModelShape:
    return ModelShape(config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                      config["num_key_value_heads"], config["head_dim"], config["max_position_embeddings"])


def _random_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=48, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1,
                         head_dim=16, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_tile_padding_keeps_the_function_and_makes_whole_tiles(tmp_path):
    src = _random_llama(tmp_path / "src")
    dst = Q.make_tile_model(src, tmp_path / "tiles", tile=TILE)
    before, after = (json.loads((d / "config.json").read_text()) for d in (src, dst))
    assert tile_problems(_shape(before), TILE, 1)  # 48 q rows, 16 k/v rows, 40 gate/up rows
    assert (after["num_attention_heads"], after["num_key_value_heads"], after["head_dim"],
            after["intermediate_size"]) == (6, 2, 16, 64)
    assert tile_problems(_shape(after), TILE, 1) == []
    assert Q.max_logit_diff(src, dst) < 1e-4


def test_the_check_sees_new_heads_that_change_the_function(tmp_path):
    """The new query heads attend to the new KV head: nonzero values there and o_proj columns for them move the
    logits, so the zeros (not the check) are what keep the padded model's function."""
    src = _random_llama(tmp_path / "src")
    dst = Q.make_tile_model(src, tmp_path / "tiles", tile=TILE)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.self_attn.v_proj.weight"][16:] = 0.5
    tensors["model.layers.0.self_attn.o_proj.weight"][:, 48:] = 0.5
    save_file(tensors, str(dst / "model.safetensors"))
    assert Q.max_logit_diff(src, dst) > 1e-2
