"""The embedded default model: a tiny Llama trained on the Python stdlib.

`build_tiny_model(out_dir, seed=..., steps=..., quick=...)` gathers the corpus,
trains a byte-level BPE tokenizer and the model, and writes a Hugging Face
directory (config, fp16 safetensors, tokenizer, generation config, training
record). Nothing is downloaded.
"""

from toolchain.tinymodel.build import build_tiny_model

__all__ = ["build_tiny_model"]
