"""Helpers shared by the CPU-engine tests: engine directories built through the
real converter, cached per (model, tp, pp, limits) for the whole session, and
the Hugging Face reference outputs they are compared with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from toolchain.checkpoint.convert import convert_checkpoint

BUILD = {"max_batch_size": 8, "max_input_len": 64, "max_seq_len": 160, "max_num_tokens": 256}
PROMPTS = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], [1, 249], [7] * 20]

_CACHE: dict = {}


def make_engine_dir(hf_dir: Path, tmp: Path, tp: int = 1, pp: int = 1, *, dtype: str = "float32",
                    convert_kwargs: dict | None = None, **build) -> Path:
    """Convert `hf_dir` at tp x pp into `tmp`/checkpoint, then lay out an engine
    directory (`tmp`/engine) the way the build stage does: config.json holding the
    checkpoint config and a build_config, plus the rank files (hard-linked)."""
    ckpt, engine = Path(tmp) / "checkpoint", Path(tmp) / "engine"
    ckpt.mkdir(parents=True)
    engine.mkdir()
    pretrained = convert_checkpoint(hf_dir, ckpt, tp=tp, pp=pp, dtype=dtype, target="cpu",
                                    **(convert_kwargs or {}))
    build_config = {**BUILD, "max_beam_width": 1, **build}
    (engine / "config.json").write_text(json.dumps(
        {"version": "test", "target": "cpu", "pretrained_config": pretrained, "build_config": build_config}))
    for rank in range(tp * pp):
        name = f"rank{rank}.safetensors"
        try:
            os.link(ckpt / name, engine / name)
        except OSError:
            (engine / name).write_bytes((ckpt / name).read_bytes())
    return engine


def engine_dir(factory: pytest.TempPathFactory, hf_dir: Path, tp: int = 1, pp: int = 1, **kw) -> Path:
    """A session-cached engine directory for these arguments."""
    key = (str(hf_dir), tp, pp, json.dumps(kw, sort_keys=True))
    if key not in _CACHE:
        _CACHE[key] = make_engine_dir(hf_dir, factory.mktemp(f"engine-tp{tp}-pp{pp}"), tp, pp, **kw)
    return _CACHE[key]


def load_engine(factory, hf_dir, tp=1, pp=1, **kw):
    from toolchain.engine.cpu import CpuEngine

    key = ("engine", str(hf_dir), tp, pp, json.dumps(kw, sort_keys=True))
    if key not in _CACHE:
        _CACHE[key] = CpuEngine.load(engine_dir(factory, hf_dir, tp, pp, **kw))
    return _CACHE[key]


def hf_model(hf_dir: Path, round_to: torch.dtype | None = None):
    """The reference model in fp32 (optionally with weights rounded through `round_to`)."""
    from transformers import AutoModelForCausalLM

    key = ("hf", str(hf_dir), str(round_to))
    if key not in _CACHE:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        if round_to is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(round_to).to(torch.float32))
        model.generation_config.eos_token_id = None  # the engine runs with end_id -1: never stop early
        _CACHE[key] = model
    return _CACHE[key]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == n
    return tokens


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the box has two shared cores, and tiny matmuls gain
    nothing from a second thread but lose a lot when it is contended."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
