"""`toolchain tiny-lora`: the two PEFT adapters setup makes for the embedded tiny Llama (models/tiny-llama-lora),
and the multi-LoRA specs build/tiny-llama-lora*.yaml that serve them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_TRAINED
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = REPO / "models" / "tiny-llama-lora"
SPECS = [REPO / "build" / "tiny-llama-lora.yaml", REPO / "build" / "tiny-llama-lora-llmapi.yaml"]
PROMPT = "def "


@pytest.fixture(scope="module")
def tiny_lora() -> Path:
    """models/tiny-llama-lora as `make tiny-lora` writes it (a no-op when it is current)."""
    from toolchain.tinymodel.lora import build_tiny_lora

    return build_tiny_lora(TINY_TRAINED, ADAPTERS, log=lambda msg: None)


def _greedy(adapter: Path | None, new_tokens: int = 24) -> str:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TRAINED)
    model = AutoModelForCausalLM.from_pretrained(TINY_TRAINED, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_adapters_are_peft_lora_on_attention_and_on_every_projection(tiny_lora):
    from toolchain.tinymodel.lora import ATTN, EVERY

    for name, targets, rank in (("attn", ATTN, 8), ("all", EVERY, 16)):
        config = json.loads((tiny_lora / name / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == sorted(targets)
        assert (config["r"], config["lora_alpha"]) == (rank, 2 * rank)
        assert (tiny_lora / name / "adapter_model.safetensors").is_file()
    lines: list[str] = []
    from toolchain.tinymodel.lora import build_tiny_lora

    build_tiny_lora(TINY_TRAINED, tiny_lora, log=lines.append)  # current: nothing rewritten
    assert lines == [f"{tiny_lora} is current (provenance.json matches {TINY_TRAINED}); nothing to do"]


def test_each_adapter_pulls_the_greedy_text_towards_its_own(tiny_lora):
    base = _greedy(None)
    attn, every = _greedy(tiny_lora / "attn"), _greedy(tiny_lora / "all")
    assert len({base, attn, every}) == 3, (base, attn, every)
    assert "greet" in attn and "greet" not in base, attn   # words of the adapter's own text
    assert "area" in every or "side" in every, every
    assert "area" not in base and "side" not in base, base


def test_the_specs_resolve_the_adapters_as_task_ids_1_and_2(tiny_lora):
    from toolchain.checkpoint.lora_setup import lora_setup

    for path in SPECS:
        spec = load_spec(path)
        setup = lora_setup(spec.lora)
        assert setup is not None
        assert [(a.name, a.task_id, a.rank, a.scale) for a in setup.adapters] == [("attn", 1, 8, 2.0),
                                                                                 ("all", 2, 16, 2.0)]
        assert setup.max_lora_rank == 16 and len(setup.target_modules) == 7
        assert spec.model.dtype != "bfloat16"  # the engine path refuses LoRA on bfloat16
        classes = {c.name: (c.share, c.adapter) for c in spec.validation.workload.classes}
        assert classes == {"base": (2, None), "attn": (1, "attn"), "all": (1, "all")}
        assert spec.validation.workload.concurrency == 8


def test_a_spec_before_make_tiny_lora_names_the_command(tmp_path):
    data = yaml.safe_load(SPECS[0].read_text())
    (tmp_path / "models" / "tiny-llama-lora").mkdir(parents=True)
    data["model"]["checkpoint"] = str(TINY_TRAINED)
    data["lora"]["adapters"] = {"attn": str(tmp_path / "models" / "tiny-llama-lora" / "attn")}
    data["validation"]["workload"]["classes"] = []
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ToolchainError, match="is not built yet.*make tiny-lora"):
        load_spec(path)


def test_a_class_naming_an_adapter_the_spec_lacks_is_one_line(tiny_lora):
    classes = '[{"name": "base"}, {"name": "every", "adapter": "every"}]'
    with pytest.raises(ToolchainError) as err:
        load_spec(SPECS[0], [f"validation.workload.classes={classes}"])
    assert "'every'" in str(err.value) and "attn, all" in str(err.value) and "\n" not in str(err.value)
